"""kimi_papers.evaluation.omtg as a library: the metric against enumeration and hand-computed cases, known-wrong
variants that the tests must tell apart, the rewards, the compiled reward batch, and the experiment's pieces."""
import itertools

import numpy as np
import pytest
import torch

from kimi_papers.evaluation.omtg import (
    TAUS, as_segments, caption_reward, clean_segments, count_accuracy, etf1, etf1_per_sample, etf1_sample,
    length_reward, match_brute, match_segments, pad_segments, permutations_table, r1_at, temporal_reward,
    temporal_reward_batch, tiou, tiou_matrix, total_reward)


def random_sets(rng, n_max=6, span=30, integer=True):
    n, m = rng.integers(0, n_max + 1, 2)
    out = []
    for k in (n, m):
        if integer:
            s = np.sort(rng.integers(0, span, (k, 2)), 1).astype(float)
            s[:, 1] += 1
        else:
            s = np.sort(rng.uniform(0, span, (k, 2)), 1)
            s[:, 1] += 0.25
        out.append(s)
    return out


def f1_from_tp(tp, n, m):
    return 1.0 if n == m == 0 else (0.0 if tp == 0 else 2 * tp / (n + m))


# ---- reference and known-wrong variants -------------------------------------------------------------------------
def tiou_closed(a, b):
    """WRONG: frame-inclusive intervals ([s, e] holds e - s + 1 frames), so touching segments overlap."""
    inter = max(0.0, min(a[1], b[1]) - max(a[0], b[0]) + 1)
    return inter / ((a[1] - a[0] + 1) + (b[1] - b[0] + 1) - inter)


def greedy_tp(M, tau):
    """WRONG: greedy by largest tIoU first."""
    used_p, used_g, tp, total = set(), set(), 0, 0.0
    for j, k in sorted(itertools.product(range(M.shape[0]), range(M.shape[1])), key=lambda x: -M[x]):
        if j not in used_p and k not in used_g and M[j, k] > 0:
            used_p.add(j); used_g.add(k); total += M[j, k]; tp += M[j, k] >= tau
    return tp, total


def many_to_one_tp(M, tau):
    """WRONG: every prediction may match its best ground-truth segment, shared or not."""
    return int((M.max(1) >= tau).sum()) if M.size else 0


def maxsum_then_threshold_tp(P, G, tau):
    """WRONG (the spec's first wording): the max-total-tIoU matching, then count pairs above tau."""
    return sum(iou >= tau for _, _, iou in match_segments(P, G))


@pytest.mark.parametrize("integer", [True, False])
def test_hungarian_equals_enumeration(integer):
    rng = np.random.default_rng(11 if integer else 12)
    for _ in range(400):
        P, G = random_sets(rng, integer=integer)
        for tau in TAUS + (1.0, 0.05):
            cnt, _ = match_brute(P, G, tau)
            assert len(match_segments(P, G, tau)) == cnt
        _, best = match_brute(P, G)
        got = match_segments(P, G)
        assert sum(x[2] for x in got) == pytest.approx(best, abs=1e-12)
        assert len({j for j, _, _ in got}) == len(got) == len({k for _, k, _ in got})
        # the per-sample EtF1 is the mean over taus of F1 from the enumerated counts
        want = np.mean([f1_from_tp(match_brute(P, G, t)[0], len(P), len(G)) for t in TAUS])
        assert etf1_sample(P, G) == pytest.approx(want, abs=1e-12)
        assert etf1_sample(P, G, soft=True) == pytest.approx(f1_from_tp(best, len(P), len(G)), abs=1e-12)


def test_known_wrong_variants_are_caught():
    # greedy loses a pair above tau
    P, G = [[0, 10], [4, 10]], [[0, 9], [0, 6]]
    M = tiou_matrix(P, G)
    assert greedy_tp(M, 0.5)[0] == 1 and len(match_segments(P, G, 0.5)) == 2
    assert etf1_sample(P, G, taus=(0.5,)) == 1.0
    # greedy's soft sum is below the optimum: the soft variant must use the optimum
    P2, G2 = [[47, 61], [5, 46]], [[18, 34], [17, 59]]
    M2 = tiou_matrix(P2, G2)
    assert greedy_tp(M2, 0.5)[1] == pytest.approx(29 / 54)
    assert etf1_sample(P2, G2, soft=True) == pytest.approx((12 / 44 + 16 / 41) / 2)
    # max-sum-then-threshold undercounts
    assert maxsum_then_threshold_tp(P2, G2, 0.5) == 0 and etf1_sample(P2, G2, taus=(0.5,)) == pytest.approx(0.5)
    # many-to-one credit: duplicates and one whole-video span
    dup, one = [[0, 10], [0, 10], [0, 10]], [[0, 10]]
    assert many_to_one_tp(tiou_matrix(dup, one), 0.5) == 3
    assert etf1_sample(dup, one) == pytest.approx(2 / 4)
    whole, many = [[0, 64]], [[0, 16], [16, 32], [32, 48], [48, 64]]
    assert etf1_sample(whole, many, taus=(0.25,)) == pytest.approx(2 / 5)   # one TP, never four
    # touching segments: no overlap
    assert tiou_closed((0, 1), (1, 2)) > 0
    assert tiou(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 2.0])).item() == 0.0
    assert etf1_sample([[0, 1], [1, 2]], [[1, 2], [2, 3]], taus=(0.3,)) == pytest.approx(0.5)


