"""kimi_papers.rl.rlrr: the rank-to-reward identities, the sign-preserving clip, the compiled grouped kernel and the
Plackett-Luce loss against references, the listwise judge, and RLRR's reward inside TRL's GRPOTrainer (two real
steps on a tiny random Llama, offline): the rewards TRL trains on equal the core's on the same batch, and so do
TRL's advantages of them."""
import importlib.util
import itertools
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kimi_papers.core.rl import (ArithmeticTask, Problem, RolloutBatch, TRL_GRPO_EPS, get_advantage,  # noqa: E402
                                 group_rewards)
from kimi_papers.rl import rlrr as R  # noqa: E402
from kimi_papers.rl import rlrr_experiment as RE  # noqa: E402

HAVE_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="TRL is an optional extra: pip install 'kimi_papers[trl]'")


# ---- the rank -> reward identities (hand-computed, G = 4, tau = 0.1)
def test_mappings_hand_values():
    ranks, rule = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 1, 0])
    sup = R.rank_to_reward(ranks, rule, "supplement", 0.1)
    want = [1 + 0.1 * math.tanh(3), 0.1 * math.tanh(1), 1 + 0.1 * math.tanh(1 / 3), 0.0]
    assert torch.allclose(sup, torch.tensor(want, dtype=torch.float64), atol=1e-15)
    w = R.rank_to_reward(ranks, rule, "weight", 0.1)
    assert torch.allclose(w, torch.tensor([1.0, 0.0, math.exp(-0.2), 0.0], dtype=torch.float64), atol=1e-15)
    assert R.rank_to_reward(torch.tensor([3, 1, 4, 2]), None, "reward").tolist() == [1 / 3, 1.0, 0.0, 2 / 3]
    # the weight mapping leaves an all-wrong group at zero (expected: no signal there); supplement grades it
    assert R.rank_to_reward(ranks, torch.zeros(4), "weight").abs().max() == 0
    assert R.rank_to_reward(ranks, torch.zeros(4), "supplement").unique().numel() == 4
    # batched [B, G] equals row by row; average ranks for ties
    rb = torch.stack([torch.tensor([2, 1, 4, 3]), ranks])
    sb = torch.stack([rule, 1 - rule])
    assert torch.equal(R.rank_to_reward(rb, sb), torch.stack([R.rank_to_reward(rb[i], sb[i]) for i in range(2)]))
    tied = R.rank_to_reward(torch.tensor([1.5, 1.5, 3.0, 4.0]), None, "reward", ties="average")
    assert torch.allclose(tied, torch.tensor([5 / 6, 5 / 6, 1 / 3, 0.0], dtype=torch.float64))


def test_mapping_bad_inputs():
    with pytest.raises(ValueError, match="G >= 2"):
        R.rank_to_reward(torch.tensor([1]), None, "reward")
    with pytest.raises(ValueError, match="permutation"):
        R.rank_to_reward(torch.tensor([1, 1, 3, 4]), torch.zeros(4))
    with pytest.raises(ValueError, match="average ranks"):
        R.rank_to_reward(torch.tensor([1.0, 1.0, 3.0, 4.0]), None, "reward", ties="average")
    with pytest.raises(ValueError, match="mapping"):
        R.rank_to_reward(torch.tensor([1, 2]), torch.zeros(2), "linear")
    with pytest.raises(ValueError, match="s_rule"):
        R.rank_to_reward(torch.tensor([1, 2]), None, "supplement")
    with pytest.raises(ValueError, match="s_rule: expected shape"):
        R.rank_to_reward(torch.tensor([1, 2]), torch.zeros(3))
    with pytest.raises(ValueError, match="binary"):
        R.rank_to_reward(torch.tensor([1, 2]), torch.tensor([0.5, 1.0]))
    with pytest.raises(ValueError, match="tau"):
        R.rank_to_reward(torch.tensor([1, 2]), torch.zeros(2), tau=-1.0)


