"""Tests of kimi_papers.safety.concept_vectors (the method) and its experiment harness: identities, hand-computed cases,
references (diffusers' own attention processor, closed-form Fréchet distances) and bad input."""
import math

import numpy as np
import pytest
import torch

from kimi_papers.safety.concept_vectors import (ConceptVectors, DiffusionConfig, TinyDiT, TinyUNet, VectorConfig, attn_inject,
                                                ddim_sample, drop_tokens, encode_prompt,
                                                make_attribute_digits, make_scheduler, top_heads,
                                                train_concept_vectors, train_diffusion, transform)
from kimi_papers.safety.concept_vectors_experiment import (ATTR_IDS, attn_module_output, conj_score, deviation_ratio, fd_proxy,
                                                           linearity_errors, random_like, tune)


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    return TinyDiT(width=32, layers=2, heads=4).eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(5, 1, 10, 10, generator=g), torch.tensor([3, 20, 50, 80, 99]),
            encode_prompt([(d, None, None) for d in range(5)]))


def test_transform_hand_checked():
    one = np.zeros((8, 8), np.float32); one[4, 4] = 1.0
    top, bot = transform(one, "thin", "top"), transform(one, "thin", "bottom")
    assert top[4, 5] == 1.0 and bot[6, 5] == 1.0 and top.sum() == bot.sum() == 1.0
    bold = transform(one, "bold", "top")
    assert bold.sum() == 4.0 and bold[3:5, 4:6].sum() == 4.0
    with pytest.raises(ValueError, match="weight"):
        transform(one, "heavy", "top")


def test_attribute_bias_and_prompts():
    from sklearn.datasets import load_digits
    d = load_digits()
    ims, dg, wt, ps = make_attribute_digits(d.images[:800], d.target[:800], {k: 0.9 if k < 5 else 0.1 for k in range(10)},
                                            np.random.default_rng(0))
    assert abs(wt[dg < 5].mean() - 0.9) < 0.05 and abs(wt[dg >= 5].mean() - 0.1) < 0.05
    assert encode_prompt([(0, "bold", "bottom"), (None, None, None)]).tolist() == [[1, 13, 16], [0, 11, 14]]
    assert ATTR_IDS == {"thin": 12, "bold": 13}
    with pytest.raises(ValueError, match="unknown token"):
        encode_prompt([(12, None, None)])


def test_select_and_combine():
    cv = ConceptVectors(2, 4, 25, 8, generator=torch.Generator().manual_seed(0))
    s = cv.select({1: [2]})
    assert s.mask.sum() == 1 and float(s.delta(0).abs().sum()) == 0.0 and torch.equal(s.delta(1)[2], cv.E[1, 2])
    assert float(s.delta(1)[0].abs().sum()) == 0.0
    c = ConceptVectors.combine([cv, s], [0.5, 2.0])
    assert torch.allclose(c.E, 0.5 * cv.E + 2.0 * s.E)
    with pytest.raises(ValueError, match="layer_range"):
        cv.select([0], layer_range=(0, 3))


def test_attn_inject_reference():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 3, 2, 5, generator=g), torch.randn(2, 3, 2, 5, generator=g)
    delta, w, b = torch.randn(3, 4, 5, generator=g), torch.randn(7, 15, generator=g), torch.randn(7, generator=g)
    out = attn_inject(q, k, v, delta, w, b)
    # by hand, in float64, head by head
    ref = torch.zeros(2, 4, 7, dtype=torch.float64)
    for bi in range(2):
        heads = []
        for h in range(3):
            s = (q[bi, h].double() @ k[bi, h].double().T) / math.sqrt(5)
            heads.append(torch.softmax(s, -1) @ v[bi, h].double() + delta[h].double())
        ref[bi] = torch.cat(heads, -1) @ w.double().T + b.double()
    assert torch.allclose(out.double(), ref, atol=1e-5)


