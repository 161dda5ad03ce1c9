"""Library tests of kimi_papers.serving.mvr_cache that are cheaper as pytest than in the notebook.

Most tests use hand-made token states (no MiniLM): the kernel against the per-pair loop, the segment helpers, the
vCache fit and exploration probability against hand-computed values, and the cache object (get/put, eviction,
persistence, bad input) on 2-d vectors whose similarities can be checked by eye. One test loads MiniLM to check
that the sentence vector equals core.models.embed's pooling."""
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kimi_papers.serving.mvr_cache import (
    CosineScorer, Encoded, MVRScorer, SegmenterPolicy, SigmoidCalibrator, TokenBank, as_encoded, balanced_bce,
    batch_segment_ids, maxsim_compiled, maxsim_score, pooled_maxsim, sample_pairs, segment_ids, segment_means,
    train_segmenter)
from kimi_papers.serving.mvr_cache_experiment import maxsim_reference
from kimi_papers.serving.mvr_cache_semsynth import make_semsynth
from kimi_papers.serving.mvr_cache_vcache import (
    VCACHE_VARIANCE, VCachePolicy, fit_threshold, hit_at_error, normalise_answer, roc_auc, run_stream, vcache_tau)


def _ragged(g, sizes, d=16):
    sets = [torch.randn(m, d, generator=g) for m in sizes]
    M = max(sizes)
    pad, mask = torch.zeros(len(sizes), M, d), torch.zeros(len(sizes), M, dtype=torch.bool)
    for b, s in enumerate(sets):
        pad[b, :len(s)], mask[b, :len(s)] = s, True
    return sets, pad, mask, torch.randn(len(sizes), d, generator=g)


@pytest.mark.parametrize("full_row,blend", [(True, True), (False, False), (True, False), (False, True)])
def test_batched_maxsim_matches_loop(full_row, blend):
    g = torch.Generator().manual_seed(1)
    qs, Q, qm, fq = _ragged(g, [1, 4, 2, 1, 3])
    cs, C, cm, fc = _ragged(g, [3, 1, 2, 1, 4])
    ref = maxsim_reference(qs, cs, fq, fc, full_row, blend)
    torch.testing.assert_close(maxsim_score(Q, C, qm, cm, fq, fc, full_row, blend), ref, atol=1e-6, rtol=1e-6)


def test_maxsim_hand_case():
    # Q rows e1, e2; C row e1: row maxima 1 and 0 -> 0.5, column max 1 -> MaxSim 0.75 -> (0.75 + 1) / 2
    Q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    C = torch.tensor([[[1.0, 0.0], [5.0, 5.0]]])
    s = maxsim_score(Q, C, torch.tensor([[True, True]]), torch.tensor([[True, False]]), Q[:, 0], C[:, 0], False, False)
    assert float(s) == pytest.approx((0.75 + 1) / 2)


@pytest.mark.slow
def test_compiled_maxsim_matches_eager():
    g = torch.Generator().manual_seed(2)
    _, Q, qm, fq = _ragged(g, [2, 1, 3])
    _, C, cm, fc = _ragged(g, [1, 3, 3])
    torch.testing.assert_close(maxsim_compiled(Q, C, qm, cm, fq, fc), maxsim_score(Q, C, qm, cm, fq, fc), atol=1e-5, rtol=1e-5)


def test_pooled_maxsim_equals_segment_means_then_loop():
    g = torch.Generator().manual_seed(3)
    tq, tc = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)
    bq, bc = [[1, 3], []], [[2], [0, 4]]
    lq, lc = torch.tensor([6, 5]), torch.tensor([4, 6])
    sq = batch_segment_ids(torch.tensor([b + [-1] * (2 - len(b)) for b in bq]), lq, 6)
    sc = batch_segment_ids(torch.tensor([b + [-1] * (2 - len(b)) for b in bc]), lc, 6)
    want = maxsim_reference([segment_means(tq[i, :lq[i]], bq[i]) for i in range(2)],
                            [segment_means(tc[i, :lc[i]], bc[i]) for i in range(2)],
                            torch.stack([tq[i, :lq[i]].mean(0) for i in range(2)]),
                            torch.stack([tc[i, :lc[i]].mean(0) for i in range(2)]))
    torch.testing.assert_close(pooled_maxsim(tq, sq, tc, sc, 3), want, atol=1e-6, rtol=1e-6)


