"""Library tests of kimi_papers.architectures.latent_moe: config arithmetic checked by hand, routing ties and bad input,
the grouped kernel against the per-expert loop (forward and gradients, empty experts, zero tokens), StandardMoE against
core.nn.MoE, the registered core.flops count against FlopCounterMode, and a few training steps."""
import math
from dataclasses import replace

import pytest
import torch

from kimi_papers.architectures.latent_moe import (
    ACTS, LatentMoE, LatentMoEConfig, StandardMoE, active_macs, compiled_kernel_info, cost_model, dense_width,
    grouped_expert_forward, loop_expert_forward, match_m, n_params, route_topk)
from kimi_papers.architectures.latent_moe_experiment import TinyMoELM, train_lm, val_windows
from kimi_papers.core.flops import measured_flops, model_cost, module_cost
from kimi_papers.core.nn import MoE
from kimi_papers.core.train import stdlib_corpus

STD = LatentMoEConfig(128, 256, 8, 2)


def test_match_m_hand_computed():
    acc2, acc4 = LatentMoEConfig(128, 256, 8, 2, alpha=2), LatentMoEConfig(128, 256, 8, 2, alpha=4)
    assert match_m(STD, acc2) == 222 and match_m(STD, acc2, count_router=False) == 224
    assert match_m(STD, acc4) == 234
    assert active_macs(replace(acc2, m_latent=222)) == active_macs(STD) == 128 * 8 + 2 * 2 * 128 * 256
    assert dense_width(STD) == 516
    # SwiGLU experts have 3 matrices: (g + 1) = 3 per hidden unit
    sw = LatentMoEConfig(128, 256, 8, 2, act="swiglu")
    assert active_macs(sw) == 128 * 8 + 2 * 3 * 128 * 256


def test_params_and_eff_costs():
    acc2 = replace(LatentMoEConfig(128, 256, 8, 2, alpha=2), m_latent=222)
    assert n_params(STD) == 128 * 8 + 8 * 2 * 128 * 256
    assert n_params(acc2) == 128 * 16 + 2 * 128 * 64 + 16 * 2 * 64 * 222 < n_params(STD)
    eff = LatentMoEConfig(128, 256, 8, 2, alpha=2, variant="eff")
    a, b = cost_model(STD, 32), cost_model(eff, 32)
    assert b["routed_expert_flops_per_token"] / a["routed_expert_flops_per_token"] == 0.5
    assert b["routed_bytes_per_token"] / a["routed_bytes_per_token"] == 0.5
    assert cost_model(acc2, 32)["routed_bytes_per_token"] == a["routed_bytes_per_token"]
    assert abs(b["log_comb"] - math.log(math.comb(16, 2))) < 1e-9


@pytest.mark.parametrize("bad, msg", [(dict(alpha=3), "alpha"), (dict(top_k=0), "top_k"), (dict(m=0), "m"),
                                      (dict(top_k=9), "exceeds"), (dict(variant="x"), "variant"),
                                      (dict(act="gelu"), "act"), (dict(alpha=2, project=False), "project"),
                                      (dict(m_latent=0), "m_latent")])
def test_config_rejects(bad, msg):
    with pytest.raises(ValueError, match=msg):
        LatentMoEConfig(**{**dict(d=128, m=256, n_experts=8, top_k=2), **bad})


def test_cost_model_rejects():
    for kw in (dict(t_exp=0), dict(t_exp=4, ep=3), dict(t_exp=1, bytes_per_param=0)):
        with pytest.raises(ValueError):
            cost_model(STD, **kw)


def test_route_ties_renorm_and_bad_logits():
    idx, w = route_topk(torch.zeros(4, 5), 3)
    assert idx.tolist() == [[0, 1, 2]] * 4 and torch.allclose(w, torch.full((4, 3), 1 / 3))
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0]])
    idx, w = route_topk(logits, 2)
    assert idx.tolist() == [[1, 2]] and torch.allclose(w, torch.tensor([[0.5, 0.5]]))
    for bad, k in ((torch.tensor([[0.0, float("nan")]]), 1), (torch.tensor([[float("-inf"), 0.0]]), 1), (torch.zeros(2, 3), 0),
                   (torch.zeros(2, 3), 4)):
        with pytest.raises(ValueError):
            route_topk(bad, k)


