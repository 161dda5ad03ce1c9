"""Issue 3's token-statistics benchmark: eager vs torch.compile vs the fused kernel vs a read-once floor.

For N tokens of bf16 logits at each vocabulary size V it times, forward and forward+backward:

- eager          float32 log_softmax over the full logits + gather + entropy
- torch.compile  the same function through plain torch.compile
- fused          kimi_papers.core.token_stats.token_stats_from_logits (log p, entropy and sum pi^2)
- read once      one float32-accumulating sum over the logits (forward only): the memory-traffic floor
- eager + head / fused + head (unless --no-head): the same from hidden states [N, d] and an LM head [V, d]

and reports median / IQR milliseconds and extra peak memory (CUDA: max_memory_allocated delta; CPU: the
profiler's tensor allocations, see the token_stats notebook). The arms are timed in --rounds round-robin rounds,
each the median of --repeat calls; ratios (speed-ups, peak / logits) are computed per round and summarised as
the mean with a 95% t-interval over rounds. It prints a table and writes JSON (--out): one row per arm and
round, a summary per arm, and the goals with their intervals.

    python bench/token_stats.py                                   # issue 3 sizes on CUDA (an H200: ~1 minute)
    python bench/token_stats.py --device cpu --n 1024 --v 8192    # a small CPU run
    python bench/token_stats.py --record                          # also write the goals to the claims ledger
    bash bench/gpu_check.sh                                       # GPU tests + this benchmark, logs to $OUT

Goals from issue 3 (H200, N = 16,384, bf16): fused forward <= 0.6 ms at V = 49,152 (eager 9.81 ms, compile
1.62 ms, floor 0.38 ms) and <= 1.8 ms at V = 151,936 (floor 1.17 ms); extra peak memory <= 10% of the logits.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # runnable from a plain checkout, without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kimi_papers.core.kernels import benchmark_rows, compile_fn, compiled_ran, device_name  # noqa: E402
from kimi_papers.core.token_stats import logp_entropy_eager, token_stats, token_stats_from_logits  # noqa: E402

GOALS_MS = {49152: 0.6, 151936: 1.8}          # fused forward on an H200 at N = 16,384 bf16
HEAD_DIM = {49152: 576, 151936: 896}          # SmolLM2-135M and Qwen2.5-0.5B hidden sizes
PEAK_GOAL = 0.10                              # extra peak memory / logits bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; sizes default to issue 3's."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    ap.add_argument("--n", type=int, default=16384, help="tokens (rows of logits)")
    ap.add_argument("--v", type=int, nargs="+", default=[49152, 151936], help="vocabulary sizes")
    ap.add_argument("--d", type=int, default=None, help="hidden size for the LM-head rows (default: per V, else 576)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--chunk", type=int, default=1024, help="rows per chunk for the LM-head variant")
    ap.add_argument("--repeat", type=int, default=10, help="timed calls per round (the round reports their median)")
    ap.add_argument("--rounds", type=int, default=5, help="round-robin timing rounds (intervals are over rounds)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-head", action="store_true", help="skip the LM-head rows")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default: runs/token_stats-<device>.json)")
    ap.add_argument("--record", action="store_true",
                    help="record the goals in the kernels ledger (profile 'full') under config.results_dir()")
    args = ap.parse_args(argv)
    for name in ("n", "chunk", "repeat", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}={getattr(args, name)}: expected an integer >= 1")
    if args.warmup < 1:
        ap.error(f"--warmup={args.warmup}: expected >= 1 (the first call compiles)")
    if any(v < 2 for v in args.v):
        ap.error(f"--v={args.v}: expected vocabulary sizes >= 2")
    return args


def resolve(device: str) -> torch.device:
    """`auto` picks CUDA when present; a clear error for CUDA on a machine without it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        sys.exit(f"--device={device!r}: expected auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device={device!r}: CUDA is not available here; use --device cpu (with small --n/--v)")
    return dev


def available_bytes(dev: torch.device) -> int:
    """Free memory on the device (CUDA) or MemAvailable (CPU)."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 1 << 62


def check_fits(n: int, v: int, dtype: torch.dtype, dev: torch.device) -> None:
    """Refuse sizes whose eager baseline cannot fit (it holds ~5 float32 copies of the logits)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    need = n * v * (2 * elem + 5 * 4)
    have = available_bytes(dev)
    if need > 0.9 * have:
        sys.exit(f"--n {n} --v {v}: the eager baseline needs ~{need / 2**30:.1f} GiB but {dev} has "
                 f"{have / 2**30:.1f} GiB free; pass smaller --n/--v (e.g. --n 1024 --v 8192 on a CPU)")


