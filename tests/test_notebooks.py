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