def test_hand_computed_benchmark_numbers():
    P = [[[2.0, 5.5], [11.0, 14.0]], [[0.0, 30.0]], [], [[0, 4]]]
    G = [[[2.5, 5.0], [10.5, 14.5], [20.0, 22.0]], [[3.0, 6.0], [18.0, 21.0]], [], []]
    # q0: tIoUs 2.5/3.5 = 0.714 and 3/4 = 0.75: TP = 2 at 0.3/0.5/0.7, F1 = 4/5; q1: 0.1 each, F1 = 0; q2: 1; q3: 0
    assert etf1_per_sample(P, G).tolist() == pytest.approx([0.8, 0.0, 1.0, 0.0])
    assert etf1(P, G) == pytest.approx(1.8 / 4)
    assert etf1(P, G, taus=(0.72,)) == pytest.approx((2 / 5 + 0 + 1 + 0) / 4)   # only 0.75 is above 0.72
    assert count_accuracy(P, G) == pytest.approx(1 / 4)
    soft0 = 2 * (2.5 / 3.5 + 0.75) / 5
    assert etf1_per_sample(P, G, soft=True).tolist() == pytest.approx([soft0, 2 * 0.1 / 3, 1.0, 0.0])  # one span: 0.1 once
    assert r1_at([[[0, 4], [9, 10]], [], [[1, 3]]], [[[0, 5]], [[0, 5]], [[0, 4]]], 0.5) == pytest.approx(2 / 3)


def test_tiou_broadcast_dtype_and_device():
    a = torch.tensor([[0.0, 4.0], [1.0, 3.0]])
    b = torch.tensor([[2.0, 6.0]])
    assert torch.allclose(tiou(a, b), torch.tensor([1 / 3, 1 / 5]))
    assert tiou(a.double(), b).dtype == torch.float64
    assert tiou(torch.tensor([0, 4]), torch.tensor([2, 6])).dtype == torch.float32   # ints promote to float
    if torch.cuda.is_available():
        assert tiou(a.cuda(), b.cuda()).device.type == "cuda"


