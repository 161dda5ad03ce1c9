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


# --- a scratch project with tiny notebooks: real runs through the console script, never touching this checkout ---
import json
import re
import signal
import time

import nbformat

from kimi_papers.core.run import alive


def _nb(path, *cells, params=None):
    """Write a notebook: an optional parameters cell (source), then code cells."""
    cs = [nbformat.v4.new_markdown_cell(f"# {path.stem}")]
    if params is not None:
        pc = nbformat.v4.new_code_cell(params)
        pc.metadata["tags"] = ["parameters"]
        cs.append(pc)
    cs += [nbformat.v4.new_code_cell(c) for c in cells]
    nb = nbformat.v4.new_notebook(cells=cs)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


QUICK_RECORD = """
from kimi_papers.core.ledger import Claim, record
record(Claim("quick", "steps_at_least_four", "steps is at least four", "4", "toy", "steps", threshold=4, direction=">="),
       [steps, steps + 0.1, steps - 0.1], profile, seeds=[0, 1, 2])
assert steps >= 0, "steps must be non-negative"  # fails after recording (the --record test uses it)
"""
SLEEPY = """
import os, subprocess, time
child = subprocess.Popen(["sleep", "300"])
tmp = os.environ["SLEEPY_PIDFILE"] + ".tmp"
open(tmp, "w").write(f"{os.getppid()} {os.getpid()} {child.pid}")
os.replace(tmp, os.environ["SLEEPY_PIDFILE"])
time.sleep(300)
"""


@pytest.fixture
def proj(tmp_path):
    root = tmp_path / "proj"
    (root / "nbs" / "core").mkdir(parents=True)
    (root / "settings.ini").write_text((ROOT / "settings.ini").read_text())
    (root / "pyproject.toml").write_text("")
    # `a = b = 0` is a line papermill cannot parse: it warns, and the runner must show that warning
    _nb(root / "nbs" / "core" / "quick.ipynb", "assert isinstance(steps, int)", QUICK_RECORD,
        params='profile = "smoke"\nsteps = 3  # iterations\nlr = 0.1\na = b = 0')
    _nb(root / "nbs" / "core" / "sleepy.ipynb", SLEEPY)
    _nb(root / "nbs" / "core" / "zzz.ipynb", "x = 1")
    return root


def _env(root, **extra):
    return {"KIMI_PAPERS_ROOT": str(root), "SLEEPY_PIDFILE": str(root / "sleepy.pids"), "OMP_NUM_THREADS": "1", **extra}


@pytest.mark.parametrize("args,msg", [
    (["-p", "step=5"], "kimi-papers: error: -p step: not a parameter of core.quick (did you mean steps?); its parameters: profile, steps, lr"),
    (["-p", "steps=abc"], "kimi-papers: error: -p steps='abc': expected an int like 3 (core.quick's default), got str"),
    (["-p", "steps=2.5"], "expected an int like 3"),
    (["-p", "lr=fast"], "-p lr='fast': expected a number like 0.1"),
])
def test_bad_parameter_is_rejected_before_anything_runs(proj, args, msg):
    r = cli("run", "core.quick", "--quiet", *args, env=_env(proj))
    assert r.returncode == 2, r
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and msg in r.stderr, r.stderr
    assert not (proj / "runs").exists(), "nothing may run (or create a run folder) before the parameters are checked"


def test_real_notebooks_reject_the_old_readme_example():
    r = cli("run", "spec_md", "-p", "capacity_pct=5")
    assert r.returncode == 2 and "did you mean capacity_pcts?" in r.stderr, r.stderr


