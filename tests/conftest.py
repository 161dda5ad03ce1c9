"""Shared pytest set-up: headless, offline, one torch thread per xdist worker, a shared compile cache."""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("KIMI_PAPERS_HEADLESS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "kimi_papers" / "inductor"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# ---- total notebook time, printed at the end of the run (the suite grows to ~45 notebooks)
_DURATIONS = ROOT / "runs" / "ci-durations.jsonl"


def pytest_configure(config):
    # one id per top-level run, inherited by xdist workers and by any pytest a test starts (bench/gpu_check.sh):
    # the summary counts only this run's notebooks, and a nested run cannot wipe them
    if not hasattr(config, "workerinput"):
        import uuid
        os.environ.setdefault("KIMI_PAPERS_TEST_SESSION", uuid.uuid4().hex)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import json
    if hasattr(config, "workerinput") or not _DURATIONS.is_file():
        return
    session = os.environ.get("KIMI_PAPERS_TEST_SESSION")
    rows = [r for r in (json.loads(line) for line in _DURATIONS.read_text().splitlines() if line.strip())
            if r.get("session") == session]
    if rows:
        total = sum(r["seconds"] for r in rows)
        slow = sorted(rows, key=lambda r: -r["seconds"])[:5]
        terminalreporter.write_line(
            f"notebooks: {len(rows)} ran, {total:.0f} s of notebook time in all; slowest: "
            + ", ".join(f"{r['notebook']} {r['seconds']:.0f} s" for r in slow))


# ---- `gpu` tests run only where CUDA is present; elsewhere they are skipped with the reason shown by `pytest -rs`
def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch
    if torch.cuda.is_available():
        return
    import pytest
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (torch.cuda.is_available() is False here); "
                                   "bench/gpu_check.sh runs these where a GPU is lent")
    for item in gpu_items:
        item.add_marker(skip)
