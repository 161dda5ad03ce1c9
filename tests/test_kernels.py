"""kernels: the compile fallback with a broken C++ toolchain, and the benchmark script's command line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "token_stats.py"

FALLBACK_SCRIPT = """
import warnings, torch
from kimi_papers.core.kernels import compile_fn, compiled_ran, compile_info
f = compile_fn(lambda x: torch.exp(x) * 2 + 1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    x = torch.randn(16)
    assert torch.allclose(f(x), torch.exp(x) * 2 + 1)
    f(x)
msgs = [str(w.message) for w in caught if "compile_fn" in str(w.message)]
assert len(msgs) == 1, msgs
assert "torch.compile failed for <lambda>" in msgs[0], msgs
assert not compiled_ran(f) and compile_info(f)["error"]
print("fallback-ok")
"""


@pytest.mark.slow
def test_compile_falls_back_visibly_without_a_cxx_compiler(tmp_path):
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "fallback-ok" in r.stdout, r.stderr[-3000:]


def bench(*args, timeout=60, **env):
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


@pytest.mark.parametrize("args,msg", [
    (["--n", "0"], "--n=0: expected an integer >= 1"),
    (["--v", "1"], "--v=[1]: expected vocabulary sizes >= 2"),
    (["--warmup", "0"], "--warmup=0"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
])
def test_bench_rejects_bad_arguments(args, msg):
    r = bench("--device", "cpu", *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_bench_refuses_sizes_that_do_not_fit():
    r = bench("--device", "cpu", "--n", "1000000", "--v", "1000000")
    assert r.returncode != 0 and "pass smaller --n/--v" in r.stderr, r.stderr


@pytest.mark.slow
def test_bench_small_cpu_run_writes_json(tmp_path):
    out = tmp_path / "ts.json"
    results = tmp_path / "results"
    r = bench("--device", "cpu", "--n", "64", "--v", "2048", "--d", "32", "--dtype", "float32", "--repeat", "2",
              "--warmup", "1", "--rounds", "2", "--out", str(out), "--record", timeout=600,
              KIMI_PAPERS_PATHS_RESULTS_DIR=str(results))
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    names = {(row["name"], row["mode"]) for row in data["rows"]}
    assert ("fused", "fwd") in names and ("fused", "fwd+bwd") in names and ("read once", "fwd") in names
    assert sorted(row["round"] for row in data["rows"] if row["name"] == "fused") == [0, 0, 1, 1]   # fwd and fwd+bwd
    assert all(row["median_ms"] > 0 for row in data["rows"]) and data["meta"]["device"].startswith("CPU")
    assert {g["goal"] for g in data["goals"]} == {"peak_vs_logits_v2048", "speedup_vs_eager_v2048"}
    assert all(g["n"] == 2 and g["ci"][0] <= g["measured"] <= g["ci"][1] for g in data["goals"])
    ledger = json.loads((results / "kernels.json").read_text())["claims"]
    entry = ledger["cpu_bench_speedup_vs_eager_v2048"]["runs"]["full"]
    assert entry["n"] == 2 and entry["method"] == "t" and entry["device"].startswith("CPU")


REAL_SHAPE_SCRIPT = """
import torch
from kimi_papers.core.kernels import compiled_ran
from kimi_papers.core.token_stats import token_stats, token_stats_from_logits, token_stats_reference, _stats_compiled
g = torch.Generator().manual_seed(0)
n, V, d = 64, 49152, 576  # SmolLM2-135M's vocabulary and hidden size
h32, W32 = torch.randn(n, d, generator=g), torch.randn(V, d, generator=g) * (2.0 / d ** 0.5)
t = torch.randint(0, V, (n,), generator=g)
def rel(ours, ref):
    return max(((v.double() - getattr(ref, k)).abs() / getattr(ref, k).abs().clamp_min(1e-300)).max().item()
               for k, v in ours.as_dict().items())
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
    h, W = h32.to(dtype), W32.to(dtype)
    e1 = rel(token_stats(h, W, t), token_stats_reference(h, W, t))
    assert compiled_ran(_stats_compiled)
    logits = h @ W.T
    e2 = rel(token_stats_from_logits(logits, t), token_stats_reference(logits, None, t))
    assert e1 < tol and e2 < tol, (dtype, e1, e2)
    print(dtype, e1, e2)
print("real-shape-ok")
"""


def test_real_shape_matches_reference():
    """fp32 < 1e-5 and bf16 < 1e-2 relative error against float64 at SmolLM2's shape (V = 49,152, d = 576)."""
    r = subprocess.run([sys.executable, "-c", REAL_SHAPE_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and "real-shape-ok" in r.stdout, r.stderr[-3000:]


# ---- in-process checks, each built to fail on a specific wrong implementation -----------------------------------
import math  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

from kimi_papers.core import kernels as K  # noqa: E402
from kimi_papers.core import token_stats as TS  # noqa: E402


def _logits(n: int, V: int, seed: int = 0, scale: float = 2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g, dtype=torch.float64) * scale).to(dtype), torch.randint(0, V, (n,), generator=g)


def _max_rel(ours: TS.TokenStats, ref: TS.TokenStats) -> dict[str, float]:
    return {k: ((v.double() - getattr(ref, k)).abs() / getattr(ref, k).abs().clamp_min(1e-300)).max().item()
            for k, v in ours.as_dict().items()}


ENV_SCRIPT = """
import json, os
before = dict(os.environ)
import kimi_papers.core.kernels as k
after = dict(os.environ)
changed = sorted(x for x in set(before) | set(after) if before.get(x) != after.get(x))
path = k.use_compile_cache()
print(json.dumps({"changed": changed, "has_constant": hasattr(k, "COMPILE_CACHE"), "path": str(path),
                  "env": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def test_import_leaves_the_environment_alone_and_use_compile_cache_opts_in(tmp_path):
    """Importing kernels sets nothing (no TORCHINDUCTOR_CACHE_DIR); use_compile_cache() sets it, or keeps a user's value."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(OMP_NUM_THREADS="1", KIMI_PAPERS_PATHS_COMPILE_CACHE=str(tmp_path / "shared"))
    r = subprocess.run([sys.executable, "-c", ENV_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["changed"] == [] and not out["has_constant"], out
    assert out["path"] == out["env"] == str(tmp_path / "shared") and (tmp_path / "shared").is_dir(), out
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    r = subprocess.run([sys.executable, "-c", ENV_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["path"] == out["env"] == str(tmp_path / "mine") and out["changed"] == [], out


def _peak_ratio(call, like: torch.Tensor) -> float:
    return K.peak_extra_bytes(call, like.device) / like.nbytes


def test_chunk_none_chunks_when_the_compiled_kernel_does_not_run():
    """With compilation off (what dynamo does silently past its recompile limit) chunk=None must chunk, not take one eager pass."""
    z, t = _logits(8192, 512, dtype=torch.float32)                     # 16 MiB of logits
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        c0 = K.compile_info(TS._stats_compiled)["calls"]
        st = TS.token_stats_from_logits(z, t)
        calls = K.compile_info(TS._stats_compiled)["calls"] - c0
        assert not K.compiled_ran(TS._stats_compiled)
        fwd_peak = _peak_ratio(lambda: TS.token_stats_from_logits(z, t), z)
        zl = z.clone().requires_grad_()
        loss = sum(v.sum() for v in TS.token_stats_from_logits(zl, t).as_dict().values())
        b0 = K.compile_info(TS._grad_into_compiled)["calls"]
        bwd_peak = _peak_ratio(loss.backward, z)
        bwd_calls = K.compile_info(TS._grad_into_compiled)["calls"] - b0
    assert calls == 8, f"expected a 1,024-row probe and 7 chunks of 1,024 rows, got {calls} kernel call(s)"
    assert fwd_peak < 0.75, f"eager forward peaked at {fwd_peak:.2f}x the logits (one eager pass: ~4.25x)"
    assert bwd_calls == 8 and bwd_peak < 2.5, (bwd_calls, bwd_peak)          # one eager pass: ~9x
    ref = TS.token_stats_reference(z, None, t)
    assert max(_max_rel(st, ref).values()) < 1e-5


def test_chunk_none_takes_one_pass_when_the_compiled_kernel_runs():
    """Compiled: a probe chunk, then the rest in one call, and the same numbers as the reference."""
    z, t = _logits(2500, 1021, dtype=torch.float32)
    c0 = K.compile_info(TS._stats_compiled)["calls"]
    st = TS.token_stats_from_logits(z, t)
    assert K.compiled_ran(TS._stats_compiled) and K.compile_info(TS._stats_compiled)["calls"] - c0 == 2
    assert max(_max_rel(st, TS.token_stats_reference(z, None, t)).values()) < 1e-5


@pytest.mark.parametrize("n,chunk", [(1, 1), (7, 3), (10, 10), (1000, 7), (1025, 1024), (3, 5), (0, 4)])
def test_chunks_partition_the_rows_in_balanced_slices(n, chunk):
    sl = TS._chunks(n, chunk, start=5)
    rows = [i for s in sl for i in range(s.start, s.stop)]
    assert rows == list(range(5, 5 + n))                                        # every row once, in order
    sizes = [s.stop - s.start for s in sl]
    assert all(0 < x <= chunk for x in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)
    assert len(sl) == (math.ceil(n / chunk) if n else 0)


@pytest.mark.parametrize("n", [0, 1, 1024, 1025, 3000])
def test_adaptive_rows_cover_every_row_once(n):
    seen = []
    for compiled_ok in (True, False):
        seen.clear()
        kernel = K.compile_fn(lambda x: x)
        kernel.compile_state.last_compiled = compiled_ok
        TS._over_rows(lambda s: seen.extend(range(s.start, s.stop)), n, None, kernel)
        assert seen == list(range(n)), (n, compiled_ok)


@pytest.mark.parametrize("V", [37, 1024, 2500, 3072])           # tail only, one block, blocks + tail, blocks only
@pytest.mark.parametrize("variant", ["head", "logits"])
def test_each_statistic_matches_the_float64_reference(V, variant):
    """Every statistic separately, eager math in float64 (tight), on random, peaked and partly masked rows."""
    z, t = _logits(23, V, scale=3.0)
    z[5] *= 20.0                                                              # a near-one-hot row
    z[7, ::3] = float("-inf")                                                 # masked vocabulary entries
    t[7] = 1
    if variant == "logits":
        for chunk in (None, 1, 7, 23):
            err = _max_rel(TS.token_stats_from_logits(z, t, chunk=chunk, compiled=False), TS.token_stats_reference(z, None, t))
            assert all(e < 1e-8 for e in err.values()), (chunk, err)
    else:
        g = torch.Generator().manual_seed(1)
        h, W = torch.randn(23, 16, generator=g, dtype=torch.float64), torch.randn(V, 16, generator=g, dtype=torch.float64)
        for chunk in (1, 7, 23):
            err = _max_rel(TS.token_stats(h, W, t, chunk=chunk, compiled=False), TS.token_stats_reference(h, W, t))
            assert all(e < 1e-8 for e in err.values()), (chunk, err)


def test_hand_computed_statistics():
    """z = log([0.5, 0.25, 0.25]) + c: log p, H = 1.5 ln 2 and Σπ² = 0.375 exactly; a shift changes nothing."""
    z = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]], dtype=torch.float64).log() + torch.tensor([[0.0], [40.0]], dtype=torch.float64)
    st = TS.token_stats_from_logits(z, torch.tensor([0, 2]), compiled=False)
    assert torch.allclose(st.logp, torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(st.entropy, torch.full((2,), 1.5 * math.log(2), dtype=torch.float64), atol=1e-12)
    assert torch.allclose(st.sum_pi2, torch.full((2,), 0.375, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("which", ["logp", "entropy", "sum_pi2"])
@pytest.mark.parametrize("variant", ["head", "logits"])
def test_each_gradient_term_matches_autograd_through_the_reference(which, variant):
    """The backward of one output at a time (so a wrong term cannot hide behind another), across several chunks."""
    z, t = _logits(19, 2500, scale=2.0)
    w = torch.randn(19, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    if variant == "logits":
        a, r = z.clone().requires_grad_(), z.clone().requires_grad_()
        (getattr(TS.token_stats_from_logits(a, t, chunk=4, compiled=False), which) * w).sum().backward()
        (getattr(TS.token_stats_reference(r, None, t), which) * w).sum().backward()
        pairs = [(a.grad, r.grad)]
    else:
        g = torch.Generator().manual_seed(4)
        h, W = torch.randn(19, 8, generator=g, dtype=torch.float64), torch.randn(2500, 8, generator=g, dtype=torch.float64)
        ha, Wa, hr, Wr = (x.clone().requires_grad_() for x in (h, W, h, W))
        (getattr(TS.token_stats(ha, Wa, t, chunk=4, compiled=False), which) * w).sum().backward()
        (getattr(TS.token_stats_reference(hr, Wr, t), which) * w).sum().backward()
        pairs = [(ha.grad, hr.grad), (Wa.grad, Wr.grad)]
    for ours, ref in pairs:
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-10, which


def test_sample_next_keeps_exactly_the_nucleus():
    """probs 0.5/0.3/0.15/0.05: top_p=0.5 keeps token 0 only (mass before token 1 is 0.5, not < 0.5); 0.75 keeps two."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(2, 1)
    noise = torch.tensor([0.0, 5.0, 10.0, 20.0]).repeat(2, 1)                   # noise favours the tail
    assert TS.sample_next(logits, 1.0, 0.5, noise, compiled=False).tolist() == [0, 0]
    assert TS.sample_next(logits, 1.0, 0.75, noise, compiled=False).tolist() == [1, 1]
    assert TS.sample_next(logits, 1.0, 0.9, noise, compiled=False).tolist() == [2, 2]
    assert TS.sample_next(logits, 1.0, 1.0, noise, compiled=False).tolist() == [3, 3]
    # temperature -> 0 makes it greedy whatever the (bounded) noise; a huge temperature lets the noise decide
    assert TS.sample_next(logits, 1e-3, 1.0, noise.clamp(max=1.0), compiled=False).tolist() == [0, 0]
    assert TS.sample_next(logits, 1e3, 1.0, noise, compiled=False).tolist() == [3, 3]


def test_gumbel_max_draws_from_the_softmax():
    """Empirical frequencies of argmax(z + Gumbel) match softmax(z) (binomial sd < 0.004 at 20,000 draws)."""
    g = torch.Generator().manual_seed(0)
    z = torch.tensor([1.0, 0.0, -1.0, 0.5, 2.0])
    noise = TS.gumbel_noise((20000, 5), generator=g)
    assert noise.dtype == torch.float32 and noise.device.type == "cpu"
    freq = torch.bincount(TS.sample_next(z.repeat(20000, 1), 1.0, 1.0, noise, compiled=False), minlength=5) / 20000
    assert (freq - torch.softmax(z, -1)).abs().max() < 0.015, freq
    # mean and variance of the standard Gumbel: Euler-Mascheroni and pi^2/6
    assert abs(noise.mean().item() - 0.5772) < 0.02 and abs(noise.var().item() - math.pi ** 2 / 6) < 0.06


def test_gumbel_noise_is_the_same_numbers_whatever_the_target_device():
    a = TS.gumbel_noise((3, 4), generator=torch.Generator().manual_seed(5))
    b = TS.gumbel_noise((3, 4), generator=torch.Generator().manual_seed(5), device="cpu")
    assert torch.equal(a, b) and not torch.equal(a, TS.gumbel_noise((3, 4), generator=torch.Generator().manual_seed(6)))


def test_benchmark_rounds_are_round_robin_and_validated():
    order = []
    rows = K.benchmark_rows({"a": lambda x: order.append("a"), "b": lambda x: order.append("b")}, torch.zeros(1),
                            warmup=0, repeat=2, rounds=3, memory=False)
    assert [(r["name"], r["round"]) for r in rows] == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert order == ["a", "a", "b", "b"] * 3
    with pytest.raises(ValueError, match="rounds=0: expected an int >= 1"):
        K.benchmark_rows({"a": lambda x: x}, torch.zeros(1), rounds=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script runs the real GPU check (minutes)")
def test_gpu_check_script_skips_cleanly_without_cuda(tmp_path):
    """bench/gpu_check.sh on a CPU: every gpu test skipped with its reason, the benchmark skipped, exit 0, files in $OUT."""
    r = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    log = (tmp_path / "pytest_gpu.log").read_text()
    assert "skipped" in log and "passed" not in log and "failed" not in log and "gpu: needs a CUDA device" in log, log
    assert "cuda available: False" in (tmp_path / "env.txt").read_text()
    assert "skipped" in (tmp_path / "bench.log").read_text() and (tmp_path / "summary.txt").is_file()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(len(p.relative_to(tmp_path).parts) <= 3 for p in files), files


def test_kernels_create_tensors_on_their_inputs_device():
    """Device safety by inspection: every torch factory call in kernels and token_stats names a device, except two CPU-only helpers."""
    import ast
    tree = ast.Module(body=[n for f in ("kernels.py", "token_stats.py")
                            for n in ast.parse((ROOT / "kimi_papers" / "core" / f).read_text()).body], type_ignores=[])
    factories = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace", "as_tensor", "eye"}
    cpu_only = {"_prime_profiler", "_timed_median"}       # the profiler's priming tensor; host-side timing statistics
    missing = []
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name not in cpu_only):
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
            f = call.func
            if isinstance(f, ast.Attribute) and f.attr in factories and getattr(f.value, "id", None) == "torch":
                if not any(k.arg == "device" for k in call.keywords):
                    missing.append(f"{fn.name}: line {call.lineno} torch.{f.attr}")
    assert not missing, missing