def test_segments():
    assert segment_ids(6, [0, 2]).tolist() == [0, 1, 1, 2, 2, 2]
    torch.testing.assert_close(segment_means(torch.arange(8.0).view(4, 2), [0]), torch.tensor([[0.0, 1.0], [4.0, 5.0]]))
    for bad in ([2, 2], [5], [-2]):
        with pytest.raises(ValueError):
            segment_ids(6, bad)


def test_policy_boundaries_increasing_and_on_candidates():
    torch.manual_seed(0)
    pol = SegmenterPolicy(8, 8, max_segments=3)
    tok = torch.randn(5, 10, 8)
    cand = torch.rand(5, 10) < 0.4
    cand[:, -1] = False
    b, lp = pol(tok, cand, generator=torch.Generator().manual_seed(0))
    for r in range(5):
        row = [x for x in b[r].tolist() if x >= 0]
        assert row == sorted(set(row)) and all(cand[r, x] for x in row)
        assert len(row) == min(3, len(row)) and (len(row) == 3 or b[r].tolist()[len(row):] == [-1] * (3 - len(row)))
    assert (lp <= 0).all()
    with pytest.raises(ValueError):
        SegmenterPolicy(max_segments=0)


def test_calibrator_and_balanced_bce():
    cal = SigmoidCalibrator(t=0.6, gamma=5.0)
    assert float(cal(torch.tensor(0.6))) == pytest.approx(0.5)
    assert float(cal(torch.tensor(0.8))) == pytest.approx(1 / (1 + math.exp(-1.0)), rel=1e-6)
    with pytest.raises(ValueError):
        cal.loss(torch.tensor([0.5, 0.6]), torch.tensor([0.0, 0.0]))
    w = balanced_bce(torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 0.0, 0.0]))
    assert w.tolist() == pytest.approx([1.5 * math.log(2), 0.75 * math.log(2), 0.75 * math.log(2)], rel=1e-5)


def test_sample_pairs_labels_and_neighbours():
    lab = np.repeat(np.arange(4), 3)
    i, j, c = sample_pairs(lab, 50, np.random.default_rng(0))
    assert (c == (lab[i] == lab[j])).all() and (i != j).all()
    table = np.tile(np.arange(12)[::-1], (12, 1))[:, :4]     # everyone's "neighbours" are 11, 10, 9, 8
    i, j, c = sample_pairs(lab, 50, np.random.default_rng(0), table)
    assert (c == (lab[i] == lab[j])).all()
    ok = [jj in table[ii][(lab[table[ii]] == lab[ii]) == cc] for ii, jj, cc in zip(i, j, c) if ((lab[table[ii]] == lab[ii]) == cc).any()]
    assert all(ok) and len(ok) > 10


def test_training_runs_and_is_deterministic():
    g = torch.Generator().manual_seed(4)
    encs = []
    for k in range(12):
        tok = torch.randn(7, 16, generator=g)
        cand = torch.zeros(7, dtype=torch.bool)
        cand[[1, 3, 4]] = True
        encs.append(Encoded(tok, cand, F.normalize(tok.mean(0), dim=0), [(i, i + 1) for i in range(7)], ["x"] * 7))
    bank = TokenBank.stack(encs)
    lab = np.repeat(np.arange(4), 3)
    a = train_segmenter(bank, lab, 4, seed=1, compiled=False)
    b = train_segmenter(bank, lab, 4, seed=1, compiled=False)
    assert a.history == b.history and len(a.history["reward"]) == 4
    with pytest.raises(ValueError):
        train_segmenter(bank, lab[:5], 1)


def test_fit_threshold_cases():
    s = np.array([0.60, 0.65, 0.70, 0.72, 0.75, 0.80, 0.85, 0.90])
    c = np.array([0, 0, 1, 0, 1, 0, 1, 1])
    t, gamma, var = fit_threshold(s, c)
    p = 1 / (1 + np.exp(-(gamma * (s - t))))
    assert abs((c - p).sum()) < 0.02 and var > 0            # rounded t: the score equations hold to rounding
    assert fit_threshold([0.1, 0.2, 0.3, 0.7, 0.8, 0.9, 0.95], [0, 0, 0, 1, 1, 1, 1])[2] == VCACHE_VARIANCE[7]
    assert fit_threshold([0.5] * 6, [1] * 6) is None
    assert fit_threshold([0.5] * 5, [0, 1, 0, 1, 0]) is None
    with pytest.raises(ValueError):
        fit_threshold([0.1, 0.2], [1])


