#!/usr/bin/env python3
"""Make committed notebooks open and re-run as a reader expects (`kimi_papers.core.run.for_readers`).

- Drops the parameters cell papermill injected during a recorded run (it follows the visible one, so "Run All" in
  JupyterLab would silently re-run the full profile); the recorded outputs stay.
- Gives every notebook the `python3` kernelspec, so Lab opens it without a "Select Kernel" dialog.

Usage: python CI/normalize_notebooks.py [--check] [NOTEBOOK ...]   (--check: list what would change, exit 1 if any)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from kimi_papers.core.io import atomic_write_text
from kimi_papers.core.run import for_readers

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    check = "--check" in argv
    paths = [Path(a) for a in argv if a != "--check"] or sorted(p for p in (ROOT / "nbs").rglob("*.ipynb")
                                                                 if ".ipynb_checkpoints" not in p.parts)
    dirty = []
    for p in paths:
        nb = json.loads(p.read_text())
        what = for_readers(nb)
        if what:
            dirty.append(f"{p}: {', '.join(what)}")
            if not check:
                atomic_write_text(p, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    print("\n".join(dirty) if dirty else "normalize_notebooks: every notebook opens and re-runs as a reader expects")
    return 1 if (check and dirty) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
