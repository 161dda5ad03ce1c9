#!/usr/bin/env python3
"""Give the committed paper notebooks the outputs of their "Use it on your own ..." cells without a full rerun.

A committed paper notebook is the executed copy of its last recorded full run. The own-data example is written to
import only from the paper's method module (and core, torch, numpy, pandas, transformers), so it runs on its own: this
script executes exactly the code cells of that section, in order, in a fresh kernel from the paper's folder, and writes
their outputs into the committed notebook (nothing else changes). A cell that fails stands without outputs and is
reported. The next recorded full run replaces these outputs with its own. Usage: python CI/fill_own_data_outputs.py [--force] [SLUG ...]
"""
from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kimi_papers.core.runner import workbooks  # noqa: E402

# what every paper notebook's first cells import (the example may use these names without importing them)
PREAMBLE = ("import math, numpy as np, pandas as pd, pytest, torch\nfrom IPython.display import display\n"
            "from kimi_papers.core import viz\nviz.setup()")
HEAD = re.compile(r"^#+\s*Use it on your own", re.M)


def own_data_cells(nb: dict) -> list[int]:
    """Indices of the example code cells of the notebook's 'Use it on your own' section (up to the next heading)."""
    cells = nb["cells"]
    start = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and HEAD.search("".join(c["source"]))), None)
    if start is None:
        return []
    out = []
    for i in range(start + 1, len(cells)):
        c = cells[i]
        if c["cell_type"] == "markdown" and re.match(r"^#+\s", "".join(c["source"]).lstrip()):
            break
        if c["cell_type"] == "code" and not "".join(c["source"]).lstrip().startswith("#|"):
            out.append(i)  # the example's cells, not library cells (#| export ...) placed after it
    return out


def fill(path: Path) -> str:
    nb = json.loads(path.read_text())
    idx = own_data_cells(nb)
    if not idx:
        return "no own-data section"
    if not FORCE and all(nb["cells"][i].get("outputs") for i in idx):
        return "outputs present (--force to redo)"
    mini = nbformat.v4.new_notebook()
    mini.metadata = copy.deepcopy(nb.get("metadata", {}))
    mini.cells = [nbformat.v4.new_code_cell(PREAMBLE)] + [nbformat.v4.new_code_cell("".join(nb["cells"][i]["source"])) for i in idx]
    client = NotebookClient(mini, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                            allow_errors=True)
    client.execute()
    errors = []
    for i, c in zip(idx, mini.cells[1:]):
        if any(o.get("output_type") == "error" for o in c.outputs):
            errors.append(f"cell {i}: " + next(o for o in c.outputs if o.get("output_type") == "error").get("ename", ""))
            continue
        nb["cells"][i]["outputs"] = [json.loads(json.dumps(o)) for o in c.outputs]
        nb["cells"][i]["execution_count"] = c.get("execution_count")
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return "; ".join(errors) or f"{len(idx)} cell(s) filled"


FORCE = "--force" in sys.argv

if __name__ == "__main__":
    want = set(a for a in sys.argv[1:] if a != "--force")
    for w in workbooks(ROOT):
        if w.is_paper and (not want or w.slug in want):
            print(f"{w.slug}: {fill(w.path)}", flush=True)
