"""The core on CUDA: kernels, rl rollouts and a Trainer step, pmd_mean, OTB and spec_md's model.

Every test is marked `gpu`; without CUDA they are skipped visibly (tests/conftest.py, see `pytest -rs`).
`bench/gpu_check.sh` runs them (`pytest -m gpu`) together with `bench/token_stats.py` wherever a GPU is lent.
Each test compares the CUDA result with a CPU or float64 reference, so a device mix-up (a tensor built on the
CPU, an index on the wrong device) fails here instead of in a user's training loop."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs() / ref.double().abs().clamp_min(1e-300)).max().item()


def _norm_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).norm() / ref.double().norm()).item()


def _problem(n: int, V: int, d: int, seed: int = 0):
    """Hidden states [n, d], an LM head [V, d] (logit std ~2) and targets [n], drawn on the CPU, moved to CUDA."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g)
    W = torch.randn(V, d, generator=g) * (2.0 / d ** 0.5)
    return h.to(CUDA), W.to(CUDA), torch.randint(0, V, (n,), generator=g).to(CUDA)


# ---- core.kernels -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("V", [1021, 2500])   # a tail block only; full blocks and a tail (each one triton compile)
def test_token_stats_forward_matches_float64_on_cuda(dtype, tol, V):
    from kimi_papers.core.kernels import compiled_ran
    from kimi_papers.core.token_stats import _stats_compiled, token_stats, token_stats_from_logits, token_stats_reference
    h, W, t = _problem(300, V, 64)
    h, W = h.to(dtype), W.to(dtype)
    ours, ref = token_stats(h, W, t, chunk=128), token_stats_reference(h, W, t)
    assert compiled_ran(_stats_compiled), "the compiled (triton) kernel did not run"
    assert all(v.device.type == "cuda" for v in ours.as_dict().values())
    assert max(_rel(v, getattr(ref, k)) for k, v in ours.as_dict().items()) < tol
    logits = h @ W.T
    ours = token_stats_from_logits(logits, t)
    ref = token_stats_reference(logits, None, t)
    assert max(_rel(v, getattr(ref, k)) for k, v in ours.as_dict().items()) < tol


@pytest.mark.parametrize("variant", ["head", "logits"])
def test_token_stats_backward_matches_autograd_through_float64_on_cuda(variant):
    from kimi_papers.core.kernels import compiled_ran
    from kimi_papers.core.token_stats import STATS, _grad_compiled, _grad_into_compiled, token_stats, \
        token_stats_from_logits, token_stats_reference
    h, W, t = _problem(1500, 2500, 64)
    w = torch.randn(3, 1500, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(CUDA)
    loss = lambda st: sum((w[i] * getattr(st, k).double()).sum() for i, k in enumerate(STATS))  # noqa: E731
    if variant == "head":
        a, b, ar, br = h.clone().requires_grad_(), W.clone().requires_grad_(), h.double().requires_grad_(), W.double().requires_grad_()
        loss(token_stats(a, b, t, chunk=256)).backward()
        loss(token_stats_reference(ar, br, t)).backward()
        assert compiled_ran(_grad_compiled)
        assert _norm_err(a.grad, ar.grad) < 1e-4 and _norm_err(b.grad, br.grad) < 1e-4
    else:
        z = (h @ W.T).detach()
        a, ar = z.clone().requires_grad_(), z.double().requires_grad_()
        loss(token_stats_from_logits(a, t)).backward()              # chunk=None: a probe chunk, then one pass
        loss(token_stats_reference(ar, None, t)).backward()
        assert compiled_ran(_grad_into_compiled)
        assert a.grad.device.type == "cuda" and _norm_err(a.grad, ar.grad) < 1e-4


def test_chunk_none_memory_on_cuda():
    """Compiled: extra peak below 10% of the logits; with compilation off it must chunk (below 0.75x, not ~4.25x)."""
    from kimi_papers.core.kernels import compile_info, peak_extra_bytes
    from kimi_papers.core.token_stats import _stats_compiled, token_stats_from_logits
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(16384, 2048, generator=g) * 2).to(CUDA)           # 128 MiB of float32 logits
    t = torch.randint(0, 2048, (16384,), generator=g).to(CUDA)
    token_stats_from_logits(z, t)
    assert peak_extra_bytes(lambda: token_stats_from_logits(z, t), CUDA) < 0.10 * z.nbytes
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        c0 = compile_info(_stats_compiled)["calls"]
        peak = peak_extra_bytes(lambda: token_stats_from_logits(z, t), CUDA)
        assert compile_info(_stats_compiled)["calls"] - c0 == 16
    assert peak < 0.75 * z.nbytes, peak / z.nbytes