# ---- advantages and the clip
def test_advantages_hand_case_and_reference():
    s = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)
    rule = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0])
    uid = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    sd1, sd2 = math.sqrt(0.25), math.sqrt(0.05 / 3)  # unbiased stds of the two groups
    raw = R.rlrr_advantages(s, None, uid)
    assert torch.allclose(raw, torch.tensor([0.75 / sd1, -0.25 / sd1, -0.25 / sd1, -0.25 / sd1,
                                             0.15 / sd2, 0.05 / sd2, -0.05 / sd2, -0.15 / sd2], dtype=torch.float64))
    clipped = R.rlrr_advantages(s, rule, uid)
    assert clipped[4] == 0 and clipped[5] == 0 and torch.equal(clipped[6:], raw[6:]) and torch.equal(clipped[:4], raw[:4])
    assert R.sign_violation_rate(raw, rule) == 0.25 and R.sign_violation_rate(clipped, rule) == 0.0
    assert R.live_group_ratio(clipped, uid) == 1.0
    dr = R.rlrr_advantages(s, None, uid, norm="none")
    assert torch.allclose(dr[:4], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64))
    g = torch.Generator().manual_seed(0)
    s2, r2 = torch.rand(40, generator=g, dtype=torch.float64), torch.randint(0, 2, (40,), generator=g)
    u2 = torch.randint(0, 7, (40,), generator=g)
    for norm, xn, xp in [("std", 0.0, 0.0), ("none", -0.3, 0.2), ("std", -math.inf, math.inf)]:
        ref = R.rlrr_advantages_reference(s2.tolist(), r2.tolist(), u2.tolist(), norm, xn, xp)
        assert torch.allclose(R.rlrr_advantages(s2, r2, u2, norm, xn, xp), torch.tensor(ref, dtype=torch.float64), atol=1e-12)


def test_flat_groups_fall_back_to_unit_scale():
    # a constant float group has std ~1e-17, not 0: without the tolerance its advantages would come out as +-1
    a = R.rlrr_advantages(torch.full((4,), 0.1, dtype=torch.float64), None, torch.zeros(4, dtype=torch.long))
    assert torch.equal(a, torch.zeros(4, dtype=torch.float64))
    u = torch.tensor([0, 0, 1, 1])
    a = R.rlrr_advantages(R.rank_to_reward(torch.tensor([[1, 2], [2, 1]]), torch.zeros(2, 2), "weight").flatten(),
                          torch.zeros(4), u)
    assert torch.equal(a, torch.zeros(4, dtype=torch.float64)) and R.live_group_ratio(a, u) == 0.0
    with pytest.raises(ValueError, match="uid: expected shape"):
        R.rlrr_advantages(torch.zeros(4), None, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="non-finite"):
        R.rlrr_advantages(torch.tensor([0.0, math.nan]), None, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="norm"):
        R.rlrr_advantages(torch.zeros(2), None, torch.zeros(2, dtype=torch.long), norm="batch")


def test_grouped_kernel_matches_eager_and_loop():
    g = torch.Generator().manual_seed(1)
    B, G, T = 6, 5, 7
    ranks = torch.stack([torch.randperm(G, generator=g) + 1 for _ in range(B)])
    rule = torch.randint(0, 2, (B, G), generator=g)
    rule[0] = 0  # an all-wrong group
    mask = (torch.rand(B * G, T, generator=g) > 0.3).long()
    uid = torch.arange(B).repeat_interleave(G)
    for mapping in R.MAPPINGS:
        rr = None if mapping == "reward" else rule
        got = R.rlrr_token_advantages(ranks, rr, mask, mapping, 0.2)
        s = R.rank_to_reward(ranks, rr, mapping, 0.2).flatten()
        ref = R.rlrr_advantages_reference(s.tolist(), None if rr is None else rr.flatten().tolist(), uid.tolist())
        want = torch.tensor(ref)[:, None] * mask
        assert (got - want).abs().max() < 1e-6, mapping
    with pytest.raises(ValueError, match="mask"):
        R.rlrr_token_advantages(ranks, rule, mask[:-1])


@pytest.mark.slow
def test_grouped_kernel_compiled():
    from kimi_papers.core.kernels import compiled_ran
    ranks = torch.stack([torch.randperm(4) + 1 for _ in range(8)])
    rule, mask = torch.randint(0, 2, (8, 4)), torch.ones(32, 3)
    got = R.rlrr_token_advantages(ranks, rule, mask, compiled=True)
    assert compiled_ran(R._grouped_compiled)
    assert (got - R.rlrr_token_advantages(ranks, rule, mask)).abs().max() < 1e-6


# ---- Plackett-Luce
@pytest.mark.parametrize("G", [2, 3, 4, 5])
def test_plackett_luce_equals_brute_force(G):
    g = torch.Generator().manual_seed(G)
    scores = torch.randn(3, G, generator=g, dtype=torch.float64) * 2
    perms = [list(p) for p in itertools.permutations(range(G))]
    for b in range(3):
        nll = R.plackett_luce_loss(scores[b:b + 1].expand(len(perms), G), torch.tensor(perms))
        ref = torch.tensor([-R.plackett_luce_reference(scores[b].tolist(), p) for p in perms], dtype=torch.float64)
        assert torch.allclose(nll, ref, atol=1e-12)
        assert abs(float(torch.exp(-nll).sum()) - 1.0) < 1e-12  # a distribution over the G! orderings
    assert torch.equal(R.ranks_to_order(torch.tensor([3, 1, 2])), torch.tensor([1, 2, 0]))
    with pytest.raises(ValueError, match="order"):
        R.plackett_luce_loss(scores, torch.zeros(3, G, dtype=torch.long))


