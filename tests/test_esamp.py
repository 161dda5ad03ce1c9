"""Tests of kimi_papers.decoding.esamp: the Distiller bank, the candidate filter, the fused candidate kernel against the
full-vocabulary reference, ESamp decoding on a tiny random Llama, the metrics and the spec's bad inputs."""
import math

import pytest
import torch

from kimi_papers.core.models import CharTokenizer, tiny_causal_lm
from kimi_papers.core.rl.rollout import KVDecoder, Policy
from kimi_papers.decoding.esamp import (
    FORMS, GenResult, LowRankGatedResidual, OnlineDistiller, candidate_index, esamp_candidate_logits, esamp_generate,
    esamp_logits, esamp_taps, filter_candidates, vendi_score)
from kimi_papers.decoding.esamp_experiment import (
    WordProblem, frontier_margin, make_problems, parse_answer, problem_metrics)


@pytest.fixture(scope="module")
def policy():
    tok = CharTokenizer("0123456789+-=? abcdefghijklmnopqrstuvwxyz")
    model = tiny_causal_lm(tok.vocab_size, d_model=64, n_layers=3, n_heads=4, max_len=128, seed=0, tokenizer=tok)
    return Policy(model, tok, add_bos=True)


def test_distiller_formula_by_hand():
    f = LowRankGatedResidual(4, rank=2, seed=3)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    A, G, B = f.A[0], f.G[0], f.B[0]
    y = x + ((x @ A) * torch.nn.functional.silu(x @ G + 1.0)) @ B
    ref = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + 1e-5)
    torch.testing.assert_close(f(x), ref, atol=1e-5, rtol=1e-5)
    assert f.b_g.eq(1).all() and abs(float(f.A.std()) - 0.02) < 0.01


def test_bank_equals_separate_distillers():
    g = torch.Generator().manual_seed(1)
    bank = OnlineDistiller(6, 3, 5e-3, banks=2, seed=0)
    solo = [OnlineDistiller(6, 3, 5e-3, banks=1, seed=0) for _ in range(2)]
    for p, s in enumerate(solo):
        with torch.no_grad():
            for a in ("A", "G", "B", "b_g", "ln_w", "ln_b"):
                getattr(s.net, a).copy_(getattr(bank.net, a)[p:p + 1])
    for _ in range(4):
        x, y = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 6, generator=g)
        torch.testing.assert_close(bank.update(x, y), torch.stack([s.update(x[p:p + 1], y[p:p + 1])[0]
                                                                    for p, s in enumerate(solo)]), atol=1e-6, rtol=1e-5)


def test_update_lowers_error_on_repeated_pairs():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(1, 16, 32, generator=g), torch.randn(1, 16, 32, generator=g)
    d = OnlineDistiller(32, 8, 1e-2, banks=1)
    first = float(d.update(x, y))
    for _ in range(30):
        last = float(d.update(x, y))
    assert last < 0.7 * first


def test_filters_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0], [0.0, 0.0, 0.0, 0.0]])
    assert filter_candidates(logits, min_p=0.3)[0].tolist() == [True, True, False, False]
    assert filter_candidates(logits, min_p=0.3)[1].all()                     # a flat row keeps everything
    assert filter_candidates(logits, top_p=0.5)[0].tolist() == [True, False, False, False]
    assert filter_candidates(logits, top_k=2)[0].tolist() == [True, True, False, False]
    idx, valid = candidate_index(logits, filter_candidates(logits, min_p=0.3))
    assert idx.shape == (2, 4) and valid[0].tolist() == [True, True, False, False] and idx[0, :2].tolist() == [0, 1]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_candidate_kernel_equals_full_vocabulary(form, beta):
    g = torch.Generator().manual_seed(4)
    B, V, d = 8, 40, 12
    logits, W = torch.randn(B, V, generator=g) * 2, torch.randn(V, d, generator=g)
    net = LowRankGatedResidual(d, 4, banks=2, seed=0)
    h_s = torch.randn(2, 4, d, generator=g)
    cand = filter_candidates(logits / 0.7, min_p=0.05)
    idx, valid = candidate_index(logits, cand)
    with torch.no_grad():
        full = esamp_logits(logits, cand, net(h_s).reshape(B, d), W, beta, 0.7, form)
    for compiled in (False, True):
        z = esamp_candidate_logits(net, h_s, W, logits, idx, valid, beta, 0.7, form, compiled=compiled)
        torch.testing.assert_close(z[valid], full.gather(-1, idx)[valid], atol=1e-4, rtol=1e-4)
        assert (z[~valid] == -math.inf).all()
    # the two forms agree at T = 1 and differ elsewhere (for beta > 0)
    if beta > 0:
        a = esamp_logits(logits, cand, net(h_s).reshape(B, d).detach(), W, beta, 1.0, "code")
        b = esamp_logits(logits, cand, net(h_s).reshape(B, d).detach(), W, beta, 1.0, "spec")
        torch.testing.assert_close(a, b)


