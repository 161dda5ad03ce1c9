"""kimi_papers.rl.spatial_consistency: the spatial questions and their transformations (involutions that carry the
true answer), the answer parser, the batched verifier against a Python loop, OT-GRPO rewards against the closed forms
(Hungarian on 10^4 random groups) and a linear-programming reference for unbalanced groups, the baselines' rewards,
the Trainer hook (no label reaches the label-free arms), the noisy-label fixture, and bad input."""
import dataclasses

import numpy as np
import pytest
import torch
from scipy.optimize import linprog

from kimi_papers.core.rl import RolloutBatch, get_advantage
from kimi_papers.rl import spatial_consistency as S
from kimi_papers.rl import spatial_consistency_experiment as SE


def _item(a=(5, 0), b=(4, 0), qtype="lr"):
    return SE.make_item((("a", *a), ("b", *b)), qtype, ("a", "b"))


# ---- scenes, transformations, parsing
def test_items_and_transforms():
    it = SE.make_item((("a", 2, 7), ("b", 5, 3), ("c", 9, 1)), "lr", ("b", "a"))
    assert it.prompt == "b53 a27 c91 lr b a:" and it.answer == "right" and it.dx == 3
    assert SE.HFLIP(it).answer == "left" and SE.SWAP(it).answer == "left" and SE.VFLIP(it).answer == "right"
    assert SE.make_item((("a", 2, 7), ("b", 5, 3)), "ab", ("a", "b")).answer == "above"
    assert SE.make_item((("a", 0, 0), ("b", 1, 1), ("c", 3, 0)), "nr", ("a", "b", "c")).answer == "b"
    for t in (*SE.TRANSFORMS.values(), SE.compose(SE.HFLIP, SE.SWAP), SE.compose(SE.SWAP, SE.VFLIP)):
        SE.check_involution(t, n=200)
    # HFLIP o SWAP leaves a left/right answer unchanged: it would reward an always-'left' bias (why we train on HFLIP)
    assert SE.compose(SE.HFLIP, SE.SWAP).tau("left") == "left"
    gen = SE.SpatialGen(qtypes=SE.QTYPES, seed=5)
    items = gen.sample(300)
    assert all(SE.true_answer(i.scene, i.qtype, i.query) == i.answer for i in items)
    assert [i.prompt for i in SE.SpatialGen(qtypes=SE.QTYPES, seed=5).sample(300)] == [i.prompt for i in items]


def test_transform_checks_fail_on_broken_transforms():
    with pytest.raises(ValueError, match="tau is not an involution"):
        SE.check_involution(SE.Transform("cyc", SE.HFLIP.fn, {"left": "right", "right": "above", "above": "left"}))
    with pytest.raises(ValueError, match="tau\\(answer"):
        SE.check_involution(SE.Transform("hflip_no_tau", SE.HFLIP.fn, {}))
    shift = SE.Transform("shift", lambda it: SE.make_item(tuple((n, (x + 1) % 10, y) for n, x, y in it.scene), it.qtype,
                                                        it.query), {})
    with pytest.raises(ValueError, match="T is not an involution"):
        SE.check_involution(shift)
    with pytest.raises(TypeError, match="Item"):
        SE.HFLIP.apply("a27 b53 lr a b:")


def test_parse_answer():
    v = ("left", "right")
    assert S.parse_answer("left", v) == "left" and S.parse_answer("Answer: right", v) == "right"
    assert S.parse_answer("Left, I think. Answer: right.", v) == "right"
    assert S.parse_answer("lef", v) is None and S.parse_answer("leftright", v) is None
    assert S.parse_answer("b", ("b", "c")) == "b"
    with pytest.raises(ValueError, match="vocab"):
        S.parse_answer("left", [])
    with pytest.raises(TypeError, match="text"):
        S.parse_answer(3, v)


