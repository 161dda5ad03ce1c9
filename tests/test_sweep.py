"""`kimi-papers sweep` end to end on real Dask processes: a scheduler and two workers started here against the default
LocalCluster (same numbers), seeds split across workers (the ledger entries one process records), Ctrl-C and a dead
worker (no process left, the other points unharmed). The fixture notebook records `scale * N(shift, 1)` per seed."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from kimi_papers.core.runner import alive, kill_tree, process_tree

ROOT = Path(__file__).resolve().parents[1]
NB = ROOT / "tests" / "fixtures" / "sweep" / "tiny_sweep.ipynb"
BIN = Path(sys.executable).parent
KEYS = ("estimate", "ci", "n", "seeds", "samples", "status", "own_status", "reason")
pytestmark = pytest.mark.timeout(600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path) -> dict:
    return {**os.environ, "KIMI_PAPERS_PATHS_RUNS_DIR": str(tmp / "runs"), "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore"}


def _sweep(tmp: Path, *args: str, timeout: float = 400) -> tuple[subprocess.CompletedProcess, Path]:
    r = subprocess.run([str(BIN / "kimi-papers"), "sweep", str(NB), "--quiet", *args], cwd=ROOT, env=_env(tmp),
                       capture_output=True, text=True, timeout=timeout)
    runs = sorted((tmp / "runs").glob("*-sweep-tiny_sweep"))
    return r, (runs[-1] if runs else tmp / "missing")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real scheduler and two one-thread workers on 127.0.0.1 (separate processes); stopped, with their trees."""
    tmp = tmp_path_factory.mktemp("dask")
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    env = _env(tmp)
    procs = [subprocess.Popen([str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port),
                               "--no-dashboard"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    time.sleep(2)
    procs += [subprocess.Popen([str(BIN / "dask"), "worker", addr, "--nthreads", "1", "--nworkers", "1",
                                "--no-dashboard", "--name", f"w{i}"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True) for i in range(2)]
    from distributed import Client
    with Client(addr, timeout="60s") as c:
        c.wait_for_workers(2, timeout=120)
    yield addr, procs
    trees = [pid for p in procs for pid in process_tree(p.pid)]
    kill_tree(trees, 5.0)


def _kernels_under(pids) -> list[int]:
    """Live notebook kernels (ipykernel) among the descendants of `pids`."""
    out = []
    for pid in pids:
        for q in process_tree(pid):
            try:
                if "ipykernel" in Path(f"/proc/{q}/cmdline").read_bytes().decode(errors="replace"):
                    out.append(q)
            except OSError:
                pass
    return out


def test_sweep_on_a_scheduler_equals_the_local_cluster(cluster, tmp_path):
    addr, procs = cluster
    grid = ["--grid", "shift=[-3.0, 3.0]", "--grid", "scale=[1.0, 2.0]"]
    r1, d1 = _sweep(tmp_path / "remote", *grid, "--scheduler", addr)
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2, d2 = _sweep(tmp_path / "local", *grid, "--jobs", "2")
    assert r2.returncode == 0, r2.stderr[-3000:]
    t1, t2 = pd.read_csv(d1 / "sweep.csv"), pd.read_csv(d2 / "sweep.csv")
    assert len(t1) == 8 and list(t1["param:shift"].unique()) == [-3.0, 3.0]       # 4 points x 2 rows
    cols = ["point", "param:shift", "param:scale", "claim", "role", "estimate", "low", "high", "n", "status"]
    pd.testing.assert_frame_equal(t1[cols], t2[cols])
    claim = t1[t1.claim == "mean_positive"]
    assert list(claim.status) == ["not reproduced", "not reproduced", "reproduced", "reproduced"]
    assert claim.estimate.iloc[3] == pytest.approx(2 * claim.estimate.iloc[2], rel=1e-5)  # scale doubles the mean
    page = (d1 / "sweep.html").read_text()
    assert "plotly" in page.lower() and "mean_positive" in page
    assert not re.search(r"<script[^>]+src=[\"']https?://", page)                  # offline: plotly.js inlined
    assert (d1 / "points" / "003" / "tiny_sweep.ipynb").is_file() and json.loads((d1 / "sweep.json").read_text())["finished"] == 4
    assert "point(s) ok" in r1.stdout and "mean_positive" in r1.stdout
    time.sleep(1)
    assert _kernels_under([p.pid for p in procs]) == []                           # no kernel left on the workers


def test_run_on_a_scheduler_ships_back_what_the_local_cluster_writes(cluster, tmp_path):
    """`kimi-papers run --scheduler`: remote workers send the executed notebook and results back (no shared file
    system), and the entries equal those of the default LocalCluster."""
    addr, procs = cluster
    proj = tmp_path / "proj"
    (proj / "nbs" / "core").mkdir(parents=True)
    (proj / "settings.ini").write_text((ROOT / "settings.ini").read_text())
    (proj / "pyproject.toml").write_text("")
    (proj / "nbs" / "core" / "tiny_sweep.ipynb").write_text(NB.read_text())
    entries = {}
    for name, extra in (("remote", ["--scheduler", addr]), ("local", ["--jobs", "1"])):
        env = {**_env(tmp_path / name), "KIMI_PAPERS_ROOT": str(proj)}
        r = subprocess.run([str(BIN / "kimi-papers"), "run", "core.tiny_sweep", "--quiet", "-p", "shift=2.0", *extra],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        latest = (tmp_path / name / "runs" / "latest").resolve()
        executed = json.loads((latest / "core" / "tiny_sweep.ipynb").read_text())
        assert any(o.get("name") == "stdout" for c in executed["cells"] for o in c.get("outputs", []))
        data = json.loads((latest / "results" / "tiny_sweep.json").read_text())
        entries[name] = {cid: {k: item["runs"]["smoke"].get(k) for k in KEYS} for cid, item in data["claims"].items()}
        manifest = json.loads((latest / "run.json").read_text())
        assert manifest["notebooks"]["core.tiny_sweep"]["status"] == "ok"
    assert entries["remote"] == entries["local"] and entries["local"]["mean_positive"]["n"] == 3
    time.sleep(1)
    assert _kernels_under([p.pid for p in procs]) == []


def test_seeds_split_across_workers_give_one_process_entries(cluster, tmp_path):
    addr, _ = cluster
    common = ["-p", "shift=0.3", "--seeds", "0-5", "--scheduler", addr]
    r1, d1 = _sweep(tmp_path / "one", *common, "--split-seeds", "1")
    r2, d2 = _sweep(tmp_path / "two", *common, "--split-seeds", "2")
    assert r1.returncode == 0 and r2.returncode == 0, r1.stderr[-2000:] + r2.stderr[-2000:]
    a = json.loads((d1 / "points" / "000" / "results" / "tiny_sweep.json").read_text())["claims"]
    b = json.loads((d2 / "points" / "000" / "results" / "tiny_sweep.json").read_text())["claims"]
    assert sorted(a) == sorted(b) == ["mean_positive", "scale_positive"]
    for cid in a:
        ra, rb = a[cid]["runs"]["smoke"], b[cid]["runs"]["smoke"]
        assert {k: ra.get(k) for k in KEYS} == {k: rb.get(k) for k in KEYS}, cid
    assert a["mean_positive"]["runs"]["smoke"]["seeds"] == [0, 1, 2, 3, 4, 5]
    chunks = sorted((d2 / "points" / "000" / "chunks").iterdir())
    assert [json.loads((c / "point.json").read_text())["params"]["seeds"] for c in chunks] == [[0, 1, 2], [3, 4, 5]]


def test_record_is_refused_and_bad_grid_named(tmp_path):
    r, _ = _sweep(tmp_path, "--grid", "shift=[1.0]", "--record", timeout=120)
    assert r.returncode == 2 and "--record" in r.stderr and "never writes the ledger" in r.stderr
    r, _ = _sweep(tmp_path, "--grid", "shfit=[1.0]", timeout=120)
    assert r.returncode == 2 and "shfit" in r.stderr
    r, _ = _sweep(tmp_path, "--grid", "shift=2.0", timeout=120)
    assert r.returncode == 2 and "non-empty list" in r.stderr


def test_ctrl_c_stops_every_point_and_kernel(tmp_path):
    p = subprocess.Popen([str(BIN / "kimi-papers"), "sweep", str(NB), "--quiet", "--grid", "sleep_s=[60.0, 60.0]",
                          "--jobs", "2"], cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    t0 = time.time()
    while time.time() - t0 < 180 and len(_kernels_under([p.pid])) < 2:
        time.sleep(1)
    kernels = _kernels_under([p.pid])
    assert len(kernels) == 2, "the two points never started"
    tree = process_tree(p.pid)
    os.kill(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=90)
    assert p.returncode == 130, err[-3000:]
    assert "stopped by SIGINT" in err
    deadline = time.time() + 20
    while time.time() < deadline and any(alive(q) for q in tree):
        time.sleep(0.5)
    assert not [q for q in tree if alive(q)], "processes left after Ctrl-C"
    runs = sorted((tmp_path / "runs").glob("*-sweep-tiny_sweep"))
    assert runs and json.loads((runs[-1] / "sweep.json").read_text())["interrupted"] is True


def test_a_dead_worker_loses_only_its_point(tmp_path):
    r, d = _sweep(tmp_path, "--grid", "die=[false, true]", "--jobs", "2")
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    t = pd.read_csv(d / "sweep.csv")
    ok = t[t.point == 0]
    assert set(ok.status) == {"inconclusive", "holds"}                             # point 0 finished normally
    dead = t[t.point == 1]
    assert list(dead.status) == ["failed"] and "KilledWorker" in dead.reason.iloc[0]
    assert "point 1" in r.stderr and "KilledWorker" in r.stderr


def test_a_stopper_stops_its_children_and_serves_again_after_reset():
    """A worker's stopper kills the kernels it holds; without `reset` it would kill the next point's kernel at once."""
    import signal as _signal
    import subprocess as _sp
    import sys as _sys
    from kimi_papers.core.runner import Stopper
    stop, sleeper = Stopper(), [_sys.executable, "-c", "import time; time.sleep(60)"]
    first = _sp.Popen(sleeper)
    stop.add("a", first)
    assert stop.running() == 1
    stop.request(_signal.SIGTERM)
    stop.join()
    assert first.wait(10) is not None and stop.signum == _signal.SIGTERM
    stop.remove("a")
    stop.reset()
    second = _sp.Popen(sleeper)
    try:
        stop.add("b", second)
        time.sleep(0.5)
        assert second.poll() is None and stop.running() == 1 and stop.signum is None
    finally:
        second.kill()
        second.wait()