@pytest.mark.parametrize("call, match", [
    (lambda: as_segments([[1, 1]], "P"), "P: expected start < end"),
    (lambda: as_segments([[0, np.inf]], "G"), "G: expected finite"),
    (lambda: as_segments([1, 2, 3], "P"), r"P: expected shape \[n, 2\]"),
    (lambda: etf1_sample([[0, 1]], [[0, 1]], taus=()), "taus"),
    (lambda: etf1_sample([[0, 1]], [[0, 1]], taus=(0.5, 0.0)), r"taus: expected a number in \(0, 1\]"),
    (lambda: etf1_sample([[0, 1]], [[0, 1]], taus=(float("nan"),)), "taus"),
    (lambda: match_segments([[0, 1]], [[0, 1]], tau=1.01), r"tau: expected a number in \(0, 1\]"),
    (lambda: etf1([], []), "P_list, G_list"),
    (lambda: count_accuracy([[[0, 1]]], [[], []]), "P_list, G_list"),
    (lambda: r1_at([[[0, 1]]], [[[0, 1], [2, 3]]]), "G_list: R1"),
    (lambda: tiou(torch.tensor([0.0, 1.0]), torch.tensor([[0.0, 1.0, 2.0]])), "a, b: expected"),
    (lambda: tiou(torch.tensor([2.0, 1.0]), torch.tensor([0.0, 1.0])), "a: expected start < end"),
    (lambda: match_brute(np.c_[np.arange(9), np.arange(9) + 1], [[0, 1]]), "at most 8"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ValueError, match=match):
        call()
    with pytest.raises(TypeError, match="P_list"):
        etf1("abc", [[]])


def test_rewards_hand_computed():
    assert temporal_reward([[0, 4]], [[2, 6]]) == pytest.approx(1 / 3 + 0.5)
    assert temporal_reward([[0, 4], [10, 12]], [[0, 4]]) == pytest.approx(2 / 3)
    assert length_reward([[i, i + 1] for i in range(0, 18, 2)]) == pytest.approx(-0.3)
    segs, bad = clean_segments(np.array([[1, 2], [np.nan, 3], [5, 4], [-2, 1], [63, 80]]), T=64)
    assert bad == 3 and segs.tolist() == [[1, 2], [63, 64]]
    toy = lambda texts: torch.tensor([[1.0, 0.0] if t.startswith("q") else [0.6, 0.8] for t in texts])
    caps = [(0, 4, "q-a"), (10, 14, "other"), (20, 24, "q-b")]
    # relevance: cos(other, query) = 0.6 >= 0.4 makes 'other' relevant too; at theta 0.7 it is not
    assert caption_reward([[0, 4], [20, 24]], caps, "q", toy, theta=0.7) == 1.0
    assert caption_reward([[0, 4], [20, 24]], caps, "q", toy, theta=0.4) == pytest.approx(2 * 1 * (2 / 3) / (1 + 2 / 3))
    parts = total_reward([[0, 4], [20, 24]], [[0, 4], [20, 24]], caps, "q", toy, T=64, theta=0.7)
    assert parts == pytest.approx(dict(r_temp=1.5, r_len=0.0, r_fmt=1.0, r_cap=1.0, reward=1.5 + 0.5 + 1.0))
    assert total_reward([[0, 4]], [[0, 4]], caps, "q", None, T=64)["reward"] == pytest.approx(2.5)


def test_reward_batch_equals_scalar_and_compiled_runs():
    from kimi_papers.evaluation.omtg import temporal_reward_batch_compiled
    rng = np.random.default_rng(5)
    Ps, Gs = zip(*[random_sets(rng, integer=False, span=60) for _ in range(300)])
    pp, pm = pad_segments(Ps, 6, torch.float64)
    gp, gm = pad_segments(Gs, 6, torch.float64)
    perms = permutations_table(6)
    want = torch.tensor([temporal_reward(p, g) for p, g in zip(Ps, Gs)], dtype=torch.float64)
    assert torch.allclose(temporal_reward_batch(pp, pm, gp, gm, perms), want, atol=1e-12, rtol=0)
    got = temporal_reward_batch_compiled(pp[:64], pm[:64], gp[:64], gm[:64], perms)
    assert torch.allclose(got, want[:64], atol=1e-9, rtol=0)
    # K = 3 tables give the same on rows with at most 3 segments
    small = [i for i in range(300) if len(Ps[i]) <= 3 and len(Gs[i]) <= 3]
    p3, m3 = pad_segments([Ps[i] for i in small], 3, torch.float64)
    g3, n3 = pad_segments([Gs[i] for i in small], 3, torch.float64)
    assert torch.allclose(temporal_reward_batch(p3, m3, g3, n3, permutations_table(3)), want[small], atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def synth():
    from kimi_papers.evaluation.omtg_experiment import BACKGROUND, EVENTS, SynthVideo
    g = torch.Generator().manual_seed(0)
    texts = [BACKGROUND] + [t for e in EVENTS for t in e[1] + e[2]]
    vecs = {t: torch.nn.functional.normalize(torch.randn(384, generator=g), dim=0) for t in texts}  # no MiniLM needed
    return SynthVideo(seed=0, vectors=vecs)


def test_synthvideo_structure_and_determinism(synth):
    from kimi_papers.evaluation.omtg_experiment import EVENTS
    a, b = synth.sample(400, seed=1), synth.sample(400, seed=1)
    assert all(torch.equal(x.feats, y.feats) and np.array_equal(x.gt, y.gt) for x, y in zip(a, b))
    counts = np.array([s.count for s in a])
    assert counts.max() <= 5 and 0.5 < np.mean(counts >= 2) < 0.7 and np.mean(counts == 0) < 0.12
    for s in a:
        assert [tuple(g) for g in s.gt] == [(c[0], c[1]) for c in s.captions if c[2] in EVENTS[s.event][2]]
        assert s.query in EVENTS[s.event][1]
    with pytest.raises(ValueError, match="proj_scale"):
        type(synth)(vectors=synth.vectors, proj_scale="half")


def test_tags_policy_and_training_steps(synth):
    from kimi_papers.evaluation.omtg_experiment import (
        evaluate_predictions, grpo_finetune, new_policy, omtg_reward_fn, predict, segments_to_tags, sft_targets,
        tags_to_segments, train_sft, tune_lr)
    data = synth.sample(64, seed=2)
    for s in data:
        assert np.array_equal(tags_to_segments(segments_to_tags(s.gt, 64)[None])[0], s.gt)
    longest = sft_targets(data, "longest")
    assert all(len(tags_to_segments(longest[i:i + 1])[0]) == min(1, s.count) for i, s in enumerate(data))
    pol = new_policy(0, 64)
    losses = train_sft(pol, data, "all", steps=30, lr=3e-3)
    assert losses[-1] < losses[0]
    before = [p.detach().clone() for p in pol.parameters()]
    hist = grpo_finetune(pol, data, omtg_reward_fn(synth, use_cap=False), steps=2, prompts=2, group=4, lr=1e-3)
    assert len(hist) == 2 and np.isfinite(hist.loss).all()
    assert any(not torch.equal(a, b) for a, b in zip(before, pol.parameters()))
    res = evaluate_predictions(predict(pol, data), data)
    assert 0 <= res["etf1"] <= 1 and 0 <= res["c_acc"] <= 1
    oracle = evaluate_predictions([s.gt for s in data], data)
    assert oracle["etf1"] == oracle["c_acc"] == 1.0
    # the lr grid is extended once at an edge, never past `extend`
    best, table = tune_lr(lambda lr: -abs(np.log10(lr) + 5), [1e-3, 1e-2], extend=1)
    assert best == pytest.approx(1e-4) and len(table) == 3
    best, table = tune_lr(lambda lr: 0.0, [3e-3], extend=0)
    assert best == 3e-3 and len(table) == 1