def test_results_go_to_the_run_folder_and_only_record_writes_the_ledger(proj):
    r = cli("run", "core.quick", "--quiet", "-p", "steps=5", "-p", "lr=1", env=_env(proj))
    assert r.returncode == 0, r.stderr
    latest = proj / "runs" / "latest"
    assert latest.is_symlink() and (latest / "results" / "quick.json").is_file()
    assert not (proj / "data").exists(), "an ordinary run must not write the tracked ledger"
    assert not (proj / "runs" / "results").exists()
    run = json.loads((latest / "results" / "quick.json").read_text())["claims"]["steps_at_least_four"]["runs"]["smoke"]
    assert run["estimate"] == pytest.approx(5.0) and run["n"] == 3  # the -p values reached the notebook
    assert "claims of this run" in r.stdout and "steps_at_least_four" in r.stdout, r.stdout
    assert "papermill: Unable to parse line" in r.stdout, "papermill's warnings are shown"
    manifest = json.loads((latest / "run.json").read_text())
    assert manifest["notebooks"]["core.quick"]["status"] == "ok" and manifest["record"] is False

    html = proj / "board.html"
    b = cli("board", "--results", str(latest / "results"), "--html", str(html), env=_env(proj))
    assert b.returncode == 0 and "steps_at_least_four" in b.stdout, b
    assert html.read_text().lstrip().lower().startswith("<!doctype html") and "steps_at_least_four" in html.read_text()
    assert "no results in" in cli("board", env=_env(proj)).stdout  # the default is the (empty) recorded ledger

    listing = cli("list", env=_env(proj)).stdout
    assert re.search(r"^core\.quick\s+core\s+ok 20\d\d-\d\d-\d\d \d\d:\d\d", listing, re.M), listing

    rec = cli("run", "core.quick", "--quiet", "--record", env=_env(proj))
    assert rec.returncode == 0, rec.stderr
    recorded = proj / "data" / "results" / "quick.json"
    assert recorded.is_file()
    assert latest.resolve() == (proj / "runs" / manifest_dir(latest)).resolve(), "a recorded run leaves runs/latest alone"
    # a recorded run that fails after recording never touches the ledger; one that succeeds replaces its entries
    before = recorded.read_text()
    bad = cli("run", "core.quick", "--quiet", "--record", "-p", "steps=-1", env=_env(proj))
    assert bad.returncode == 1 and recorded.read_text() == before, bad.stderr
    good = cli("run", "core.quick", "--quiet", "--record", "-p", "steps=7", env=_env(proj))
    assert good.returncode == 0, good.stderr
    est = json.loads(recorded.read_text())["claims"]["steps_at_least_four"]["runs"]["smoke"]["estimate"]
    assert est == pytest.approx(7.0)


def manifest_dir(latest):
    return os.readlink(latest)


def _pgroup_alive(pgid):
    """Whether any live (non-zombie) process is in process group `pgid`."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def _wait_for(path, timeout):
    t0 = time.monotonic()
    while not path.is_file():
        assert time.monotonic() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.1)
    return [int(x) for x in path.read_text().split()]


def _assert_all_gone(pids):
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "orphans left: papermill, its kernel or the kernel's child"
    assert not _pgroup_alive(pids[1]), "something is left in the kernel's process group"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks processes through /proc")
def test_sigint_stops_the_whole_run_at_once(proj):
    p = subprocess.Popen([sys.executable, "-m", "kimi_papers.core.run", "run", "core.quick", "core.sleepy", "core.zzz",
                          "--jobs", "1", "--quiet"], cwd=ROOT, env={**os.environ, **_env(proj)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = _wait_for(proj / "sleepy.pids", 120)  # papermill, the kernel, the kernel's own child
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert took < 8, f"took {took:.1f} s to stop"
    assert p.returncode == 130, (p.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.fullmatch(r"kimi-papers: interrupted by SIGINT; finished: core\.quick \(ok\); "
                        r"incomplete: core\.sleepy -> \S+/core/sleepy\.incomplete\.ipynb; not started: core\.zzz", lines[0]), lines[0]
    run_dir = next((proj / "runs").glob("2*"))
    assert (run_dir / "core" / "sleepy.incomplete.ipynb").is_file() and not (run_dir / "core" / "sleepy.ipynb").exists()
    assert (run_dir / "core" / "quick.ipynb").is_file()
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["interrupted"] == "SIGINT" and manifest["notebooks"]["core.sleepy"]["status"] == "interrupted"
    assert manifest["notebooks"]["core.zzz"]["status"] == "not started"
    _assert_all_gone(pids)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="checks processes through /proc")
def test_a_timed_out_notebook_leaves_no_orphans(proj):
    # the timeout is 4x the profile budget: 4 x 5 s
    r = subprocess.run([sys.executable, "-m", "kimi_papers.core.run", "run", "core.sleepy", "--quiet"], cwd=ROOT,
                       env={**os.environ, **_env(proj, KIMI_PAPERS_PROFILES_SMOKE_BUDGET_S="5")},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "core.sleepy failed at timed out after 20 s" in r.stderr, r
    pids = [int(x) for x in (proj / "sleepy.pids").read_text().split()]
    _assert_all_gone(pids)
    assert list((proj / "runs").glob("2*/core/sleepy.incomplete.ipynb"))


def test_make_lab_allows_root_only_as_root():
    r = subprocess.run(["make", "-n", "-o", ".venv/.installed", "lab"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    line = [l for l in r.stdout.splitlines() if "jupyter lab" in l]
    assert line and (("--allow-root" in line[0]) == (os.geteuid() == 0)), r.stdout


def test_contributing_names_real_make_targets_and_stays_in_the_repo():
    text = (ROOT / "CONTRIBUTING.md").read_text()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    named = set(re.findall(r"`make ([\w-]+)", text))
    assert named and named <= targets, f"CONTRIBUTING.md names make targets that do not exist: {named - targets}"
    assert "../" not in text, "CONTRIBUTING.md points outside the repository"
