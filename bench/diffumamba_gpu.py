"""DiffuMamba's throughput rows on a GPU: forward time of the Transformer, BiMamba and Hybrid denoisers against length.

On the CPU the recorded throughput rows compare our eager torch SSD scan with CPU SDPA, and the reach control
`bimamba_time_tracks_flops` failed there (the BiMamba time grew as L^1.37 for a FLOP slope of 1.00), so those rows are
untestable on CPU. This script repeats the measurement where the paper's claim applies: on CUDA, compiled SSD stages,
paper-sized denoisers (d = 256, 8 blocks), L up to 65,536, batch 1, `--rounds` independent rounds (fresh seeded models,
every arm at every length per round). It writes one JSON file under --out with per-round values of

- throughput_ratio      Transformer / BiMamba forward time at --claim-length (claim: >= 2x)
- hybrid_ratio          Transformer / Hybrid forward time at --claim-length
- scaling_margin        min(1.15 - slope_BiMamba, slope_Transformer - 1.5) over L >= --slope-from (claim: >= 0)
- flop_excess_bimamba   slope(BiMamba time) - slope(BiMamba FLOPs) (the reach control: <= 0.15)

with a 95% t-interval over rounds (a log-ratio interval for the ratios), the timing rows, FLOPs from core.flops and the
device. It records nothing in the ledger: the lead adopts the numbers.

    python bench/diffumamba_gpu.py --out runs/diffumamba_gpu                    # CUDA, paper sizes (a few minutes)
    python bench/diffumamba_gpu.py --out /tmp/x --device cpu --tiny             # seconds: the CPU check of the script
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kimi_papers.architectures.diffumamba import Denoiser, set_compiled  # noqa: E402
from kimi_papers.architectures.diffumamba_experiment import loglog_slope, time_forward  # noqa: E402
from kimi_papers.core.flops import model_cost  # noqa: E402

ARMS = ("Transformer", "BiMamba", "Hybrid")
TINY = dict(d=32, layers=2, lengths=[64, 128, 256], claim_length=256, slope_from=128, rounds=2, reps=1)


def patterns(layers: int) -> dict[str, str]:
    """Block patterns: all attention, all BiMamba, BiMamba with attention every 4th block (at least one)."""
    hybrid = "".join("A" if (i + 1) % 4 == 0 else "M" for i in range(layers))
    return {"Transformer": "A" * layers, "BiMamba": "M" * layers, "Hybrid": hybrid if "A" in hybrid else "M" * (layers - 1) + "A"}


def t_interval(x, log: bool = False) -> dict:
    """Mean and 95% t-interval over rounds; `log`: on log values, mapped back (a ratio's interval stays > 0)."""
    from scipy import stats
    v = np.log(np.asarray(x, float)) if log else np.asarray(x, float)
    m = float(v.mean())
    if v.size < 2:
        lo = hi = m
    else:
        h = float(stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
        lo, hi = m - h, m + h
    f = np.exp if log else (lambda z: z)
    return {"estimate": float(f(m)), "ci": [float(f(lo)), float(f(hi))], "n": int(v.size),
            "method": "t over rounds" + (" on log values (geometric mean)" if log else ""), "samples": [float(a) for a in x]}


def run(out: Path, device: str = "auto", d: int = 256, layers: int = 8, lengths=(2048, 4096, 8192, 16384, 32768, 65536),
        claim_length: int = 65536, slope_from: int = 8192, rounds: int = 3, reps: int = 5, compiled: bool | None = None) -> dict:
    """Time the three denoisers per round and length; write and return the JSON summary."""
    lengths = sorted(int(L) for L in lengths)
    if claim_length not in lengths:
        raise ValueError(f"claim_length={claim_length}: expected one of lengths={lengths}")
    fit = [L for L in lengths if L >= slope_from]
    if len(fit) < 2:
        raise ValueError(f"slope_from={slope_from}: expected at least two lengths >= it in {lengths}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    compiled = dev.type == "cuda" if compiled is None else compiled
    rows, t0 = [], time.time()
    flops = {}
    for r in range(rounds):
        for arm, pat in patterns(layers).items():
            torch.manual_seed(r)
            m = set_compiled(Denoiser(d=d, n_layer=layers, pattern=pat, ctx=max(lengths)), compiled).to(dev)
            if r == 0:
                flops[arm] = {L: float(model_cost(m, 1, L).flops) for L in lengths}
            with torch.no_grad():
                t = time_forward(m, lengths, reps=reps, seed=r, warmup=1)
            rows += [dict(row, arm=arm, round=r) for row in t.to_dict("records")]
            del m
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    med = {(x["round"], x["arm"], x["length"]): x["median_s"] for x in rows}
    per = {"throughput_ratio": [], "hybrid_ratio": [], "scaling_margin": [], "flop_excess_bimamba": [],
           "slopes": {a: [] for a in ARMS}}
    flop_slope = {a: loglog_slope(fit, [flops[a][L] for L in fit]) for a in ARMS}
    for r in range(rounds):
        s = {a: loglog_slope(fit, [med[r, a, L] for L in fit]) for a in ARMS}
        for a in ARMS:
            per["slopes"][a].append(s[a])
        per["throughput_ratio"].append(med[r, "Transformer", claim_length] / med[r, "BiMamba", claim_length])
        per["hybrid_ratio"].append(med[r, "Transformer", claim_length] / med[r, "Hybrid", claim_length])
        per["scaling_margin"].append(min(1.15 - s["BiMamba"], s["Transformer"] - 1.5))
        per["flop_excess_bimamba"].append(s["BiMamba"] - flop_slope["BiMamba"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU: {platform.processor() or platform.machine()}"
    summary = {
        "device": name, "torch": torch.__version__, "compiled_ssd": compiled, "seconds": round(time.time() - t0, 1),
        "config": dict(d=d, layers=layers, patterns=patterns(layers), lengths=lengths, claim_length=claim_length,
                       slope_from=slope_from, rounds=rounds, reps=reps, batch=1),
        "flop_ratio_at_claim": flops["Transformer"][claim_length] / flops["BiMamba"][claim_length],
        "flop_slopes": flop_slope,
        "rows": {k: t_interval(v, log=k.endswith("ratio")) for k, v in per.items() if k != "slopes"},
        "slopes": per["slopes"], "timing": rows,
        "claims": {"throughput_ratio": ">= 2 (x)", "scaling_margin": ">= 0", "flop_excess_bimamba": "<= 0.15 (reach control)"},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "diffumamba_gpu.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    return summary


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for diffumamba_gpu.json")
    ap.add_argument("--device", default="auto", help="auto (CUDA if present), cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help=f"a seconds-long CPU check of the script: {TINY}")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--claim-length", type=int, default=65536)
    ap.add_argument("--slope-from", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eager", action="store_true", help="eager SSD stages even on CUDA")
    a = ap.parse_args(argv)
    kw = dict(d=a.d, layers=a.layers, lengths=a.lengths, claim_length=a.claim_length, slope_from=a.slope_from,
              rounds=a.rounds, reps=a.reps)
    if a.tiny:
        kw.update(TINY)
    s = run(a.out, a.device, compiled=False if a.eager else None, **kw)
    for k, v in s["rows"].items():
        print(f"{k:22s} {v['estimate']:.3f} [{v['ci'][0]:.3f}, {v['ci'][1]:.3f}] (n={v['n']})")
    print(f"{s['device']}, FLOP ratio at L={s['config']['claim_length']}: {s['flop_ratio_at_claim']:.2f}x, {s['seconds']} s "
          f"-> {a.out / 'diffumamba_gpu.json'}")
    return s


if __name__ == "__main__":
    main()