@pytest.mark.parametrize("bad, match", [
    (dict(scene=(("a", 2, 7), ("b", 2, 3)), qtype="lr", query=("a", "b")), "no unique answer"),
    (dict(scene=(("a", 2, 7), ("b", 5, 3)), qtype="lr", query=("a", "a")), "query"),
    (dict(scene=(("a", 2, 7), ("b", 5, 3)), qtype="nr", query=("a", "b")), "query"),
    (dict(scene=(("a", 2, 17), ("b", 5, 3)), qtype="lr", query=("a", "b")), "coordinates"),
    (dict(scene=(("a", 2, 7), ("b", 5, 3)), qtype="diag", query=("a", "b")), "qtype"),
])
def test_make_item_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        SE.make_item(**bad)


# ---- the verifier tensor
def test_consistency_matrix_against_loop_and_hand_case():
    rng = np.random.default_rng(0)
    aq, at = (torch.tensor(rng.integers(-1, len(SE.ANSWERS), (40, 7))) for _ in range(2))
    for t in SE.TRANSFORMS.values():
        assert torch.equal(S.consistency_matrix(aq, at, t.tau_index()), S.consistency_matrix_loop(aq, at, t.tau_index()))
    V = S.consistency_matrix(torch.tensor([[0, 0, 1, -1]]), torch.tensor([[1, 0, -1, 1]]), SE.HFLIP.tau_index())
    assert V[0].tolist() == [[1, 0, 0, 1], [1, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert S.consistency_matrix(aq, at[:, :5], SE.HFLIP.tau_index(), allow_unbalanced=True).shape == (40, 7, 5)


def test_consistency_matrix_bad_input():
    z, tau = torch.zeros(2, 4, dtype=torch.long), SE.HFLIP.tau_index()
    with pytest.raises(ValueError, match="different sizes"):
        S.consistency_matrix(z, z[:, :3], tau)
    with pytest.raises(ValueError, match="involutive permutation"):
        S.consistency_matrix(z, z, torch.roll(torch.arange(len(SE.ANSWERS)), 1))
    with pytest.raises(ValueError, match="integer tensor"):
        S.consistency_matrix(z.float(), z, tau)
    with pytest.raises(ValueError, match=r"\[-1"):
        S.consistency_matrix(z + 99, z, tau)
    with pytest.raises(ValueError, match="same number of pairs"):
        S.consistency_matrix(z, z[:1], tau)


# ---- OT matching
def test_ot_totals_match_closed_forms_on_10k_groups():
    rng, tau, n_groups = np.random.default_rng(7), SE.HFLIP.tau_index(), 0
    for G in range(1, 17):
        n = 640
        aq, at = torch.tensor(rng.integers(0, 2, (n, G))), torch.tensor(rng.integers(0, 2, (n, G)))
        C = S.consistency_matrix(aq, at, tau)
        A, B = (aq == 0).sum(-1), (at == 1).sum(-1)          # u = left; tau(u) = right
        want_min = torch.tensor([S.ot_min_binary_closed_form(int(a), int(b), G) for a, b in zip(A, B)])
        want_max = torch.tensor([S.ot_max_binary_closed_form(int(a), int(b), G) for a, b in zip(A, B)])
        mn, mx = S.binary_matching_totals(aq, at, tau)
        assert torch.equal(mn, want_min) and torch.equal(mx, want_max)
        for d, want in (("min", want_min), ("max", want_max)):
            rq, rt = S.ot_pair_rewards(C, d, seed=G)
            assert torch.equal(rq.sum(-1).round().long(), want) and torch.equal(rt.sum(-1).round().long(), want)
            assert ((rq == 0) | (rq == 1)).all()
        n_groups += n
    assert n_groups >= 10_000


def test_ot_hand_cases_hedging_and_ties():
    tau = SE.HFLIP.tau_index()
    C = S.consistency_matrix(torch.tensor([[0, 0, 0, 1]]), torch.tensor([[1, 1, 0, 0]]), tau)
    assert S.ot_pair_rewards(C, "min")[0].sum() == 1 and S.ot_pair_rewards(C, "max")[0].sum() == 3
    # the only consistent pair of the minimal matching is a q-'left' with a T(q)-'right' (the joint majority)
    rq, rt = S.ot_pair_rewards(C, "min", seed=3)
    assert rq[0, :3].sum() == 1 and rq[0, 3] == 0 and rt[0, :2].sum() == 1 and rt[0, 2:].sum() == 0
    hedge = S.consistency_matrix(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 0, 1, 1]]), tau)
    assert S.ot_pair_rewards(hedge, "min")[0].sum() == 0 and S.ot_pair_rewards(hedge, "max")[0].sum() == 4
    assert torch.equal(S.allpairs_rewards(hedge)[0], torch.full((1, 4), 0.5))
    # ties: the same seed gives the same rewards; the total never depends on the seed
    r = [S.ot_pair_rewards(C, "max", seed=s)[0] for s in range(20)]
    assert torch.equal(r[0], S.ot_pair_rewards(C, "max", seed=0)[0]) and len({float(x.sum()) for x in r}) == 1
    assert len({tuple(x[0].tolist()) for x in r}) > 1      # several optimal matchings exist and the seed picks one