def _case(act, T=64, N=5, K=2, l=8, m=12, empty=(3,), seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, N, generator=g)
    logits[:, list(empty)] = -1e4
    idx, w = route_topk(logits, K)
    W1 = (torch.randn(N, l, (2 if act == "swiglu" else 1) * m, generator=g) / l**0.5).requires_grad_()
    W2 = (torch.randn(N, m, l, generator=g) / m**0.5).requires_grad_()
    return torch.randn(T, l, generator=g).requires_grad_(), idx, w.requires_grad_(), W1, W2


def _out_and_grads(fn, z, idx, w, W1, W2, act):
    out = fn(z, idx, w, W1, W2, act)
    cot = torch.linspace(-1, 1, out.numel()).view_as(out)
    return [out, *torch.autograd.grad((out * cot).sum(), (z, w, W1, W2))]


@pytest.mark.parametrize("act", ACTS)
def test_grouped_eager_equals_loop(act):
    case = _case(act)
    ref = _out_and_grads(loop_expert_forward, *case, act)
    got = _out_and_grads(lambda *a: grouped_expert_forward(*a, compiled=False), *case, act)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert (got[3][3] == 0).all() and (got[4][3] == 0).all()   # empty expert: exact-zero gradients
    assert ref[0].abs().sum() > 0   # a kernel that returned zeros would fail the comparison against this


@pytest.mark.slow
def test_grouped_compiled_equals_loop():
    case = _case("relu2", seed=1)
    ref = _out_and_grads(loop_expert_forward, *case, "relu2")
    got = _out_and_grads(lambda *a: grouped_expert_forward(*a, compiled=True), *case, "relu2")
    info = compiled_kernel_info()
    assert info["calls"] > 0 and info["eager_runs"] == 0 and not info["errors"], info
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_zero_tokens_and_bad_kernel_args():
    z, idx, w, W1, W2 = _case("relu2")
    assert grouped_expert_forward(z[:0], idx[:0], w[:0], W1, W2).shape == (0, 8)
    assert LatentMoE(LatentMoEConfig(16, 8, 4, 2, alpha=2))(torch.zeros(0, 16)).shape == (0, 16)
    with pytest.raises(ValueError, match="idx"):
        grouped_expert_forward(z, idx + 5, w, W1, W2)
    with pytest.raises(ValueError, match="W2"):
        grouped_expert_forward(z, idx, w, W1, W2[:, :3])
    with pytest.raises(ValueError, match="act"):
        grouped_expert_forward(z, idx, w, W1, W2, "gelu")
    with pytest.raises(ValueError, match="kernel"):
        LatentMoE(STD, kernel="triton")


def test_standard_moe_equals_core_moe():
    torch.manual_seed(0)
    ours = StandardMoE(24, 40, 6, 2, kernel="grouped")
    core = MoE(24, 6, 2, 40, act="relu2", renormalize=True)
    with torch.no_grad():
        core.router.weight.copy_(ours.router.weight); core.w1.copy_(ours.w1); core.w2.copy_(ours.w2)
    x = torch.randn(3, 9, 24)
    torch.testing.assert_close(ours(x), core(x), atol=1e-5, rtol=1e-4)
    assert torch.equal(ours.last.idx, core.last.idx)


@pytest.mark.parametrize("cfg", [LatentMoEConfig(32, 48, 6, 2), LatentMoEConfig(32, 48, 6, 2, alpha=2),
                                 LatentMoEConfig(32, 48, 6, 2, alpha=4, variant="eff", n_shared=1, act="swiglu")])
def test_registered_flops_match_flop_counter(cfg):
    layer = LatentMoE(cfg, kernel="loop")
    x = torch.randn(2, 11, 32)
    assert module_cost(layer, 2, 11).flops == measured_flops(lambda: layer(x)) == 2 * 22 * active_macs(cfg)