def test_pl_ranker_learns_a_linear_order():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(32, 4, 3, generator=g)
    order = (feats @ torch.tensor([1.0, -2.0, 0.5])).argsort(-1, descending=True)
    ranker, losses = RE.fit_pl_ranker(feats, order, steps=100, seed=0)
    assert losses[-1] < 0.5 * losses[0]
    agree = (ranker.rank(feats) == order.argsort(-1) + 1).all(-1).double().mean()
    assert agree > 0.7, agree


# ---- the judge
def test_judge_order_noise_and_determinism():
    p = Problem("12+30=", "42", "42")
    j = RE.arith_judge(seed=0)
    assert j.rank(["42", "41", "x", "142"], p).tolist() == [1, 2, 4, 3]
    assert j.rank(["42", "42", "40", "-"], p)[2:].tolist() == [3, 4]   # exact ties broken at random, invalid last
    nan_judge = R.ListwiseJudge(lambda t, _: [1.0, math.nan, 0.5], seed=0)
    assert nan_judge.rank(["a", "b", "c"], p).tolist() == [1, 3, 2]      # NaN scores rank last
    short = R.ListwiseJudge(lambda t, _: [0.0, 0.0], seed=0)
    assert short.rank(["long", "s"], p).tolist() == [2, 1]               # equal scores: shorter first
    noisy = RE.arith_judge(noise=1.0, seed=0)                              # every adjacent pair swapped in turn
    assert noisy.order(["42", "41", "40", "30"], p) == [1, 2, 3, 0]
    texts = ["7", "8", "9", "40"]
    assert torch.equal(RE.arith_judge(0.3, 5).rank(texts, p), RE.arith_judge(0.3, 5).rank(texts, p))
    with pytest.raises(ValueError, match="G >= 2"):
        j.rank(["42"], p)
    with pytest.raises(ValueError, match="noise"):
        RE.arith_judge(noise=1.5)
    with pytest.raises(ValueError, match="score_fn: expected 3"):
        R.ListwiseJudge(lambda t, _: [1.0]).rank(["a", "b", "c"], p)


def test_noisy_rm_and_close_task():
    task = RE.CloseIntegerTask()
    p = Problem("60+40=", "100", "100")
    assert task.quality(p, "100") == 1.0 and task.quality(p, "101") == pytest.approx(math.exp(-0.1)) and task.quality(p, "99") == 0.0
    assert task.quality(p, "1000") == 0.0 and task.quality(p, "abc") == 0.0
    clean = RE.NoisyScalarRM(task.quality, seed=3, noise="none")
    a, b = clean.prompt_params(p.prompt)
    assert clean.scores(["100", "101"], p) == pytest.approx([a * math.exp(b), a * math.exp(b * math.exp(-0.1))])
    t, gs = RE.NoisyScalarRM(task.quality, seed=0, noise="t"), RE.NoisyScalarRM(task.quality, seed=0, noise="gauss")
    et, eg = t._eps(200_000), gs._eps(200_000)
    import numpy as np
    assert abs(np.median(np.abs(et)) / np.median(np.abs(eg)) - 1) < 0.02  # same median |noise|
    assert np.abs(et).max() > 5 * np.abs(eg).max()                       # t_2 has the heavy tail
    with pytest.raises(ValueError, match="noise"):
        RE.NoisyScalarRM(task.quality, noise="cauchy")