def test_vcache_tau_hand_values():
    # var = 0: t' = t for every eps; tau = min over eps of 1 - delta / (1 - (1 - eps) sigmoid(gamma (s - t)))
    lik = 1 / (1 + math.exp(-10 * (0.55 - 0.5)))
    want = min(1 - 0.1 / (1 - (1 - e) * lik) for e in np.linspace(1e-6, 1 - 1e-6, 50))
    assert vcache_tau(0.55, 0.5, 10.0, 0.0, 0.1) == pytest.approx(max(0.0, want), abs=1e-9)
    assert vcache_tau(0.999, 0.2, 100.0, 0.0, 0.05) == 0.0
    assert vcache_tau(0.1, 0.9, 100.0, 0.0, 0.05) == pytest.approx(0.95, abs=1e-6)


VEC = {"a": [1.0, 0.0], "a2": [0.995, 0.0998], "b": [0.0, 1.0], "c": [-1.0, 0.0], "d": [0.6, 0.8]}


def _fake(prompts):
    return [Encoded(torch.zeros(1, 2), torch.zeros(1, dtype=torch.bool), F.normalize(torch.tensor(VEC[p]), dim=0), [(0, 1)], ["x"])
            for p in prompts]


def _gen(p):
    return p.rstrip("2").upper()


def test_cache_explore_exploit_and_insert():
    cache = VCachePolicy(0.05, CosineScorer(_fake), k=3)
    assert cache.process("a", _gen) == (False, "A")
    assert cache.process("a2", _gen) == (False, "A") and len(cache) == 1
    assert cache.process("b", _gen) == (False, "B") and len(cache) == 2
    assert cache.entries[0].obs_c == [1, 0]
    s = np.round(np.linspace(0.5, 0.99, 40), 3)       # overlapping classes around t ~ 0.7: a small delta-method variance
    c = (s > 0.7).astype(int)
    c[15], c[17] = 1, 0
    cache.entries[0].obs_s, cache.entries[0].obs_c = s.tolist(), c.tolist()
    assert cache.process("a2", _gen) == (True, "A") and cache.stats["hits"] == 1


@pytest.mark.parametrize("eviction,gone", [("lru", "b"), ("fifo", "a")])
def test_cache_size_bound(eviction, gone):
    cache = VCachePolicy(0.05, CosineScorer(_fake), max_entries=2, eviction=eviction)
    for p in ("a", "b", "a2", "c"):
        cache.process(p, _gen)
    assert len(cache) == 2 and gone not in {e.prompt for e in cache.entries.values()}


def test_cache_persistence_roundtrip(tmp_path):
    cache = VCachePolicy(0.05, CosineScorer(_fake), seed=3)
    for p in ("a", "b", "a2", "d"):
        cache.process(p, _gen)
    path = cache.save(tmp_path / "c.json")
    back = VCachePolicy.load(path, CosineScorer(_fake))
    assert back.state() == cache.state()
    assert [back.process(p, _gen) for p in ("a2", "c")] == [cache.process(p, _gen) for p in ("a2", "c")]
    assert sorted(os.listdir(tmp_path)) == ["c.json"] and json.loads(path.read_text())["format"].startswith("kimi_papers")


def test_cache_bad_input():
    for kw in (dict(delta=0), dict(delta=1.5), dict(k=0), dict(max_entries=-1), dict(eviction="random"), dict(policy="static")):
        with pytest.raises(ValueError):
            VCachePolicy(**{"delta": 0.1, "sim_fn": CosineScorer(_fake), **kw})
    cache = VCachePolicy(0.1, CosineScorer(_fake))
    with pytest.raises(ValueError):
        cache.process("  ", _gen)


def test_stream_metrics_and_auc():
    r = run_stream(VCachePolicy(0.05, CosineScorer(_fake), policy="static", threshold=0.5), ["a", "d", "a2"], _gen,
                   lambda x, y: x.rstrip("2") == y.rstrip("2"))
    assert r.hit.tolist() == [False, True, True] and r.wrong.tolist() == [False, True, False]
    assert r.error_rate == pytest.approx(1 / 3) and r.error_given_hit == 0.5
    assert roc_auc([0.2, 0.9, 0.4, 0.4], [0, 1, 0, 1]) == pytest.approx(0.875)
    assert hit_at_error([0.02, 0.04], [0.3, 0.6], 0.03) == 0.3
    assert normalise_answer("Lima.") == "lima"


