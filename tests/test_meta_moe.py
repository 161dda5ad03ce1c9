"""Library tests of kimi_papers.architectures.meta_moe that are cheaper as pytest than in the notebook: the greedy DPP
against its NumPy reference and hand-computed cases, the MoE-of-LoRA kernel against its loop reference (forward and
gradients), the router's blending, Eq. 8, the FLOP counts, the data masks and the spec's bad inputs."""
import math
import warnings

import numpy as np
import pytest
import torch

from kimi_papers.core.flops import model_cost, measured_flops
from kimi_papers.core.nn import CausalLM
from kimi_papers.architectures.meta_moe import (
    EOS, PAD, SEP, ContextAwareMoEFFN, LoRAFFN, MetaMoELM, QAData, build_moe, btm_predict, dpp_greedy, encode,
    model_soup, moe_lora_ffn, prompt_mask, relevance_only_select, routing_vectors, rw_dpp_kernel, rw_dpp_select,
    target_mask, with_lora)
from kimi_papers.architectures.meta_moe_experiment import (
    category, coverage, dpp_greedy_numpy, eq8_parts, evaluate, make_private, make_public, moe_lora_ffn_reference,
    seed_config)


def _lm(seed=0):
    torch.manual_seed(seed)
    return CausalLM(seed_config(32, 2, 64, 2))


def _random_lora(lm, seed):
    torch.manual_seed(seed)
    ex = with_lora(lm, rank=4, alpha=8)
    for layer in ex.layers:
        with torch.no_grad():
            layer.ffn.B_up.normal_(0, 0.1)
            layer.ffn.B_dn.normal_(0, 0.1)
    return ex


@pytest.mark.parametrize("seed", range(5))
def test_dpp_torch_matches_numpy_reference(seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(60, 32, generator=g)
    r = torch.rand(60, generator=g) + 0.05
    K = rw_dpp_kernel(z, r)
    picks = dpp_greedy(K, 20)
    assert picks == dpp_greedy_numpy(K.numpy(), 20)
    assert len(set(picks)) == 20


def test_dpp_greedy_maximises_logdet_on_a_hand_case():
    # three items: 0 and 1 nearly identical, 2 orthogonal; the first pick is the largest diagonal, the second the
    # item with the largest conditional variance (2, not the near-duplicate 1)
    K = np.array([[1.0, 0.99, 0.0], [0.99, 1.0, 0.0], [0.0, 0.0, 0.9]])
    assert dpp_greedy_numpy(K, 2) == [0, 2]
    assert dpp_greedy(torch.tensor(K), 2) == [0, 2]
    # brute force: the greedy pair is the best pair containing item 0
    best = max([(0, 1), (0, 2)], key=lambda s: np.linalg.det(K[np.ix_(s, s)]))
    assert best == (0, 2)


def test_duplicates_stop_early_with_a_warning_and_never_divide_by_zero():
    z = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    with pytest.warns(UserWarning, match="positive gain"):
        picks = rw_dpp_select(z, torch.ones(3), 3)
    assert sorted(picks) == [0, 2]


def test_equal_relevance_is_vanilla_dpp_and_zero_relevance_is_excluded():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(40, 48, generator=g)
    vanilla = torch.nn.functional.normalize(z.double(), dim=-1) @ torch.nn.functional.normalize(z.double(), dim=-1).T
    vanilla.diagonal().fill_(1.0)
    assert rw_dpp_select(z, torch.full((40,), 0.3), 10) == dpp_greedy_numpy(vanilla.numpy(), 10)
    r = torch.rand(40, generator=g) + 0.1
    r[[4, 7]] = 0.0
    picks = rw_dpp_select(z, r, 38)
    assert 4 not in picks and 7 not in picks


def test_relevance_weighting_is_relevance_only_at_large_beta():
    g = torch.Generator().manual_seed(1)
    z = torch.randn(50, 32, generator=g)
    r = 0.9 ** torch.randperm(50, generator=g).double()    # well separated relevances
    assert rw_dpp_select(z, r, 5, beta=20.0) == relevance_only_select(r, 5)
    assert rw_dpp_select(z, r, 5, beta=0.0) != relevance_only_select(r, 5)


@pytest.mark.parametrize("bad", [dict(m=11, pool=10), dict(m=2, pool=31), dict(m=0)])
def test_bad_sizes_raise(bad):
    z, r = torch.randn(30, 4), torch.rand(30) + 0.1
    with pytest.raises(ValueError, match="m=|pool="):
        rw_dpp_select(z, r, **bad)


def test_nan_features_and_empty_private_raise():
    z = torch.randn(10, 3)
    z[2, 1] = float("nan")
    with pytest.raises(ValueError, match="features"):
        rw_dpp_select(z, torch.rand(10), 3)
    with pytest.raises(ValueError, match="private"):
        make_private("arithmetic", 0, 0)


def test_coverage_is_one_minus_total_variation():
    labels = torch.tensor([0, 0, 1, 2, -1])
    # selected mix {0: 1/2, 1: 1/4, -1: 1/4}; target {0: 1/2, 1: 1/2}; TV = (0 + 1/4 + 1/4) / 2
    assert math.isclose(coverage([0, 1, 2, 4], labels, torch.tensor([0, 1])), 0.75)
    assert coverage([0, 2], labels, torch.tensor([0, 1])) == 1.0


def test_masks_and_encoding():
    ids = encode([("12+3", "15"), ("plain text", None)])
    assert ids.shape[1] == 24 and ids[0, 4] == SEP and ids[0, 7] == EOS and ids[1, 10] == EOS
    tm = target_mask(ids)
    assert tm[0].nonzero()[:, 0].tolist() == [4, 5, 6]       # targets '1', '5', EOS
    assert tm[1].nonzero()[:, 0].tolist() == list(range(10))  # every byte of plain text
    pm = prompt_mask(ids)
    assert pm[0].nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4] and pm[1].sum() == 11