def test_registered_advantage_and_group_reward():
    task = ArithmeticTask(digits=2)
    fn = R.rlrr_group_reward(RE.arith_judge(seed=0), task, "supplement", 0.1)
    probs = [Problem("1+2=", "3", "3")] * 4 + [Problem("5+5=", "10", "10")] * 4
    texts = ["3", "4", "x", "30", "1", "2", "11", "9"]
    uid = torch.arange(2).repeat_interleave(4)
    r = group_rewards(fn, probs, texts, uid)
    assert r[0] == pytest.approx(1 + 0.1 * math.tanh(3)) and (r[4:] < 0.1).all()
    batch = RolloutBatch(input_ids=torch.ones(8, 3, dtype=torch.long), attn_mask=torch.ones(8, 3, dtype=torch.long),
                         resp_mask=torch.tensor([[0, 1, 1]] * 8), reward=r, uid=uid,
                         correct=torch.tensor([True] + [False] * 7))
    adv = get_advantage("rlrr")(batch)
    want = R.rlrr_advantages(r.double(), batch.correct, uid).float()
    assert torch.equal(adv[:, 1], want) and (adv[:, 0] == 0).all()
    assert R.sign_violation_rate(adv[:, 1], batch.correct) == 0.0
    with pytest.raises(ValueError, match="correct"):
        get_advantage("rlrr")(RolloutBatch(input_ids=batch.input_ids, attn_mask=batch.attn_mask,
                                           resp_mask=batch.resp_mask, reward=r, uid=uid))
    with pytest.raises(ValueError, match="arm"):
        RE.RunConfig(arm="ppo")
    with pytest.raises(ValueError, match="group_size"):
        RE.RunConfig(arm="rlrr_supplement", group_size=1)


def test_trl_reward_layout_errors():
    task = ArithmeticTask(digits=2)
    fn = R.rlrr_trl_reward(RE.arith_judge(), task, num_generations=2)
    assert fn(["1+2=", "1+2="], ["3", "4"], answer=["3", "3"]) == pytest.approx([1 + 0.1 * math.tanh(1), 0.0])
    with pytest.raises(ValueError, match="one prompt's group"):
        fn(["1+2=", "2+2="], ["3", "4"], answer=["3", "4"])
    with pytest.raises(ValueError, match="multiple of num_generations"):
        fn(["1+2="] * 3, ["3"] * 3, answer=["3"] * 3)
    with pytest.raises(ValueError, match="answer_key='answer'"):
        fn(["1+2="] * 2, ["3"] * 2)
    with pytest.raises(ValueError, match="num_generations"):
        R.rlrr_trl_reward(RE.arith_judge(), task, num_generations=1)


# ---- inside TRL's GRPOTrainer
@needs_trl
@pytest.mark.parametrize("mapping", ["supplement", "reward"])
def test_two_grpo_trainer_steps_match_the_core(mapping):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    import kimi_papers.integrations.trl as kt
    from kimi_papers.core.models import CharTokenizer, tiny_causal_lm

    alphabet = ArithmeticTask.alphabet
    ctok = CharTokenizer(alphabet)
    task = ArithmeticTask(digits=2)
    judge = RE.arith_judge(seed=0)
    G = 4
    calls, batches = [], []
    inner = R.rlrr_trl_reward(judge, task, G, mapping, 0.1)

    def rlrr_reward(prompts, completions, **kw):
        out = inner(prompts, completions, **kw)
        calls.append((list(prompts), list(completions), list(kw["answer"]), out))
        return out

    class Recording(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            batches.append(out["advantages"].detach().double().cpu())
            return out

    model = tiny_causal_lm(ctok.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=64, seed=0, tokenizer=ctok)
    pairs = [(1, 2), (3, 4), (5, 1), (2, 2)]
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})
    cfg = GRPOConfig(output_dir="/tmp/kimi_papers_test_rlrr", use_cpu=True, report_to=[], save_strategy="no", beta=0.0,
                     bf16=False, max_steps=2, per_device_train_batch_size=8, num_generations=G, max_completion_length=4,
                     learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True, log_level="warning",
                     temperature=1.0)
    tr = Recording(model=model, reward_funcs=rlrr_reward, args=cfg, train_dataset=data,
                   processing_class=kt.hf_char_tokenizer(alphabet))
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr.state.global_step == 2 and len(calls) == 2 and len(batches) == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters())), "no parameter moved"
    adv_fn = get_advantage("grpo_trl")
    for (prompts, comps, answers, trl_r), trl_adv in zip(calls, batches):
        probs = [Problem(p, a, a) for p, a in zip(prompts, answers)]
        uid = torch.arange(len(prompts)) // G
        core_r = group_rewards(R.rlrr_group_reward(judge, task, mapping, 0.1), probs, comps, uid)
        assert torch.equal(torch.tensor(trl_r, dtype=torch.float32), core_r)  # the same rewards, bit for bit
        rb = RolloutBatch(input_ids=torch.ones(len(uid), 1, dtype=torch.long), attn_mask=torch.ones(len(uid), 1, dtype=torch.long),
                          resp_mask=torch.ones(len(uid), 1, dtype=torch.long), reward=core_r, uid=uid)
        core_adv = adv_fn(rb, eps=TRL_GRPO_EPS)[:, 0].double()
        assert (trl_adv - core_adv).abs().max() < 1e-5, (trl_adv, core_adv)   # TRL's advantages of these rewards
        correct = torch.tensor([task.verify(p, c) for p, c in zip(probs, comps)])
        rl = R.rlrr_trl_advantages(core_r, correct, G)
        assert torch.equal(rl, R.rlrr_advantages(core_r.double(), correct, uid).float())
        assert R.sign_violation_rate(rl.double(), correct) == 0.0
        if mapping == "supplement":  # every group of the random model carries signal
            assert R.live_group_ratio(core_adv, uid) == 1.0
        # the weight mapping of the same completions: zero in every group without a correct answer (expected)
        w = group_rewards(R.rlrr_group_reward(judge, task, "weight", 0.1), probs, comps, uid).view(-1, G)
        dead = ~correct.view(-1, G).any(1)
        assert (w[dead] == 0).all()