def test_unbalanced_plan_equals_linear_program():
    rng = np.random.default_rng(3)
    for G, H in ((2, 3), (4, 6), (3, 5)):
        V = torch.tensor(rng.integers(0, 2, (G, H)), dtype=torch.float32)
        for d in ("min", "max"):
            rq, rt, plan = S.ot_pair_rewards(V, d, allow_unbalanced=True, return_plan=True)
            assert torch.allclose(plan.sum(1), torch.full((G,), 1 / G)) and torch.allclose(plan.sum(0), torch.full((H,), 1 / H))
            A_eq = np.vstack([np.kron(np.eye(G), np.ones(H)), np.kron(np.ones(G), np.eye(H))])
            b_eq = np.concatenate([np.full(G, 1 / G), np.full(H, 1 / H)])
            lp = linprog(V.numpy().ravel() * (1 if d == "min" else -1), A_eq=A_eq, b_eq=b_eq, bounds=(0, None))
            assert float((plan * V).sum()) == pytest.approx(abs(lp.fun), abs=1e-6)
            assert float(rq.mean()) == pytest.approx(float((plan * V).sum()), abs=1e-6)
    with pytest.raises(ValueError, match="different sizes"):
        S.ot_pair_rewards(torch.zeros(2, 3))


def test_ot_bad_input():
    with pytest.raises(ValueError, match="direction"):
        S.ot_pair_rewards(torch.zeros(1, 2, 2), "mean")
    with pytest.raises(ValueError, match="finite"):
        S.ot_pair_rewards(torch.full((1, 2, 2), float("nan")))
    with pytest.raises(ValueError, match="count"):
        S.ot_min_binary_closed_form(5, 1, 4)
    with pytest.raises(ValueError, match="binary answers"):
        S.binary_matching_totals(torch.tensor([[0, 2]]), torch.tensor([[1, 1]]), SE.HFLIP.tau_index())
    with pytest.raises(ValueError, match="no -1"):
        S.binary_matching_totals(torch.tensor([[0, -1]]), torch.tensor([[1, 1]]), SE.HFLIP.tau_index())


