"""Every notebook under nbs/ runs headlessly through papermill with the smoke profile, within its budget."""
import json
import os
from pathlib import Path

import pytest

from kimi_papers.core.run import run_notebook, workbooks

ROOT = Path(__file__).resolve().parents[1]
MATRIX = json.loads((ROOT / "CI" / "matrix.json").read_text())
BOOKS = workbooks(ROOT)
DURATIONS = ROOT / "runs" / "ci-durations.jsonl"


def _cfg(slug: str) -> dict:
    return {**MATRIX["default"], **MATRIX["notebooks"].get(slug, {})}


@pytest.mark.notebook
@pytest.mark.parametrize("book", BOOKS, ids=[b.slug for b in BOOKS])
def test_notebook_smoke(book, tmp_path):
    cfg = _cfg(book.slug)
    res = run_notebook(book, tmp_path / "out.ipynb", "smoke", cfg["params"], tmp_path / "results",
                       threads=1, timeout_s=4 * cfg["budget_s"])
    DURATIONS.parent.mkdir(exist_ok=True)
    with open(DURATIONS, "a") as fh:
        fh.write(json.dumps({"notebook": book.slug, "seconds": round(res.seconds, 1), "ok": res.ok,
                             "session": os.environ.get("KIMI_PAPERS_TEST_SESSION", "")}) + "\n")
    print(f"\n[notebook] {book.slug}: {res.seconds:.1f} s (budget {cfg['budget_s']} s)")
    assert res.ok, f"{book.slug} failed at {res.error} (executed copy: {res.output})"
    assert res.seconds <= 1.5 * cfg["budget_s"], f"{book.slug} took {res.seconds:.0f} s, budget {cfg['budget_s']} s"


def test_every_paper_notebook_exports_its_module():
    for b in BOOKS:
        if not b.is_paper:
            continue
        text = b.path.read_text()
        assert f"default_exp {b.folder}.{b.slug}" in text, b.slug
        assert (ROOT / "kimi_papers" / b.folder / f"{b.slug}.py").is_file(), b.slug


def test_committed_notebooks_open_as_a_reader_expects():
    """No papermill-injected parameters cell (Run All in Lab would re-run the full profile), a python3 kernelspec."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, str(ROOT / "CI" / "normalize_notebooks.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("book", [b for b in BOOKS if b.is_paper], ids=[b.slug for b in BOOKS if b.is_paper])
def test_parameters_cell_parses_in_papermill(book, caplog):
    """papermill reads every line of the parameters cell (a line it cannot parse is a warning under every run, and a
    parameter it cannot see gets no type for `-p`)."""
    import ast
    import logging

    import nbformat
    from papermill.translators import PythonTranslator

    cells = [c for c in nbformat.read(book.path, as_version=4).cells if "parameters" in c.metadata.get("tags", [])]
    if not cells:
        pytest.skip(f"{book.slug} has no parameters cell (a companion notebook)")
    assert len(cells) == 1, f"{book.slug}: expected one cell tagged 'parameters', found {len(cells)}"
    with caplog.at_level(logging.WARNING, logger="papermill"):
        seen = {p.name for p in PythonTranslator.inspect(cells[0])}
    assert not [r for r in caplog.records if r.name.startswith("papermill")], caplog.text
    assigned = {t.id for node in ast.parse(cells[0].source).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    assert assigned <= seen, f"{book.slug}: papermill does not see {sorted(assigned - seen)}"
