#!/usr/bin/env python3
"""Recompute every status in a results folder from its stored interval; exit 1 listing what disagrees.

Usage: python CI/check_ledger.py [FOLDER]   (default: the recorded ledger, data/results/)
"""
import sys
from pathlib import Path

from kimi_papers.core.ledger import check_results, ledger_dir


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else ledger_dir()
    if not folder.is_dir():
        print(f"check_ledger: {folder}: no such folder", file=sys.stderr)
        return 2
    problems = check_results(folder)
    for p in problems:
        print(f"check_ledger: {p}", file=sys.stderr)
    n = len(list(folder.glob("*.json")))
    print(f"check_ledger: {n} results files in {folder}, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