def test_mvr_scorer_on_fake_segments():
    def enc(ps):
        out = []
        for p in ps:
            tok = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0] if p == "x" else [0.0, -1.0]])
            out.append(Encoded(tok, torch.tensor([False, True, False]), F.normalize(tok.mean(0), dim=0), [(0, 1)] * 3, ["t"] * 3))
        return out
    sc = MVRScorer(lambda p, e: [1], encode=enc, full_row=False, blend=False, compiled=False)
    # segments: [e1], [e2] vs [e1], [-e2]: row maxima 1 and max(0, -1) = 0 -> MaxSim 0.5 -> 0.75
    assert sc.score(sc.prepare("x"), [sc.prepare("y")])[0] == pytest.approx(0.75)
    assert sc.score(sc.prepare("x"), [sc.prepare("x"), sc.prepare("y")]).tolist() == pytest.approx([1.0, 0.75])


def test_scorers_take_any_embedder():
    """A plain texts -> [n_tokens, d] tensors callable works; same hand-checked 0.75 as the Encoded version above."""
    def embed(ps):
        return [torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0] if p == "x" else [0.0, -1.0]]) for p in ps]
    sc = MVRScorer(lambda p, e: [1], encode=embed, full_row=False, blend=False, compiled=False)
    assert sc.score(sc.prepare("x"), [sc.prepare("x"), sc.prepare("y")]).tolist() == pytest.approx([1.0, 0.75])
    e = as_encoded(embed(["x"])[0])
    assert e.cand.tolist() == [True, True, False] and torch.allclose(e.sent, F.normalize(torch.tensor([2.0, 1.0]), dim=0))
    cos = CosineScorer(encode=embed)
    # whole-prompt vectors (2, 1)/sqrt5 and (2, -1)/sqrt5: cos = 3/5 -> (3/5 + 1) / 2 = 0.8
    assert cos.score(cos.prepare("x"), [cos.prepare("y")])[0] == pytest.approx(0.8)
    bank = TokenBank.stack(embed(["x", "y"]) + [torch.ones(1, 2)])
    assert bank.tok.shape == (3, 3, 2) and bank.length.tolist() == [3, 3, 1]
    for bad in ([], [torch.ones(3, 2)] * 2, [torch.ones(3)], [torch.zeros(0, 2)], ["not a tensor"]):
        with pytest.raises(ValueError, match="per text"):
            CosineScorer(encode=lambda ps, bad=bad: bad).prepare("z")


def test_moved_names_still_resolve():
    import kimi_papers.serving.mvr_cache as m
    from kimi_papers.serving import mvr_cache_vcache
    for name, home in (("VCachePolicy", mvr_cache_vcache.VCachePolicy), ("make_semsynth", make_semsynth),
                       ("maxsim_reference", maxsim_reference)):
        with pytest.warns(DeprecationWarning, match=name):
            assert getattr(m, name) is home
    with pytest.raises(AttributeError):
        m.no_such_name


def test_semsynth_rule():
    d = make_semsynth(6, 2, n_paraphrases=2)
    assert len(d) == 24
    same = [(i, j) for i in range(24) for j in range(24) if d.intent[i] == d.intent[j]]
    assert all(d.answers[d.intent[i]] == d.answers[d.intent[j]] for i, j in same)
    assert make_semsynth(6, 2, seed=1).prompts != d.prompts[:0] and make_semsynth(6, 2, n_paraphrases=2).prompts == d.prompts


@pytest.mark.slow
def test_minilm_sentence_vector_matches_core_embed():
    from kimi_papers.core.models import embed, load_minilm
    from kimi_papers.serving.mvr_cache import encode_tokens
    model, tok = load_minilm("cpu")
    texts = ["What is the capital of Peru? Be brief.", "Convert 3 km to miles."]
    enc = encode_tokens(texts, model, tok)
    torch.testing.assert_close(torch.stack([e.sent for e in enc]), embed(texts, model, tok), atol=1e-5, rtol=1e-5)
    assert enc[0].tokens[0] == "what" and enc[0].cand.sum() == 1


@pytest.mark.gpu
def test_maxsim_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(5)
    _, Q, qm, fq = _ragged(g, [2, 3, 1])
    _, C, cm, fc = _ragged(g, [1, 3, 2])
    cpu = maxsim_score(Q, C, qm, cm, fq, fc)
    gpu = maxsim_score(*(t.cuda() for t in (Q, C, qm, cm, fq, fc)))
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-5)
