"""A seed fixes the numbers: running a paper's smoke notebook twice records identical measured values."""
import json
from pathlib import Path

import pytest

from kimi_papers.core.run import run_notebook, select

ROOT = Path(__file__).resolve().parents[1]
MATRIX = json.loads((ROOT / "CI" / "matrix.json").read_text())
PAPERS = [s for s in MATRIX.get("determinism", []) if any((ROOT / "nbs").rglob(f"{s}.ipynb"))]


def _measured(folder: Path) -> dict:
    """Each recorded claim's measured value and status (context is left out: it may hold wall-clock timings)."""
    out = {}
    for p in sorted(folder.glob("*.json")):
        for cid, item in json.loads(p.read_text())["claims"].items():
            for prof, run in item["runs"].items():
                out[(p.stem, cid, prof)] = (json.dumps(run["measured"]), run["status"])  # json: NaN == NaN
    return out


@pytest.mark.notebook
@pytest.mark.parametrize("slug", PAPERS)
def test_smoke_twice_gives_identical_numbers(slug, tmp_path):
    book = select([slug], ROOT)[0]
    runs = []
    for i in range(2):
        res = run_notebook(book, tmp_path / f"out{i}.ipynb", "smoke", {}, tmp_path / f"results{i}", threads=1, timeout_s=300)
        assert res.ok, res.error
        runs.append(_measured(tmp_path / f"results{i}"))
    assert runs[0], f"{slug} recorded nothing"
    assert runs[0] == runs[1]