def run_one(n: int, v: int, d: int, args: argparse.Namespace, dev: torch.device) -> list[dict[str, Any]]:
    """All rows for one vocabulary size."""
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    h = torch.randn(n, d, generator=gen).to(dev, dtype)
    W = (torch.randn(v, d, generator=gen) * (2.0 / d ** 0.5)).to(dev, dtype)
    t = torch.randint(0, v, (n,), generator=gen).to(dev)
    logits = h @ W.T
    compiled = compile_fn(logp_entropy_eager)
    arms = {"eager": logp_entropy_eager, "torch.compile": compiled,
            "fused": lambda z, tt: token_stats_from_logits(z, tt, check=False)}
    floor = {"read once": lambda z, tt: torch.sum(z, dim=-1, dtype=torch.float32)}
    head = {"eager + head": lambda a, b, tt: logp_entropy_eager(a @ b.T, tt),
            "fused + head": lambda a, b, tt: token_stats(a, b, tt, chunk=args.chunk, check=False)}
    kw = dict(warmup=args.warmup, repeat=args.repeat, rounds=args.rounds, device=dev)
    leaf = lambda x: x.detach().clone().requires_grad_()  # noqa: E731
    rows = benchmark_rows({**floor, **arms}, logits, t, **kw)
    if not args.no_head:
        rows += benchmark_rows(head, h, W, t, **kw)
    if not args.no_backward:
        rows += benchmark_rows(arms, leaf(logits), t, backward=True, **kw)
        if not args.no_head:
            rows += benchmark_rows(head, leaf(h), leaf(W), t, backward=True, **kw)
    if not compiled_ran(compiled):
        print(f"warning: plain torch.compile fell back to eager at V={v}", file=sys.stderr)
    eager = {(r["mode"], r["round"]): r["median_ms"] for r in rows if r["name"] == "eager"}
    for r in rows:  # ratios within a round: both arms timed in the same stretch of the machine's time
        r.update(n=n, V=v, d=d, dtype=args.dtype, logits_mib=logits.nbytes / 2**20,
                 x_vs_eager=eager[(r["mode"], r["round"])] / r["median_ms"],
                 peak_vs_logits=r["peak_extra_mib"] * 2**20 / logits.nbytes)
    del h, W, t, logits
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def per_round(rows: list[dict[str, Any]], v: int, name: str, mode: str, col: str) -> list[float]:
    """One value of `col` per round for an arm at vocabulary size v."""
    sel = sorted((r for r in rows if r["V"] == v and r["name"] == name and r["mode"] == mode), key=lambda r: r["round"])
    return [float(r[col]) for r in sel]


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per arm and size: median of the per-round medians, and the per-round ratios' mean with a 95% t-interval."""
    from kimi_papers.core.ledger import Estimate
    keys = list(dict.fromkeys((r["V"], r["name"], r["mode"]) for r in rows))
    out = []
    for v, name, mode in keys:
        ms = per_round(rows, v, name, mode, "median_ms")
        x = Estimate.t(per_round(rows, v, name, mode, "x_vs_eager"))
        out.append({"V": v, "name": name, "mode": mode, "rounds": len(ms), "median_ms": sorted(ms)[len(ms) // 2],
                    "x_vs_eager": x.value, "x_lo": x.low, "x_hi": x.high,
                    "peak_extra_mib": max(per_round(rows, v, name, mode, "peak_extra_mib")),
                    "peak_vs_logits": max(per_round(rows, v, name, mode, "peak_vs_logits"))})
    return out


def goals(rows: list[dict[str, Any]], dev: torch.device, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Issue 3's goals from the fused forward rows, each with its per-round samples (the time goal only on CUDA at its shape)."""
    from kimi_papers.core.ledger import Estimate
    out = []
    for v in dict.fromkeys(r["V"] for r in rows):
        checks = [(f"peak_vs_logits_v{v}", per_round(rows, v, "fused", "fwd", "peak_vs_logits"), PEAK_GOAL, "<=", ""),
                  (f"speedup_vs_eager_v{v}", per_round(rows, v, "fused", "fwd", "x_vs_eager"), 1.0, ">=", "x")]
        if dev.type == "cuda" and args.n == 16384 and args.dtype == "bfloat16" and v in GOALS_MS:
            checks.append((f"fwd_ms_v{v}", per_round(rows, v, "fused", "fwd", "median_ms"), GOALS_MS[v], "<=", "ms"))
        for goal, samples, thr, direction, unit in checks:
            est = Estimate.t(samples)
            side = est.high <= thr if direction == "<=" else est.low >= thr
            other = est.low > thr if direction == "<=" else est.high < thr
            out.append({"goal": goal, "measured": est.value, "ci": [est.low, est.high], "n": est.n, "samples": samples,
                        "threshold": thr, "direction": direction, "unit": unit,
                        "met": "met" if side else "NOT met" if other else "interval straddles the goal"})
    return out


def record_goals(checks: list[dict[str, Any]], dev: torch.device, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Write each goal as a claim of the `kernels` ledger (profile 'full'), per-round samples -> a t-interval."""
    from kimi_papers.core.ledger import Claim, Estimate, record
    context = {k: v for k, v in meta.items() if k != "device"}
    note = (f"{meta['rounds']} round-robin rounds of {meta['repeat']} timed calls each (a median per round); "
            "t-interval over the per-round values")
    entries = []
    for g in checks:
        claim = Claim("kernels", f"{dev.type}_bench_{g['goal']}", f"bench/token_stats.py goal {g['goal']}",
                      "issue 3: H200, N=16,384 bf16: <= 0.6 ms at V=49,152, <= 1.8 ms at V=151,936, peak <= 10%",
                      f"N={meta['n']}, {meta['dtype']}, {meta['device']}", g["goal"], g["threshold"], g["direction"],
                      unit=g["unit"])
        entries.append(record(claim, Estimate.t(g["samples"]), "full", seeds=(meta["seed"],), note=note,
                              device=meta["device"], **context))
    return entries


def table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of the per-arm summary rows."""
    cols = [("V", 7, "d"), ("name", 14, "s"), ("mode", 8, "s"), ("median_ms", 10, ".3f"), ("x_vs_eager", 10, ".2f"),
            ("x_lo", 7, ".2f"), ("x_hi", 7, ".2f"), ("peak_extra_mib", 14, ".1f"), ("peak_vs_logits", 14, ".3f")]
    align = lambda f: "<" if f == "s" else ">"  # noqa: E731
    lines = [" ".join(f"{c:{align(f)}{w}}" for c, w, f in cols)]
    lines += [" ".join(f"{r[c]:{align(f)}{w}{f}}" for c, w, f in cols) for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, write the JSON."""
    args = parse_args(argv)
    dev = resolve(args.device)
    torch.manual_seed(args.seed)
    rows = []
    for v in args.v:
        check_fits(args.n, v, getattr(torch, args.dtype), dev)
        d = args.d or HEAD_DIM.get(v, 576)
        print(f"V={v}: N={args.n}, d={d}, {args.dtype} on {device_name(dev)} ...", flush=True)
        rows += run_one(args.n, v, d, args, dev)
    checks = goals(rows, dev, args)
    meta = {"device": device_name(dev), "torch": torch.__version__, "n": args.n, "dtype": args.dtype,
            "chunk": args.chunk, "repeat": args.repeat, "rounds": args.rounds, "seed": args.seed}
    summ = summary(rows)
    print(table(summ))
    for g in checks:
        print(f"goal {g['goal']}: {g['measured']:.4g} [{g['ci'][0]:.4g}, {g['ci'][1]:.4g}] (n={g['n']} rounds) "
              f"{g['direction']} {g['threshold']} -> {g['met']}")
    out = args.out or ROOT / "runs" / f"token_stats-{dev.type}.json"
    from kimi_papers.core.ledger import atomic_write_text
    atomic_write_text(out, json.dumps({"meta": meta, "rows": rows, "summary": summ, "goals": checks}, indent=1) + "\n")
    print(f"wrote {out}")
    if args.record:
        for e in record_goals(checks, dev, meta):
            print(f"recorded {e['status']}: {e['estimate']:.4g} [{e['ci'][0]:.4g}, {e['ci'][1]:.4g}]")
        from kimi_papers.core.config import results_dir
        print(f"ledger entries written under {results_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