def test_trl_reward_answer_column_checked_up_front():
    task = ArithmeticTask(digits=2)
    with pytest.raises(ValueError, match="answer_key='answer'.*no such column"):
        R.rlrr_trl_reward(RE.arith_judge(), task, num_generations=2, dataset=["prompt", "solution"])
    with pytest.raises(ValueError, match="answer_key='ans'"):
        R.trl_reward_from_group_fn(lambda p, t, u: [0.0] * len(t), 2, answer_key="ans", dataset={"prompt": ["1+2="]})
    with pytest.raises(ValueError, match="answer_key=None"):
        R.rlrr_trl_reward(RE.arith_judge(), task, num_generations=2, mapping="supplement", answer_key=None)
    with pytest.raises(ValueError, match="answer_key=''"):
        R.trl_reward_from_group_fn(lambda p, t, u: [0.0] * len(t), 2, answer_key="")
    # a reward that reads no reference answer: no column demanded
    by_len = R.ListwiseJudge(lambda texts, _: [len(t) for t in texts])
    fn = R.rlrr_trl_reward(by_len, task, 2, mapping="reward", answer_key=None, dataset=["prompt"])
    assert fn(["1+2="] * 2, ["3", "44"]) == [0.0, 1.0]
    seen = []
    gen = R.trl_reward_from_group_fn(lambda p, t, u: seen.extend(x.answer for x in p) or [0.0] * len(t), 2, answer_key=None)
    assert gen(["q", "q"], ["a", "b"]) == [0.0, 0.0] and seen == ["", ""]


def test_live_group_ratio_differs_from_the_cores_reward_spread_ratio():
    """Same group, two measures: rewards differ (core's effective_group_ratio = 1), the sign clip zeroes all advantages."""
    from kimi_papers.core.rl import effective_group_ratio as reward_spread_ratio
    s = torch.tensor([0.0, 1.0], dtype=torch.float64)   # a correct answer ranked below a wrong one
    u = torch.zeros(2, dtype=torch.long)
    adv = R.rlrr_advantages(s, torch.tensor([1, 0]), u)
    assert reward_spread_ratio(s, u) == 1.0 and R.live_group_ratio(adv, u) == 0.0
    assert not hasattr(R, "effective_group_ratio")  # renamed: the two functions no longer share a name


def test_tune_lr_refuses_an_evaluation_seed_and_bad_grids():
    with pytest.raises(ValueError, match="tune_seed"):
        RE.tune_lr(RE.RunConfig(arm="grpo_binary", seeds=(99, 100)), (1e-4,), tune_seed=99)
    with pytest.raises(ValueError, match="grid"):
        RE.tune_lr(RE.RunConfig(arm="grpo_binary"), (), tune_seed=99)


def test_tune_lr_extends_a_grid_whose_best_is_at_an_edge(monkeypatch):
    import pandas as pd
    calls = []

    def fake_run(cfg, policy=None, progress=False):   # accuracy peaks at lr = 1e-3 (above the grid's top edge)
        calls.append((cfg.lr, tuple(cfg.seeds)))
        return pd.DataFrame([dict(step=cfg.steps, eval_acc=-abs(math.log10(cfg.lr) + 3.0))])

    monkeypatch.setattr(RE, "run_rlrr", fake_run)
    best, scores = RE.tune_lr(RE.RunConfig(arm="grpo_binary", seeds=(100, 101)), (3e-5, 1e-4, 3e-4), policy=object(),
                             tune_seed=99)
    assert best == pytest.approx(9e-4) and len(scores) == 5 and all(s == (99,) for _, s in calls)
    assert max(scores) == pytest.approx(2.7e-3)   # 9e-4 was itself an edge: extended once more, then it is interior
