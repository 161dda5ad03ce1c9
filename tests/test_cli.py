"""The `kimi-papers` console script: bad input gives one clear line and a non-zero exit."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kimi_papers.core.run", *args], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args,msg", [
    (["run", "no_such_paper"], "unknown slug 'no_such_paper'"),
    (["run", "core.config", "--profile", "huge"], "profile='huge'"),
    (["run", "core.config", "-p", "steps"], "expected key=value"),
    (["run", "core.config", "--jobs", "-1"], "--jobs=-1"),
])
def test_bad_input_is_one_clear_line(args, msg):
    r = cli(*args)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kimi-papers: error:") and msg in lines[0], r.stderr


def test_bad_settings_value_is_one_clear_line():
    r = cli("list", env={"KIMI_PAPERS_RUN_JOBS": "many"})
    assert r.returncode == 2
    assert r.stderr.strip() == "kimi-papers: error: settings.ini [run] jobs = 'many': expected a non-negative integer"


def test_list_and_board():
    r = cli("list")
    assert r.returncode == 0 and "core.run" in r.stdout
    r = cli("board")
    assert r.returncode == 0


def test_failed_notebook_is_named_with_its_cell(tmp_path):
    import nbformat
    root = tmp_path / "proj"
    (root / "nbs" / "core").mkdir(parents=True)
    (root / "settings.ini").write_text((ROOT / "settings.ini").read_text())
    (root / "pyproject.toml").write_text("")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Broken"),
                                         nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("assert x == 2, 'x is not two'")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "nbs" / "core" / "broken.ipynb")
    r = cli("run", "core.broken", "--quiet", env={"KIMI_PAPERS_ROOT": str(root)})
    assert r.returncode == 1, r
    assert "core.broken failed at code cell 2" in r.stderr and "x is not two" in r.stderr, r.stderr
    assert list((root / "runs").glob("*/core/broken.ipynb")), "the executed copy is kept under runs/"
