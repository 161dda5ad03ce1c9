#!/usr/bin/env python3
"""Redraw the 'Results at a glance' outputs of committed paper notebooks from the recorded ledger (data/results/).

A recorded row can be re-labelled without a rerun (`ledger.amend`: a role, a gate, a null arm); the committed notebook
then still shows the old verdicts at its top. This rewrites only the outputs of the `ledger.glance(...)` cells, from
data/results alone, so a reader sees the ledger's current statuses. Usage: python CI/refresh_glance.py [SLUG ...]
"""
import json
import re
import sys
from pathlib import Path

from kimi_papers.core.board import glance_html
from kimi_papers.core.io import atomic_write_text
from kimi_papers.core.ledger import ledger_dir, results_path

ROOT = Path(__file__).resolve().parents[1]
GLANCE = re.compile(r'(?:ledger|board)\.glance\("([a-z0-9_]+)"(, update=True)?\)')


def refresh(path: Path) -> bool:
    """Rewrite the glance outputs of one notebook; True if it changed."""
    nb = json.loads(path.read_text())
    changed = False
    for cell in nb["cells"]:
        m = GLANCE.search("".join(cell.get("source", []))) if cell["cell_type"] == "code" else None
        if not m or not results_path(m.group(1), ledger_dir()).is_file():
            continue
        html = glance_html(m.group(1), ledger_dir())
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if out.get("output_type") == "display_data" and "text/html" in data and "Results at a glance" in "".join(data["text/html"]):
                new = html.splitlines(True)
                if data["text/html"] != new:
                    data["text/html"], changed = new, True
    if changed:
        atomic_write_text(path, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return changed


def main(argv: list[str]) -> int:
    nbs = sorted(p for p in (ROOT / "nbs").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    if argv:
        nbs = [p for p in nbs if p.stem in argv]
    done = [p.relative_to(ROOT) for p in nbs if refresh(p)]
    print(f"refresh_glance: {len(done)} notebook(s) redrawn from {ledger_dir()}: " + ", ".join(map(str, done)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