def test_processor_matches_diffusers_and_zero_vector(dit, batch):
    from diffusers.models.attention_processor import AttnProcessor2_0
    x, t, p = batch
    with torch.no_grad():
        ours = dit(x, t, p)
        z = dit.new_concept(); z.E.data.zero_()
        assert torch.equal(dit(x, t, p, z, 1.0), ours)
        v = dit.new_concept(generator=torch.Generator().manual_seed(2)); v.E.data.mul_(50)
        assert torch.equal(dit(x, t, p, v, 0.0), ours)
        assert float((dit(x, t, p, v, 1.0) - ours).abs().max()) > 1e-3
        procs = [m.processor for m in dit.attn_modules()]
        try:
            for m in dit.attn_modules():
                m.set_processor(AttnProcessor2_0())
            ref = dit(x, t, p)
        finally:
            for m, pr in zip(dit.attn_modules(), procs):
                m.set_processor(pr)
    assert float((ours - ref).abs().max()) < 1e-5


def test_injection_is_before_w_o_without_bias(dit, batch):
    _, _, p = batch
    v = dit.new_concept(generator=torch.Generator().manual_seed(3))
    h = torch.randn(5, 25, 32)
    ctx = dit.net.caption_projection(dit.embed(p))
    d = attn_module_output(dit, 0, h, ctx, v, 3.0) - attn_module_output(dit, 0, h, ctx, None)
    by_hand = 3.0 * v.E[0].permute(1, 0, 2).reshape(25, 32) @ dit.attn_modules()[0].to_out[0].weight.T
    assert torch.allclose(d, by_hand.expand(5, -1, -1), atol=1e-6)


def test_linearity(dit, batch):
    x, t, p = batch
    g = torch.Generator().manual_seed(4)
    v1, v2 = dit.new_concept(generator=g), dit.new_concept(generator=g)
    lin = linearity_errors(dit, [v1, v2], (2.0, -0.5), x, t, p)
    assert lin["attn_additivity_abs"] < 1e-5 and lin["attn_homogeneity_abs"] < 1e-5
    assert lin["model_additivity_rel"] < 0.1 and lin["model_homogeneity_rel"] < 0.1


def test_bad_input(dit, batch):
    x, t, p = batch
    v = dit.new_concept()
    with pytest.raises(ValueError, match="scale"):
        dit(x, t, p, v, float("nan"))
    with pytest.raises(ValueError, match="concept"):
        dit(x, t, p, ConceptVectors(3, 4, 25, 8), 1.0)
    with pytest.raises(ValueError, match="image tokens"):
        dit(torch.randn(2, 1, 12, 12), t[:2], p[:2], v, 1.0)
    with torch.no_grad():
        assert dit(torch.randn(2, 1, 12, 12), t[:2], p[:2], dit.new_concept(per_token=False), 1.0).shape == (2, 1, 12, 12)
    with pytest.raises(ValueError, match="zero samples"):
        deviation_ratio([])
    with pytest.raises(ValueError, match="layer"):
        attn_module_output(dit, 5, torch.randn(1, 25, 32), torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="images"):
        train_diffusion(dit, np.zeros((0, 10, 10)), p[:0], DiffusionConfig(steps=1))


def test_deviation_ratio_and_fd():
    assert deviation_ratio([1, 1, 1, 0]) == 0.5 and deviation_ratio([0.5, 0.5]) == 0.0 and deviation_ratio([0, 0]) == 1.0
    assert deviation_ratio([0.9, 0.5, 0.2, 0.7]) == 0.25
    rs = np.random.default_rng(0)
    a, b = rs.normal(0, 1, (3000, 1)), rs.normal(2, 3, (3000, 1))
    va, vb = a.var(ddof=1), b.var(ddof=1)
    assert abs(fd_proxy(a, b) - ((a.mean() - b.mean()) ** 2 + va + vb - 2 * math.sqrt(va * vb))) < 1e-8
    A, B = rs.normal(size=(400, 4)), rs.normal(size=(400, 4)) @ rs.normal(size=(4, 4))
    Sa, Sb = np.cov(A, rowvar=False), np.cov(B, rowvar=False)
    ea, Ua = np.linalg.eigh(Sa); r = Ua @ np.diag(np.sqrt(ea)) @ Ua.T
    ref = ((A.mean(0) - B.mean(0)) ** 2).sum() + np.trace(Sa + Sb) - 2 * np.sqrt(np.linalg.eigvalsh(r @ Sb @ r)).sum()
    assert abs(fd_proxy(A, B) - ref) < 1e-8 and abs(fd_proxy(A, A)) < 1e-6