def test_sampling_on_cuda_is_the_eager_result_and_device_independent():
    from kimi_papers.core.kernels import compiled_ran
    from kimi_papers.core.token_stats import sample_next_compiled, gumbel_noise, sample_next
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 1021, generator=g) * 3).to(CUDA)
    noise = gumbel_noise((64, 1021), generator=torch.Generator().manual_seed(4), device=CUDA)
    assert noise.device.type == "cuda"
    assert torch.equal(noise.cpu(), gumbel_noise((64, 1021), generator=torch.Generator().manual_seed(4)))
    temps = torch.linspace(0.3, 1.7, 64, device=CUDA)
    tok = sample_next(logits, temps, 0.9, noise)
    assert compiled_ran(sample_next_compiled) and tok.device.type == "cuda"
    assert torch.equal(tok, sample_next(logits, temps, 0.9, noise, compiled=False))
    assert torch.equal(tok.cpu(), sample_next(logits.cpu(), temps.cpu(), 0.9, noise.cpu(), compiled=False))


def test_benchmark_on_cuda_reports_time_and_allocator_peak():
    from kimi_papers.core.kernels import benchmark_rows
    x = torch.zeros(1 << 20, device=CUDA)
    rows = benchmark_rows({"alloc": lambda v: torch.ones(1 << 20, device=CUDA) + v}, x, warmup=1, repeat=3, rounds=2)
    assert len(rows) == 2 and all(r["median_ms"] > 0 and r["device"] != "" for r in rows)
    assert all(8.0 <= r["peak_extra_mib"] < 8.1 for r in rows), rows       # the temporary and the result: 2 x 4 MiB


# ---- core.rl: a rollout and one Trainer step on a tiny policy ----------------------------------------------------
def _tiny_policy():
    from kimi_papers.core.rl import ArithmeticTask, tiny_policy
    task = ArithmeticTask(digits=1)
    policy, _ = tiny_policy(task, d_model=32, n_layers=1, n_heads=2, max_len=32, seed=0, fixture=False, progress=False)
    policy.model.to(CUDA)
    return task, policy