# ---- advantages and the baselines' rewards
def test_paired_advantages_equal_core_grpo():
    g = torch.Generator().manual_seed(0)
    rq, rt = torch.rand(3, 4, generator=g), torch.rand(3, 4, generator=g)
    aq, at = S.paired_grpo_advantages(rq, rt)
    rows = torch.cat([torch.stack([a, b]) for a, b in zip(rq, rt)]).flatten()
    batch = RolloutBatch(input_ids=torch.ones(24, 2, dtype=torch.long), attn_mask=torch.ones(24, 2, dtype=torch.long),
                         resp_mask=torch.tensor([[0, 1]] * 24), reward=rows, uid=torch.arange(6).repeat_interleave(4))
    want = torch.cat([torch.stack([a, b]) for a, b in zip(aq, at)]).flatten()
    assert torch.allclose(get_advantage("grpo")(batch)[:, 1], want, atol=1e-6)
    assert torch.allclose(aq.mean(-1), torch.zeros(3), atol=1e-6) and torch.allclose(aq.std(-1), torch.ones(3), atol=1e-4)
    assert (S.paired_grpo_advantages(torch.ones(2, 1), torch.zeros(2, 1))[0] == 0).all()     # G = 1
    assert (S.paired_grpo_advantages(torch.ones(2, 4), torch.ones(2, 4))[1] == 0).all()      # all equal
    with pytest.raises(ValueError, match="non-finite"):
        S.paired_grpo_advantages(torch.tensor([[1.0, float("inf")]]), torch.zeros(1, 2))


def test_majority_rewards_ties_and_failures():
    out = S.majority_rewards(torch.tensor([[0, 0, 1, -1], [0, 1, 1, 0], [-1, -1, -1, -1], [2, 2, 2, 5]]))
    assert out.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]]


def _fake_batch(items, texts):
    n = len(texts)
    return RolloutBatch(input_ids=torch.ones(n, 2, dtype=torch.long), attn_mask=torch.ones(n, 2, dtype=torch.long),
                        resp_mask=torch.tensor([[0, 1]] * n), reward=torch.zeros(n),
                        uid=torch.tensor([0] * 4 + [1] * 4), pair_id=torch.zeros(n, dtype=torch.long),
                        role=torch.tensor([0] * 4 + [1] * 4), text=list(texts), problems=list(items))


def test_hook_rewards_and_no_label_leak():
    q = _item()
    items, texts = [q] * 4 + [SE.HFLIP(q)] * 4, ["left", "left", "right", "x", "right", "left", "left", "right"]
    out = {a: SE.ConsistencyReward(a, SE.HFLIP)(_fake_batch(items, texts)).reward for a in SE.ARMS}
    assert out["gt"].tolist() == [0, 0, 1, 0, 0, 1, 1, 0]
    assert out["majority"].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]
    assert out["ot_min"].sum() == 0 and out["ot_max"][:4].sum() == 3 and out["ot_max"][4:].sum() == 3
    # the rows are found through pair_id/role, not their order: a shuffled batch gets the same rewards per row
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    shuf = _fake_batch([items[i] for i in perm], [texts[i] for i in perm])
    shuf = dataclasses.replace(shuf, uid=_fake_batch(items, texts).uid[perm], role=_fake_batch(items, texts).role[perm])
    assert torch.equal(SE.ConsistencyReward("allpairs", SE.HFLIP)(shuf).reward, out["allpairs"][perm])
    # a label-free arm never reads the true answer: corrupting every label leaves its rewards unchanged
    wrong = [dataclasses.replace(it, answer="below") for it in items]
    for arm in ("ot_min", "ot_max", "allpairs", "majority"):
        assert torch.equal(SE.ConsistencyReward(arm, SE.HFLIP, seed=0)(_fake_batch(wrong, texts)).reward, out[arm])
    with pytest.raises(ValueError, match="arm"):
        SE.ConsistencyReward("ot_mean", SE.HFLIP)
    with pytest.raises(TypeError, match="Transform"):
        SE.ConsistencyReward("ot_min", "hflip")
    with pytest.raises(ValueError, match="paired groups"):
        SE.ConsistencyReward("ot_min", SE.HFLIP)(dataclasses.replace(_fake_batch(items, texts), role=None))