def test_generate_seeded_beta0_and_compiled(policy):
    ps = ["12+3=?", "7-2=?"]
    base = esamp_generate(policy, ps, 3, 8, beta=0.0, distill=False, seed=5)
    assert torch.equal(base.tokens, esamp_generate(policy, ps, 3, 8, beta=0.0, seed=5).tokens)
    e = esamp_generate(policy, ps, 3, 8, beta=1.0, seed=5, compiled=False)
    assert torch.equal(e.tokens, esamp_generate(policy, ps, 3, 8, beta=1.0, seed=5, compiled=True).tokens)
    assert not torch.equal(e.tokens, base.tokens) and e.novelty.shape[1] == 6
    assert torch.equal(e.tokens, esamp_generate(policy, ps, 3, 8, beta=1.0, seed=5, compiled=False).tokens)
    one = esamp_generate(policy, ps[:1], 1, 4, beta=0.5, seed=0)            # n = 1 works
    assert one.tokens.shape[0] == 1


def test_taps_are_the_two_input_norms(policy):
    taps = esamp_taps(policy.model, 0, -1)
    layers = policy.model.base_model.layers
    assert taps[0] is layers[0].input_layernorm and taps[1] is layers[-1].input_layernorm
    assert len(esamp_taps(policy.model, 1, 2, target="final_norm")) == 1
    dec = KVDecoder(policy, [policy.encode_prompt("12+3=?")], taps=taps)
    assert dec.tapped[0].shape == dec.tapped[1].shape == (1, 64)


def test_metrics_by_hand():
    assert parse_answer("7 + 3 = 10.") == 10 and parse_answer("") is None
    assert abs(vendi_score(torch.eye(3)) - 3) < 1e-9 and abs(vendi_score(torch.ones(4, 2)) - 1) < 1e-9
    res = GenResult(["5", "5", "6", "x"], torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1, dtype=torch.long),
                    torch.zeros(1, 4), torch.zeros(4), 0.0, 2)
    m = problem_metrics(res, [WordProblem("a", 5), WordProblem("b", 6)], ks=(1, 2))
    assert [r["acc"] for r in m] == [1.0, 0.5] and m[1]["pass@2"] == 1.0 and m[1]["parsed"] == 0.5
    assert abs(frontier_margin([0.0, 1.0], [2.0, 0.0], 0.5, 1.5) - 0.5) < 1e-12
    assert make_problems(4, 3) == make_problems(4, 3)


@pytest.mark.parametrize("kw, match", [(dict(n=0), "n="), (dict(beta=-0.1), "beta"), (dict(src_layer=2, tgt_layer=0),
                                        "source layer"), (dict(src_layer=9), "src_layer"), (dict(form="x"), "form"),
                                       (dict(max_new_tokens=0), "max_new_tokens")])
def test_bad_inputs(policy, kw, match):
    with pytest.raises(ValueError, match=match):
        esamp_generate(policy, ["1+1=?"], **{"n": 2, "max_new_tokens": 2, **kw})


def test_bad_distiller_inputs():
    for kw, match in ((dict(d=8, rank=0), "rank"), (dict(d=4, rank=5), "rank"), (dict(d=8, lr=-1.0), "lr")):
        with pytest.raises(ValueError, match=match):
            OnlineDistiller(**kw)
    with pytest.raises(ValueError, match="h_d"):
        OnlineDistiller(4, 2).update(torch.zeros(1, 2, 4), torch.zeros(1, 3, 4))
    with pytest.raises(ValueError, match="at least one candidate"):
        esamp_logits(torch.zeros(1, 3), torch.zeros(1, 3, dtype=torch.bool), torch.zeros(1, 2), torch.zeros(3, 2), 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_generate_on_cuda(policy):
    cuda = Policy(policy.model.to("cuda"), policy.tokenizer, add_bos=True)
    out = esamp_generate(cuda, ["12+3=?"], 2, 4, beta=0.3, seed=0)
    assert out.tokens.device.type == "cuda" and len(out.texts) == 2
    policy.model.to("cpu")


def test_parse_answer_is_the_core_parser_and_old_names_resolve():
    import kimi_papers.decoding.esamp as m
    from kimi_papers.core.rl.tasks import last_integer
    assert parse_answer is last_integer
    assert parse_answer("so 7 + 3 = 10 coins.") == 10 and parse_answer("1,234 apples, -4") == -4
    assert parse_answer("1,234 apples") == 1234 and parse_answer("none") is None
    for name in ("parse_answer", "make_problems", "frontier_margin"):
        with pytest.warns(DeprecationWarning, match=name):
            getattr(m, name)