def test_rollout_on_cuda():
    from kimi_papers.core.rl import Trainer, generate
    task, policy = _tiny_policy()
    prompts = [policy.encode_prompt(p.prompt) for p in task.sample(4, 0)]
    a = generate(policy, prompts, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    b = generate(policy, prompts, max_new_tokens=4, generator=torch.Generator().manual_seed(0))
    assert a[0].device.type == "cuda" and torch.equal(a[0], b[0])           # same generator seed, same samples
    tr = Trainer(policy, task, group_size=4, prompts_per_step=2, max_new_tokens=4, progress=False, seed=0)
    batch = tr.score_old(tr.rollout(tr.draw_problems()))
    for name in ("input_ids", "attn_mask", "resp_mask", "reward", "old_logp", "sum_pi2"):
        assert getattr(batch, name).device.type == "cuda", name


def _one_step(**kw) -> tuple[dict, bool]:
    """One Trainer step on CUDA; returns its metrics and whether the parameters moved."""
    from kimi_papers.core.rl import Trainer
    task, policy = _tiny_policy()
    before = copy.deepcopy(policy.model.state_dict())
    tr = Trainer(policy, task, group_size=4, prompts_per_step=4, max_new_tokens=4, lr=1e-3, entropy_coef=0.01,
                 progress=False, seed=0, **kw)
    row = tr.step()
    moved = any(not torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())
    assert all(p.device.type == "cuda" for p in policy.model.parameters())
    assert tr.opt_steps >= 1 and tr.last_batch.adv.device.type == "cuda"
    return row, moved


@pytest.mark.parametrize("loss,advantage", [("grpo", "grpo"), ("grpo", "rloo"), ("grpo", "dr_grpo")])
def test_one_trainer_step_on_cuda(loss, advantage):
    row, moved = _one_step(loss=loss, advantage=advantage)
    assert moved and torch.isfinite(torch.tensor(row["reward"]))


# ---- rl.pmd_mean ------------------------------------------------------------------------------------------------
def test_pmd_advantages_on_cuda_match_cpu():
    from kimi_papers.rl.pmd_mean import pmd_advantages
    g = torch.Generator().manual_seed(5)
    r = (torch.rand(24, generator=g) < 0.5).double()
    uid = torch.arange(6).repeat_interleave(4)
    for mode in ("mean_loo", "partition_loo"):
        cpu = pmd_advantages(r, uid, 0.1, mode)
        gpu = pmd_advantages(r.to(CUDA), uid.to(CUDA), 0.1, mode)
        assert gpu.device.type == "cuda" and torch.allclose(gpu.cpu(), cpu, atol=1e-12), mode


@pytest.mark.parametrize("arm", ["pmd_mean", "pmd_partition"])
def test_pmd_inside_trainer_on_cuda(arm):
    """PMD's registered advantages and loss inside Trainer (device="auto" picks CUDA when present)."""
    import kimi_papers.rl.pmd_mean as pm
    kw = pm.pmd_trainer_kwargs(arm, staleness=1, prompts=4, tau=0.1, lr=1e-3)
    kw.pop("prompts_per_step", None)
    kw.pop("lr", None)
    row, moved = _one_step(**kw)
    assert moved


# ---- rl.optimal_token_baseline ------------------------------------------------------------------------------------
def test_otb_advantages_on_cuda_match_cpu():
    from kimi_papers.rl.optimal_token_baseline import otb_advantages
    g = torch.Generator().manual_seed(6)
    rows, T = 12, 7
    mask = torch.ones(rows, T, dtype=torch.float64)
    rew = torch.zeros(rows, T, dtype=torch.float64)
    rew[:, -1] = (torch.rand(rows, generator=g) < 0.5).double()
    old_logp = -torch.rand(rows, T, generator=g, dtype=torch.float64) * 3
    p2 = old_logp.exp() ** 2
    sum_pi2 = p2 + (1 - p2) * torch.rand(rows, T, generator=g, dtype=torch.float64) * 0.5   # p_t^2 <= sum_pi2 <= 1
    uid = torch.arange(3).repeat_interleave(4)
    cpu_adv, cpu_ret = otb_advantages(rew, mask, uid, old_logp, sum_pi2)
    adv, ret = otb_advantages(rew.to(CUDA), mask.to(CUDA), uid.to(CUDA), old_logp.to(CUDA), sum_pi2.to(CUDA))
    assert adv.device.type == "cuda" and torch.allclose(adv.cpu(), cpu_adv, atol=1e-10) and torch.allclose(ret.cpu(), cpu_ret)


def test_otb_inside_trainer_on_cuda():
    import kimi_papers.rl.optimal_token_baseline  # noqa: F401  (registers the "otb" advantage)
    row, moved = _one_step(loss="grpo", advantage="otb")
    assert moved


# ---- serving.spec_md: the tiny MoE's forward --------------------------------------------------------------------
def test_spec_md_model_forward_on_cuda_matches_cpu():
    from kimi_papers.serving.spec_md_experiment import gate_lookahead_reference
    from kimi_papers.serving.spec_md_traces import folded_routers, gate_lookahead, trace_model, trace_model_config, unit_rms
    torch.manual_seed(0)
    cfg = trace_model_config(n_layers=2, n_experts=8, top_k=2, d_model=32, d_expert=16, n_heads=2, vocab=256, max_len=64)
    cpu = trace_model(cfg).eval()
    gpu = copy.deepcopy(cpu).to(CUDA)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        lc, cc = cpu(ids, capture=True)
        lg, cg = gpu(ids.to(CUDA), capture=True)
    assert lg.device.type == "cuda" and lg.shape == (2, 24, 256)
    assert torch.allclose(lg.cpu(), lc, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a.routing.idx.cpu(), b.routing.idx) for a, b in zip(cg, cc))   # the same experts chosen per layer
    h = torch.stack([unit_rms(c.residual.reshape(-1, cfg.d_model)) for c in cg])          # [L, T, d]
    probs, mask = gate_lookahead(h, folded_routers(gpu))
    probs_ref, mask_ref = gate_lookahead_reference(h, folded_routers(gpu))
    assert probs.device.type == "cuda" and torch.allclose(probs, probs_ref, atol=1e-6) and torch.equal(mask, mask_ref)
