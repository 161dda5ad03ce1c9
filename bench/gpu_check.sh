#!/usr/bin/env bash
# The one prepared GPU check: the CUDA tests (pytest -m gpu over tests/test_*gpu*.py) and the token-statistics benchmark, recorded with the
# device name. Everything it writes goes to $OUT (default runs/gpu_check): at most 7 files, one folder deep.
#
#   bash bench/gpu_check.sh [all|tests|bench]   # on a GPU machine (the device tool sets $OUT); on a CPU it skips cleanly
#   OUT=/tmp/x PYTHON=python3 bash bench/gpu_check.sh tests
#
# On a fresh H200 (no inductor cache) expect a few minutes per phase, most of it triton compilation: run it with the
# device tool's timeout_s=600, or one phase per call ("tests", then "bench") to leave room for a rerun.
#
# It installs nothing: it uses the machine's own torch ($PYTHON, else the checkout's .venv, else python3) and puts
# the checkout on PYTHONPATH. Files: env.txt, pytest_gpu.log, token_stats.json, bench.log, results/kernels.json
# (the ledger entries of `bench/token_stats.py --record`, to adopt into data/results), summary.txt.
# Budgets (seconds, each phase stops at its limit): GPU_CHECK_TEST_S (270) and GPU_CHECK_BENCH_S (270).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
PHASE=${1:-all}
case "$PHASE" in all|tests|bench) ;; *) echo "usage: bash bench/gpu_check.sh [all|tests|bench], got '$PHASE'" >&2; exit 2;; esac
OUT=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$OUT/results"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export KIMI_PAPERS_HEADLESS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export KIMI_PAPERS_PATHS_RESULTS_DIR="$OUT/results"      # the ledger writes here, never into data/results
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$HOME/.cache/kimi_papers/inductor}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "python: $PY"
  echo "commit: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  "$PY" - <<'PY'
import platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}")
print(f"cuda available: {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
PY
  command -v nvidia-smi >/dev/null && nvidia-smi -L
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
HAS_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

rc_test=0
if [ "$PHASE" != bench ]; then
  echo "== pytest -m gpu (limit ${GPU_CHECK_TEST_S:-270} s)"
  # every tests/test_*gpu*.py (a whole-suite collection would import modules this machine lacks, e.g. papermill)
  timeout "${GPU_CHECK_TEST_S:-270}" "$PY" -m pytest tests/test_*gpu*.py -m gpu -rs -q -p no:cacheprovider \
    2>&1 | tee "$OUT/pytest_gpu.log"
  rc_test=${PIPESTATUS[0]}
fi

rc_bench=0
if [ "$PHASE" = tests ]; then
  echo "phase 'tests': benchmark not run" > "$OUT/bench.log"
elif [ "$HAS_CUDA" = "1" ]; then
  echo "== bench/token_stats.py --record (limit ${GPU_CHECK_BENCH_S:-270} s)"
  timeout "${GPU_CHECK_BENCH_S:-270}" "$PY" bench/token_stats.py --device cuda --record --out "$OUT/token_stats.json" \
    2>&1 | tee "$OUT/bench.log"
  rc_bench=${PIPESTATUS[0]}
else
  echo "no CUDA device: bench/token_stats.py skipped (its CPU sizes are run by tests/test_kernels.py)" | tee "$OUT/bench.log"
fi

{
  echo "pytest -m gpu: exit $rc_test ($(tail -n 1 "$OUT/pytest_gpu.log" 2>/dev/null || echo 'not run'))"
  echo "bench/token_stats.py: exit $rc_bench"
  [ -f "$OUT/results/kernels.json" ] && echo "ledger entries: $OUT/results/kernels.json"
} | tee "$OUT/summary.txt"
[ "$rc_test" -ne 0 ] && exit "$rc_test"
exit "$rc_bench"