def test_tiny_lm_trains_and_counts_flops():
    corpus = stdlib_corpus(200_000, max_val_bytes=20_000)
    cfg = replace(LatentMoEConfig(32, 32, 4, 2, alpha=2), m_latent=match_m(LatentMoEConfig(32, 32, 4, 2), LatentMoEConfig(32, 32, 4, 2, alpha=2)))
    torch.manual_seed(0)
    model = TinyMoELM(corpus.vocab, 32, 1, cfg, n_heads=2, max_len=16)
    h = train_lm(model, corpus, 30, batch=4, seq_len=16, lr=3e-3, n_evals=2, val=val_windows(corpus, 8, 16))
    assert h.evals.val_loss.iloc[-1] < h.evals.val_loss.iloc[0] < 6.0
    assert h.result.flops == pytest.approx(30 * model_cost(model, 4, 16).train_flops)
    assert len(h.routing) == 1 and 0 <= h.routing.load_cv.iloc[0]
    with pytest.raises(ValueError, match="d_ff"):
        TinyMoELM(256, 32, 1, None)
    with pytest.raises(ValueError, match="moe_cfg.d"):
        TinyMoELM(256, 64, 1, cfg)


def test_latent_path_output_scale_at_init():
    """W_down ~ N(0, 1/d), W_up ~ N(0, 1/l): the latent layers' output std at init is within 2x of the standard MoE's
    (PyTorch's default Linear init made ℓ-MoE_acc's output about 7x smaller: 0.12 vs 0.88)."""
    acc = replace(LatentMoEConfig(128, 256, 8, 2, alpha=2), m_latent=222)
    eff = LatentMoEConfig(128, 256, 8, 2, alpha=2, variant="eff")
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0))
    stds = {}
    for name, cfg in (("std", STD), ("acc", acc), ("eff", eff)):
        torch.manual_seed(0)
        layer = LatentMoE(cfg)
        with torch.no_grad():
            stds[name] = float(layer(x).std())
        if cfg.projected:
            assert float(layer.down.weight.detach().std()) == pytest.approx(128 ** -0.5, rel=0.05)
            assert float(layer.up.weight.detach().std()) == pytest.approx(64 ** -0.5, rel=0.05)
    assert 0.5 < stds["acc"] / stds["std"] < 2 and 0.5 < stds["eff"] / stds["std"] < 2, stds


@pytest.mark.slow
def test_compiled_kernel_really_runs_through_training():
    """Train/eval grad-mode flips and five arms' expert shapes: every compiled-kernel call runs compiled code (the first
    full run hit dynamo's recompile limit with one shared wrapper and silently ran eagerly)."""
    corpus = stdlib_corpus(200_000, max_val_bytes=20_000)
    val = val_windows(corpus, 4, 16)
    base = LatentMoEConfig(32, 32, 4, 2)
    before = compiled_kernel_info()["calls"]
    cfgs = [base] + [LatentMoEConfig(32, 32, 4, 2, alpha=a, variant=v) for a in (2, 4) for v in ("acc", "eff")]
    for cfg in cfgs:   # 5 expert shapes x 2 grad modes: more than dynamo's recompile limit (8) for one shared wrapper
        torch.manual_seed(0)
        model = TinyMoELM(corpus.vocab, 32, 1, cfg, n_heads=2, max_len=16, kernel="compiled")
        train_lm(model, corpus, 6, batch=2, seq_len=16, n_evals=3, val=val)   # 3 train / eval flips per arm
    info = compiled_kernel_info()
    assert info["calls"] - before >= 5 * (6 + 3) and info["eager_runs"] == 0 and not info["errors"], info
    assert info["compiled_calls"] == info["calls"]


@pytest.mark.gpu
def test_layer_on_cuda_matches_cpu():
    torch.manual_seed(0)
    layer = LatentMoE(LatentMoEConfig(32, 48, 6, 2, alpha=2))
    x = torch.randn(50, 32)
    ref = layer(x)
    torch.testing.assert_close(layer.cuda()(x.cuda()).cpu(), ref, atol=1e-4, rtol=1e-4)


def test_moved_names_still_resolve():
    import kimi_papers.architectures.latent_moe as m
    import kimi_papers.architectures.latent_moe_experiment as e
    with pytest.warns(DeprecationWarning, match="latent_moe_experiment"):
        assert m.train_lm is e.train_lm and m.TinyMoELM is e.TinyMoELM
    with pytest.raises(AttributeError):
        m.not_a_name