def _kernel_args(N=37, K=3, d=16, m=24, r=4, seed=0, empty=None):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, K, (N,), generator=g)
    if empty is not None:
        idx[idx == empty] = (empty + 1) % K
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()
    return [t(N, d), idx, torch.rand(N, generator=g, dtype=torch.float64).requires_grad_(), t(2 * m, d), t(d, m),
            t(K, d, r), t(K, r, 2 * m), t(K, m, r), t(K, r, d), 2.0]


@pytest.mark.parametrize("empty", [None, 1])
def test_moe_lora_kernel_matches_loop_reference_forward_and_grad(empty):
    a = _kernel_args(empty=empty)
    b = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in a]
    ya, yb = moe_lora_ffn(*a), moe_lora_ffn_reference(*b)
    torch.testing.assert_close(ya, yb, atol=1e-10, rtol=1e-10)
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            torch.testing.assert_close(x.grad, y.grad, atol=1e-10, rtol=1e-10)


def test_lora_ffn_starts_as_the_base_and_moe_of_equal_experts_is_pi_times_it():
    lm = _lm()
    ex = _random_lora(lm, 1)
    x = torch.randn(2, 5, 32)
    base = with_lora(lm).layers[0].ffn
    torch.testing.assert_close(base(x), lm.layers[0].ffn(x))
    # two identical experts: output = pi * FFN_1(x) with pi = 1/2 whatever the router says
    moe = ContextAwareMoEFFN(lm.layers[0].ffn, [ex.layers[0].ffn.lora_state()] * 2, torch.zeros(2, 32), scale=2.0)
    torch.testing.assert_close(moe(x), 0.5 * ex.layers[0].ffn(x), atol=1e-6, rtol=1e-5)
    moe_r = ContextAwareMoEFFN(lm.layers[0].ffn, [ex.layers[0].ffn.lora_state()] * 2, torch.zeros(2, 32), renormalize=True, scale=2.0)
    torch.testing.assert_close(moe_r(x), ex.layers[0].ffn(x), atol=1e-6, rtol=1e-5)