def test_run_config_bad_input():
    for kw, match in ((dict(arm="ppo"), "arm"), (dict(arm="ot_min", transform="rotate"), "transform"),
                      (dict(arm="ot_min", seeds=(1, 1)), "seeds"), (dict(arm="ot_min", steps=0), "steps"),
                      (dict(arm="ot_min", lr=-1.0), "lr")):
        with pytest.raises(ValueError, match=match):
            SE.RunConfig(**kw)
    with pytest.raises(ValueError, match="n_obj"):
        SE.SpatialGen(n_obj=(1, 2))


# ---- the noisy-label fixture and a short run
def test_label_noise_frequencies():
    import random
    noise, rng = SE.LabelNoise(), random.Random(0)
    near_r, far_r = _item((5, 0), (4, 0)), _item((9, 0), (1, 0))
    freq = lambda it: np.mean([noise.label(it, rng) == "left" for _ in range(5000)])
    assert abs(freq(near_r) - 0.6) < 0.03 and abs(freq(SE.HFLIP(near_r)) - 0.9) < 0.03 and abs(freq(far_r) - 0.3) < 0.03


def test_fixture_loads_and_is_noisy_but_skilled():
    assert SE.fixture_file().is_file() and SE.fixture_file().stat().st_size < 2 * 2**20
    policy, info = SE.tiny_spatial_policy()
    assert info["source"] == "tiny_sft.pt"
    items = SE.SpatialTask(("lr",)).heldout(160)
    ans = SE.sample_answers(policy, items, samples=2, seed=0)
    ok = ans == torch.tensor([SE.ANSWERS.index(i.answer) for i in items])[:, None]
    near_right = torch.tensor([abs(i.dx) <= 2 and i.answer == "right" for i in items])
    assert 0.5 < float(ok.float().mean()) < 0.8 and float((ans < 0).float().mean()) < 0.05   # right-majority but unsure
    assert float(ok[near_right].float().mean()) < 0.5                                         # wrong-majority where the bias lives
    assert torch.equal(ans[:16], SE.sample_answers(policy, items[:16], samples=2, seed=0))


@pytest.mark.slow
def test_short_run_is_deterministic():
    policy, _ = SE.tiny_spatial_policy()
    ev = SE.EvalSet.build(16)
    cfg = SE.RunConfig(arm="ot_min", seeds=(0,), steps=2, prompts_per_step=4, group_size=4, eval_n=16, eval_samples=2)
    a, b = SE.run_consistency_rl(cfg, policy, ev), SE.run_consistency_rl(cfg, policy, ev)
    pd_cols = ["reward", "batch_consistency", "acc"]
    assert a[pd_cols].fillna(-1).equals(b[pd_cols].fillna(-1)) and len(a[a.phase == "train"]) == 2


@pytest.mark.slow
def test_compiled_kernels_equal_eager():
    rng = np.random.default_rng(2)
    aq, at = (torch.tensor(rng.integers(-1, len(SE.ANSWERS), (64, 8))) for _ in range(2))
    tau = SE.SWAP.tau_index()
    assert torch.equal(S.consistency_matrix(aq, at, tau, compiled=True), S.consistency_matrix(aq, at, tau))
    bq, bt = (torch.tensor(rng.integers(0, 2, (64, 8))) for _ in range(2))
    for x, y in zip(S.binary_matching_totals(bq, bt, SE.HFLIP.tau_index(), compiled=True),
                    S.binary_matching_totals(bq, bt, SE.HFLIP.tau_index())):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_agnostic():
    cu = torch.device("cuda")
    rng = np.random.default_rng(0)
    aq, at = (torch.tensor(rng.integers(-1, len(SE.ANSWERS), (8, 6))) for _ in range(2))
    C = S.consistency_matrix(aq.to(cu), at.to(cu), SE.SWAP.tau_index(cu))
    assert C.device.type == "cuda" and torch.equal(C.cpu(), S.consistency_matrix(aq, at, SE.SWAP.tau_index()))
    assert S.ot_pair_rewards(C)[0].device.type == "cuda" and S.majority_rewards(aq.to(cu)).device.type == "cuda"