def test_schedule_and_dropout():
    sch = make_scheduler(100)
    f = lambda s: np.cos((s / 100 + 0.008) / 1.008 * np.pi / 2) ** 2
    betas = np.minimum([1 - f(s + 1) / f(s) for s in range(100)], 0.999)
    assert np.allclose(sch.alphas_cumprod.numpy(), np.cumprod(1 - betas), atol=1e-5)
    tok = encode_prompt([(3, "bold", "top")] * 4000)
    d = drop_tokens(tok, 0.5, 0.1, torch.Generator().manual_seed(0))
    assert abs(float((d[:, 1] == 11).float().mean()) - 0.5) < 0.03 and abs(float((d[:, 0] == 0).float().mean()) - 0.1) < 0.02


def test_vector_training_frozen_and_masked(dit):
    g = np.random.default_rng(0)
    imgs = g.random((20, 10, 10))
    neu, con = encode_prompt([(d, None, None) for d in range(10)]), encode_prompt([(d, "bold", None) for d in range(10)])
    before = [q.detach().clone() for q in dit.parameters()]
    vec, imp, losses = train_concept_vectors(dit, imgs, neu, con, VectorConfig(steps=25, batch=8, lr=0.05))
    assert all(torch.equal(a, b) for a, b in zip(before, dit.parameters()))
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) and imp.shape == (2, 4)
    sel = top_heads(imp, 1)
    vk, ik, _ = train_concept_vectors(dit, imgs, neu, con, VectorConfig(steps=3, batch=4), init=dit.new_concept().select(sel))
    assert float(vk.E[vk.mask == 0].abs().sum()) == 0.0 and vk.mask.sum() == 2


def test_unet_bottleneck_and_sampler(batch):
    x, t, p = batch
    u = TinyUNet(channels=(16, 32)).eval()
    v = u.new_concept(); v.E.data.zero_()
    with torch.no_grad():
        assert torch.equal(u(x, t, p, v, 1.0), u(x, t, p))
    s1 = ddim_sample(u, p[:2], steps=3, seed=5, guidance=2.0)
    assert s1.shape == (2, 1, 10, 10) and torch.equal(s1, ddim_sample(u, p[:2], steps=3, seed=5, guidance=2.0))


def test_harness_helpers():
    assert conj_score(dict(dr=0.1, acc=0.9, fd=1.1), dict(acc=0.92, fd=1.0)) == pytest.approx(0.5)
    assert conj_score(dict(dr=0.25, acc=0.9, fd=1.0), dict(acc=0.9, fd=1.0)) == pytest.approx(-0.25)
    cv = ConceptVectors(2, 4, 25, 8, generator=torch.Generator().manual_seed(0)).select([1, 2])
    r = random_like(cv, 3)
    assert torch.allclose(r.E.flatten(2).norm(dim=-1), cv.E.flatten(2).norm(dim=-1), atol=1e-6)
    assert not torch.allclose(r.E, cv.E)
    best, res = tune([1.0, 2.0], lambda v: v)
    assert best == 6.0 and set(res) == {1.0, 2.0, 6.0}


def test_head_mask_applied_where_the_vector_is_added(dit, batch):
    """With W_O = I the attention module output is the concatenation of the head outputs: the heads a selection leaves
    out must equal the un-injected model's exactly, whatever E holds there; the selected ones move by exactly λ·E."""
    import copy
    _, _, p = batch
    m = copy.deepcopy(dit)
    for a in m.attn_modules():
        with torch.no_grad():
            a.to_out[0].weight.copy_(torch.eye(32)); a.to_out[0].bias.zero_()
    full = m.new_concept(generator=torch.Generator().manual_seed(11)); full.E.data.normal_(0, 1.0)
    sel = full.select({0: [1], 1: [0, 3]}, (0, 2))
    sel.E.data.copy_(full.E)                     # E non-zero on every head (e.g. loaded weights): only the mask may restrict
    h, ctx = torch.randn(3, 25, 32), m.net.caption_projection(m.embed(p[:3]))
    for l, heads in ((0, [1]), (1, [0, 3])):
        d = (attn_module_output(m, l, h, ctx, sel, 2.0) - attn_module_output(m, l, h, ctx, None)).view(3, 25, 4, 8)
        for hh in range(4):
            if hh in heads:
                assert torch.allclose(d[:, :, hh], 2.0 * full.E[l, hh].expand(3, -1, -1), atol=1e-5)
            else:
                assert float(d[:, :, hh].abs().max()) == 0.0, (l, hh)
    # the same on the whole model: a selection equals a hand-built vector that is zero off the selected heads
    ref = dit.new_concept(); ref.E.data.zero_()
    ref.E.data[0, 1], ref.E.data[1, 0], ref.E.data[1, 3] = full.E[0, 1], full.E[1, 0], full.E[1, 3]
    sel_d = dit.new_concept(); sel_d.load_state_dict(sel.state_dict())
    x, t, _ = batch
    with torch.no_grad():
        assert torch.allclose(dit(x, t, p, sel_d, 1.5), dit(x, t, p, ref, 1.5), atol=1e-6)
    # a layer outside layer_range gets nothing even if listed in topk_heads
    only1 = full.select({0: [0, 1, 2, 3], 1: [2]}, (1, 2))
    assert float(only1.delta(0).abs().sum()) == 0.0 and only1.mask.sum() == 1