def test_context_blend_and_lambda_clamp():
    lm = _lm()
    st = [_random_lora(lm, s).layers[0].ffn.lora_state() for s in (1, 2)]
    e = torch.randn(2, 32)
    f = ContextAwareMoEFFN(lm.layers[0].ffn, st, e, lam=0.25, scale=2.0)
    x = torch.randn(1, 6, 32)
    f.ctx_mask = torch.tensor([[True, True, True, False, False, False]])
    z = 0.75 * x + 0.25 * x[:, :3].mean(1, keepdim=True)
    torch.testing.assert_close(f.route(x).logits, (z @ e.T).reshape(-1, 2))
    with torch.no_grad():
        f.lam.fill_(1.7)                        # clamped to 1: every token routes by the prompt mean only
    r = f.route(x)
    assert (r.idx == r.idx[0]).all()
    one = torch.randn(1, 1, 32)                 # a length-1 sequence: z-bar = z_t, so lam does not matter
    f.ctx_mask = None
    torch.testing.assert_close(f.route(one).logits, (one @ e.T).reshape(-1, 2))


def test_router_and_lambda_get_gradient_only_without_renormalisation():
    lm = _lm()
    exs = [_random_lora(lm, s) for s in (1, 2)]
    ids = encode([("12+3", "15"), ("k:A", "10")])
    for renorm, has_grad in ((False, True), (True, False)):
        moe = build_moe(lm, exs, torch.randn(2, 2, 32), renormalize=renorm)
        logits = moe(ids[:, :-1])
        logits.logsumexp(-1).sum().backward()
        g, gl = moe.layers[0].ffn.router.grad, moe.layers[0].ffn.lam.grad
        # p / p has an exactly-zero derivative; autograd leaves rounding noise (~1e-10) there
        assert (float(g.abs().sum()) > 1e-5) == has_grad
        assert (float(gl.abs()) > 1e-5) == has_grad


def test_eq8_identity_and_sensitivity_bound():
    lm = _lm()
    priv, prox = make_private("strings", 40, 0), make_public(30, 1)
    e, mu_p, mu_x = eq8_parts(lm, priv, prox)
    N, m = len(priv), len(prox)
    torch.testing.assert_close(e, N / (N + m) * mu_p + m / (N + m) * mu_x, atol=1e-6, rtol=1e-5)
    # replacing one proxy moves e by at most 2B/(N+m) <= 2B/m, B = largest per-sample mean norm
    prox2 = QAData(prox.ids.clone(), prox.domain, prox.submode)
    prox2.ids[0] = make_private("lookup", 1, 5).ids[0]
    e2 = routing_vectors(lm, priv.cat(prox2))
    B = 0.0
    for data in (priv, prox, prox2):
        for i in range(len(data)):
            B = max(B, float(routing_vectors(lm, data.subset([i])).norm(dim=-1).max()))
    assert float((e2 - e).norm(dim=-1).max()) <= 2 * B / (N + m) + 1e-6


def test_flops_of_moe_and_lora_match_flop_counter():
    import dataclasses
    torch.manual_seed(0)   # explicit-matmul attention: FlopCounterMode counts SDPA as 0 FLOPs on CPU
    lm = CausalLM(dataclasses.replace(seed_config(32, 2, 64, 2), attn_impl="matmul"))
    exs = [_random_lora(lm, s) for s in (1, 2, 3)]
    moe = build_moe(lm, exs, torch.randn(3, 2, 32))
    for layer in moe.layers:            # the gathered kernel does exactly the top-1 work that core.flops counts
        layer.ffn.kernel = moe_lora_ffn
    ids = torch.randint(1, 255, (2, 9))
    assert measured_flops(lambda: moe(ids)) == pytest.approx(model_cost(moe, 2, 9).flops, rel=0.02)
    ex = exs[0]
    assert measured_flops(lambda: ex(ids)) == pytest.approx(model_cost(ex, 2, 9).flops, rel=0.02)
    moe(ids)
    routed = model_cost(moe, 2, 9, use_routing=True)
    assert routed.weight_bytes <= model_cost(moe, 2, 9).weight_bytes


