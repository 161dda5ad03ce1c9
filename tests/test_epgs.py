"""kimi_papers.evaluation.epgs as a library: the three scores against hand-computed cases, the curvature estimator
against an exact Hessian, the fused answer-loss head against eager cross_entropy, the perturbation's placement and
seeding, the detectors and AUROC against scikit-learn, and known-wrong variants that the checks must tell apart."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

import kimi_papers.evaluation.epgs as epgs
from kimi_papers.core.models import tiny_causal_lm
from kimi_papers.evaluation.epgs import (
    answer_nll, answer_nll_compiled, answer_nll_from_hidden, answer_nll_reference, auroc, auroc_with_ci,
    confident_subset, eigen_spread, embed_prompt_answer, entropy_score, epgs_scores, neg_logprob, perturbed_grads,
    probe_cv, sample_disagreement, scores_from_grads)
from kimi_papers.evaluation.epgs_experiment import (
    Question, answer_span, fact_pool, is_correct, make_questions, mlp_curvature_check, normalize)


# ---- known-wrong variants ----------------------------------------------------------------------------------------
def curvature_mean_norm(g, sigma):
    """WRONG (the spec's first formula): mean_k ‖g_k − g_0‖ / σ instead of the root mean square."""
    flat = g.flatten(1).double()
    return float((flat[1:] - flat[0]).norm(dim=1).mean() / sigma)


def spike_of_means(g, sigma):
    """WRONG: ‖mean_k g_k‖ − ‖g_0‖ (averages the gradients before the norm, so opposite spikes cancel)."""
    flat = g.flatten(1).double()
    return float(flat[1:].mean(0).norm() - flat[0].norm())


def auroc_strict(scores, labels):
    """WRONG: ties between a wrong and a right answer count 0 instead of 1/2."""
    s, y = np.asarray(scores, float), np.asarray(labels)
    pos, neg = s[y == 1], s[y == 0]
    return float((pos[:, None] > neg[None, :]).mean())


def answer_nll_unshifted(model, X, ids, answer_mask):
    """WRONG: reads the answer token's own position instead of the one before it."""
    body, W = epgs._body_and_head(model)
    pos = answer_mask.nonzero().squeeze(1)
    h = body(inputs_embeds=X).last_hidden_state[:, pos]
    return answer_nll_reference(h, W, ids[pos].expand(X.shape[0], -1), torch.ones(X.shape[0], len(pos), dtype=torch.bool))


HAND = torch.tensor([[[0.0, 0.0]], [[3.0, 0.0]], [[0.0, 1.0]]])     # g0 = 0, g1 = (3, 0), g2 = (0, 1), σ = 1
HAND2 = torch.tensor([[[1.0, 0.0]], [[3.0, 0.0]], [[-1.0, 0.0]]])   # g0 = (1, 0), g1 = (3, 0), g2 = (−1, 0)


def test_scores_hand_computed():
    s = scores_from_grads(HAND, 1.0)
    assert s["spike"] == pytest.approx(2.0) and s["curvature"] == pytest.approx(math.sqrt(5))
    assert s["ratio"] == pytest.approx(2.0 / 1e-8)
    s2 = scores_from_grads(HAND2, 0.5)
    assert s2["spike"] == pytest.approx(1.0) and s2["ratio"] == pytest.approx(2.0, rel=1e-6)
    assert s2["curvature"] == pytest.approx(math.sqrt((4 + 4) / 2) / 0.5)
    # the known-wrong variants give other numbers on the same hand cases
    assert curvature_mean_norm(HAND, 1.0) == pytest.approx(2.0) != pytest.approx(s["curvature"])
    assert spike_of_means(HAND2, 0.5) == pytest.approx(0.0) != pytest.approx(s2["spike"])


def test_curvature_estimates_hessian_frobenius():
    # a quadratic: g(x + ε) − g(x) = Aε exactly, so the squared score estimates ‖A[:, P]‖_F² without bias
    A = torch.tensor([[2.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 1.0]], dtype=torch.float64)
    P = torch.tensor([True, True, False])
    z = torch.randn(40000, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    eps = torch.zeros(40000, 3, dtype=torch.float64)
    eps[:, P] = 0.01 * z
    g = torch.cat([torch.zeros(1, 3, dtype=torch.float64), eps @ A])[:, :, None]
    want = float(A[:, P].norm())
    assert scores_from_grads(g, 0.01)["curvature"] == pytest.approx(want, rel=0.01)
    assert curvature_mean_norm(g, 0.01) < 0.95 * want                       # the wrong reading is biased low
    est, true = mlp_curvature_check(n_points=25, seed=1)
    from scipy.stats import spearmanr
    assert spearmanr(est, true).statistic >= 0.8 and np.median(np.abs(est / true - 1)) < 0.2


@pytest.mark.parametrize("shape", [(3, 5, 20000, 16), (2, 1, 777, 8)])
def test_streaming_head_equals_cross_entropy(shape):
    B, T, V, d = shape
    torch.manual_seed(0)
    h = torch.randn(B, T, d, requires_grad=True)
    W = torch.randn(V, d) / math.sqrt(d)
    tg = torch.randint(0, V, (B, T))
    mk = torch.rand(B, T) > 0.3
    mk[0] = True
    ref = answer_nll_reference(h, W, tg, mk)
    out = answer_nll_from_hidden(h, W, tg, mk, 1000)
    (g_ref,) = torch.autograd.grad(ref.sum(), h)
    (g_out,) = torch.autograd.grad(out.sum(), h)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(g_out, g_ref, atol=1e-5)


def test_compiled_head_equals_eager():
    from kimi_papers.core import kernels
    torch.manual_seed(1)
    h = torch.randn(3, 4, 16, requires_grad=True)
    W = torch.randn(49152, 16) / 4
    tg, mk = torch.randint(0, 49152, (3, 4)), torch.rand(3, 4) > 0.2
    out = answer_nll_compiled(h, W, tg, mk)
    assert kernels.compiled_ran(answer_nll_compiled)
    ref = answer_nll_reference(h, W, tg, mk)
    (g1,) = torch.autograd.grad(out.sum(), h)
    (g2,) = torch.autograd.grad(ref.sum(), h)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(g1, g2, atol=1e-5)


@pytest.fixture(scope="module")
def tiny():
    model = tiny_causal_lm(vocab_size=40, d_model=32, n_layers=2, n_heads=4, seed=0)
    E, am, pm, ids = embed_prompt_answer(model, None, [3, 7, 11, 2, 9], [21, 4, 30])
    return model, E, am, pm, ids


def test_answer_nll_is_the_shifted_log_prob(tiny):
    model, E, am, pm, ids = tiny
    with torch.no_grad():
        lp = torch.log_softmax(model(inputs_embeds=E[None]).logits[0], -1)
        want = -torch.stack([lp[t - 1, ids[t]] for t in range(5, 8)]).mean().item()
        assert answer_nll(model, E[None], ids, am).item() == pytest.approx(want, abs=1e-5)
        assert abs(answer_nll_unshifted(model, E[None], ids, am).item() - want) > 1e-3   # the off-by-one is caught


def test_gradient_matches_finite_difference(tiny):
    model, E, am, pm, ids = tiny
    m64 = tiny_causal_lm(vocab_size=40, d_model=32, n_layers=2, n_heads=4, seed=0).double()
    X = E.double().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(answer_nll(m64, X[None], ids, am).sum(), X)
    v = torch.randn_like(X)
    fd = (answer_nll(m64, (X + 1e-4 * v)[None], ids, am) - answer_nll(m64, (X - 1e-4 * v)[None], ids, am)).item() / 2e-4
    assert (g * v).sum().item() == pytest.approx(fd, rel=1e-3)   # transformers' RMSNorm computes in float32 inside


def test_noise_on_prompt_only_and_shared_across_alphas(tiny, monkeypatch):
    model, E, am, pm, ids = tiny
    seen = {}

    def capture(model_, X, ids_, am_, head=None):
        seen["X"] = X.detach().clone()
        return (X ** 2).sum((1, 2))
    monkeypatch.setattr(epgs, "answer_nll", capture)
    g, sig = perturbed_grads(model, E, ids, am, pm, K=3, alpha=(0.01, 0.1), seed=4)
    X = seen["X"]
    assert torch.equal(X[0], E) and torch.allclose(g, 2 * X)
    delta = X[1:] - E
    assert delta[:, am].abs().max() == 0 and (delta[:, pm].abs() > 0).all()   # answer positions never perturbed
    z1, z2 = delta[:3, pm] / sig[0], delta[3:, pm] / sig[1]
    assert torch.allclose(z1, z2, atol=1e-4)                                    # the same z for every α
    assert sig[1] / sig[0] == pytest.approx(10.0) and float(sig[0]) == pytest.approx(0.01 * float(E.pow(2).mean().sqrt()))
    g_b, _ = perturbed_grads(model, E, ids, am, pm, K=3, alpha=(0.01, 0.1), seed=5)
    assert not torch.equal(seen["X"], X)                                        # another seed, other noise


def test_epgs_scores_deterministic_and_bad_input(tiny):
    model, E, am, pm, ids = tiny
    a = epgs_scores(model, E, ids, am, pm, K=2, alpha=0.05, seed=3)
    assert a == epgs_scores(model, E, ids, am, pm, K=2, alpha=0.05, seed=3) and all(map(math.isfinite, a.values()))
    with pytest.raises(ValueError, match="K"):
        epgs_scores(model, E, ids, am, pm, K=0)
    with pytest.raises(ValueError, match="alpha"):
        epgs_scores(model, E, ids, am, pm, alpha=-0.1)
    with pytest.raises(ValueError, match="answer_mask"):
        epgs_scores(model, E, ids, torch.zeros_like(am), pm)
    with pytest.raises(ValueError, match="perturb_mask"):
        epgs_scores(model, E, ids, am, torch.zeros_like(pm))
    with pytest.raises(ValueError, match="answer"):
        embed_prompt_answer(model, None, [1, 2], [])
    with pytest.raises(TypeError, match="model"):
        answer_nll(torch.nn.Linear(2, 2), E[None], ids, am)


def test_auroc_against_sklearn_and_ties():
    rng = np.random.default_rng(0)
    for _ in range(30):
        s, y = rng.integers(0, 4, 50).astype(float), rng.integers(0, 2, 50)
        assert auroc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    s, y = [1.0, 1.0, 0.0, 2.0], [1, 0, 0, 1]
    assert auroc(s, y) == pytest.approx(0.875) and auroc_strict(s, y) == pytest.approx(0.75)   # the tie rule decides
    with pytest.warns(RuntimeWarning):
        assert math.isnan(auroc([1.0, 2.0], [0, 0]))
    auc, lo, hi = auroc_with_ci(rng.normal(size=300) + np.r_[np.zeros(150), np.ones(150)], np.r_[np.zeros(150), np.ones(150)])
    assert lo < auc < hi and abs(auc - 0.76) < 0.07


def test_detectors_hand_computed():
    assert entropy_score(torch.zeros(3, 5)) == pytest.approx(math.log(5))
    assert neg_logprob(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([1])) == pytest.approx(-math.log(0.75))
    assert sample_disagreement("a", ["a", "b", "b", "a"]) == 0.5
    H = torch.tensor([[1.0, 2.0], [-1.0, -2.0]])
    assert eigen_spread(H) == pytest.approx(0.5 * (math.log(1e-3) + math.log(5 + 1e-3)))
    assert confident_subset([0.2, 0.9, 0.5, 0.95]).tolist() == [1, 3]
    X = np.random.default_rng(1).normal(size=(100, 6))
    y = (X[:, 1] + 0.3 * X[:, 2] > 0).astype(int)
    assert auroc(probe_cv(X, y), y) > 0.85
    with pytest.raises(ValueError):
        eigen_spread(torch.ones(1, 4))


class FakeTok:
    all_special_ids = [0]
    pieces = {0: "<eos>", 1: " Paris", 2: ".", 3: " is", 4: "\n", 5: " 1", 6: "2"}

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)


def test_answer_extraction_and_correctness():
    t = FakeTok()
    assert answer_span(t, [1, 2, 3]) == [1] and answer_span(t, [5, 6, 4, 5]) == [5, 6] and answer_span(t, [0, 1]) == []
    assert answer_span(t, [1, 3, 3, 3, 3, 3, 3, 3], max_tokens=6) == [1, 3, 3, 3, 3, 3]
    assert normalize(" Brasília!") == "brasilia"
    q = Question("38 + 6 =", ("44",), "arithmetic")
    assert is_correct(q, " 44") and not is_correct(q, " 10 is the correct") and not is_correct(q, " 440")
    c = Question("The capital of Peru is", ("lima",), "capital")
    assert is_correct(c, " Lima") and not is_correct(c, " Limassol") and not is_correct(c, " the capital of Peru")
    pool = fact_pool()
    a, b = make_questions(pool, [30, 30], seed=2)
    assert len(set(a) | set(b)) == 60 and len({q.stem for q in pool}) == len(pool)
