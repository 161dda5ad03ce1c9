"""Data-parallel check of kimi_papers.core.rl: 2 gloo processes on CPU reproduce the 1-process gradient."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("rl_ddp_worker.py")
TIMEOUT_S = 240


def _launch(out: Path) -> subprocess.CompletedProcess:
    """torchrun --standalone --nproc_per_node 2 on the worker; the whole process group dies on timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", KIMI_PAPERS_THREADS="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(WORKER), str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s; process group killed\n{log[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, log, "")


@pytest.fixture(scope="module")
def ddp_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rl_ddp") / "result.json"
    run = _launch(out)
    assert run.returncode == 0, f"torchrun failed (exit {run.returncode}):\n{run.stdout[-4000:]}"
    return json.loads(out.read_text())


def test_two_processes_really_ran(ddp_result):
    assert ddp_result["world_size"] == 2           # accelerate/torchrun can silently run one process
    assert ddp_result["rows_per_rank"] * 2 == 16


def test_gradient_equals_one_process(ddp_result):
    cases = ddp_result["cases"]
    assert len(cases) == 12                        # 3 losses x 4 aggregations
    for name, c in cases.items():
        assert c["grad_scale"] > 1e-4, name        # a non-trivial gradient
        assert c["grad_err"] <= 1e-6 + 1e-5 * c["grad_scale"], (name, c)
        assert c["loss_err"] <= 1e-6 + 1e-5 * abs(c["loss_1p"]), (name, c)


def test_naive_per_rank_mean_is_detected(ddp_result):
    # averaging per-rank token means is not the global token mean: the check must see the difference
    assert ddp_result["naive_grad_err"] > 1e-4


def test_fit_keeps_ranks_in_sync(ddp_result):
    assert ddp_result["param_sync_err"] == 0.0
    assert ddp_result["fit_rows"] == 4 * 4         # each rank rolled out its 4 of the 8 prompts x G = 4