def test_alignment_target_is_the_concept_prompt(dit):
    """The training target is the frozen model on the concept prompt Φ (vectors off): at E = 0 the loss is zero only when
    Γ = Φ, and the first step's loss equals ‖f(x_t, t, Γ; E₀) − f(x_t, t, Φ)‖² / numel computed by hand."""
    imgs = np.random.default_rng(3).random((12, 10, 10))
    neu, con = encode_prompt([(d, None, None) for d in range(10)]), encode_prompt([(d, "bold", None) for d in range(10)])
    cfg = VectorConfig(steps=2, batch=6, lr=0.0, seed=4)
    zero = lambda: (lambda v: (v.E.data.zero_(), v)[1])(dit.new_concept())
    _, _, same = train_concept_vectors(dit, imgs, neu, neu, cfg, init=zero())
    _, _, diff = train_concept_vectors(dit, imgs, neu, con, cfg, init=zero())
    assert same == [0.0, 0.0] and min(diff) > 1e-6, (same, diff)
    init = dit.new_concept(generator=torch.Generator().manual_seed(5))
    _, _, got = train_concept_vectors(dit, imgs, neu, con, cfg, init=copy_vec(init))
    g = torch.Generator().manual_seed(cfg.seed)             # the same draws as the trainer: batch, noise, timesteps
    idx = torch.randint(12, (6,), generator=g)
    x = torch.as_tensor(imgs, dtype=torch.float32)[idx][:, None] * 2 - 1
    eps, tt = torch.randn(x.shape, generator=g), torch.randint(100, (6,), generator=g)
    xt = make_scheduler(100).add_noise(x, eps, tt)
    with torch.no_grad():
        want = float(((dit(xt, tt, neu[idx % 10], init, 1.0) - dit(xt, tt, con[idx % 10])) ** 2).mean())
        wrong = float(((dit(xt, tt, neu[idx % 10], init, 1.0) - dit(xt, tt, neu[idx % 10])) ** 2).mean())
    assert abs(got[0] - want) < 1e-6 * max(1.0, want) and abs(want - wrong) > 1e-6, (got[0], want, wrong)


def copy_vec(v):
    import copy
    return copy.deepcopy(v)


def test_thm2_errors_scale(dit, batch):
    """thm2_errors(λ) is linearity_errors on the λ-scaled pair: additivity at (1, 1), homogeneity of 2·λE₁; → 0 as λ → 0."""
    from kimi_papers.safety.concept_vectors_experiment import thm2_errors
    x, t, p = batch
    g = torch.Generator().manual_seed(6)
    v1, v2 = dit.new_concept(generator=g), dit.new_concept(generator=g)
    v1.E.data.mul_(20); v2.E.data.mul_(20)
    add, hom = thm2_errors(dit, [v1, v2], 2.0, x, t, p)
    s1, s2 = ConceptVectors.combine([v1], [2.0]), ConceptVectors.combine([v2], [2.0])
    assert add == linearity_errors(dit, [s1, s2], (1.0, 1.0), x, t, p)["model_additivity_rel"]
    with torch.no_grad():
        f0, f1, f2 = dit(x, t, p), dit(x, t, p, v1, 2.0), dit(x, t, p, v1, 4.0)
    assert abs(hom - float((f2 - f0 - 2 * (f1 - f0)).norm() / (2 * (f1 - f0)).norm())) < 1e-5
    small = thm2_errors(dit, [v1, v2], 1e-3, x, t, p)
    assert max(small) < 0.01 < max(add, hom), (small, add, hom)