def test_model_soup_of_one_repeated_expert_is_that_expert_and_btm_of_it_too():
    lm = _lm()
    ex = _random_lora(lm, 4)
    ids = torch.randint(1, 255, (3, 7))
    torch.testing.assert_close(model_soup(lm, [ex, ex])(ids), ex(ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(btm_predict([ex, ex])(ids), ex(ids).log_softmax(-1), atol=1e-5, rtol=1e-5)


def test_build_moe_needs_two_experts_and_evaluate_counts_exact_matches():
    lm = _lm()
    with pytest.raises(ValueError, match="K >= 2"):
        build_moe(lm, [_random_lora(lm, 1)], None)
    data = make_private("arithmetic", 4, 0)
    full = QAData(data.ids, data.domain, data.submode)   # an oracle that returns the true next bytes scores 1
    out = evaluate(lambda x: torch.nn.functional.one_hot(full.ids[: len(x), 1:], 256).float(), {"a": full})
    assert out["acc_a"] == 1.0
    out = evaluate(lambda x: torch.zeros(len(x), x.shape[1], 256), {"a": full})
    assert out["acc_a"] == 0.0


def test_public_pool_shares_and_categories():
    pub = make_public(2000, 0, dominant=0.7, filler=0.4)
    assert int((pub.domain == -1).sum()) == 800
    arith = pub.submode[pub.domain == 0]
    assert 0.6 < float((arith == 0).float().mean()) < 0.8
    assert set(category(pub).tolist()) <= set(range(12)) | {-1}
    with pytest.raises(ValueError, match="dominant"):
        make_public(10, 0, dominant=1.5)


@pytest.mark.gpu
def test_cuda_kernel_dpp_and_moe_match_cpu():
    dev = torch.device("cuda")
    a = _kernel_args(N=300, empty=2)
    cpu = moe_lora_ffn_reference(*[x.detach() if isinstance(x, torch.Tensor) else x for x in a])
    on = [x.detach().to(dev) if isinstance(x, torch.Tensor) else x for x in a]
    for fn in (moe_lora_ffn, moe_lora_ffn_masked):
        torch.testing.assert_close(fn(*on).cpu(), cpu, atol=1e-8, rtol=1e-8)
    g = torch.Generator().manual_seed(0)
    z, r = torch.randn(200, 64, generator=g), torch.rand(200, generator=g) + 0.05
    assert rw_dpp_select(z.to(dev), r.to(dev), 30, 150) == rw_dpp_select(z, r, 30, 150)
    lm = _lm()
    exs = [_random_lora(lm, s) for s in (1, 2)]
    rv = torch.randn(2, 2, 32)
    test = {"arithmetic": make_private("arithmetic", 50, 0), "strings": make_private("strings", 50, 1)}
    moe_cpu, moe_gpu = build_moe(lm, exs, rv), build_moe(lm.to(dev), [e.to(dev) for e in exs], rv.to(dev))
    out_c, out_g = evaluate(moe_cpu, test), evaluate(moe_gpu, test)
    assert out_c["acc_avg"] == pytest.approx(out_g["acc_avg"], abs=0.03)
    assert routing_vectors(moe_gpu, test["strings"]).device.type == "cuda"


def test_moved_harness_names_resolve_with_a_warning():
    """Names that moved to meta_moe_experiment in the module split still import from meta_moe (deprecated)."""
    import kimi_papers.architectures.meta_moe as method
    import kimi_papers.architectures.meta_moe_experiment as experiment
    with pytest.warns(DeprecationWarning, match="meta_moe_experiment"):
        assert method.run_seed is experiment.run_seed and method.make_public is experiment.make_public
    with pytest.raises(AttributeError, match="no_such_name"):
        method.no_such_name
