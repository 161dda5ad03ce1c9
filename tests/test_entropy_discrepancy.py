"""kimi_papers.rl.entropy_discrepancy as a library: the ED estimator against a plain-Python reference, the bandit
identity, the schedules, the entropy term on the core Trainer and on the fused kernel, device safety."""
import copy
import math
import random
from dataclasses import replace

import pytest
import torch

from kimi_papers.core.rl import CountdownTask, Trainer, aggregate, get_advantage, ppo_clip_loss, sequence_stats
from kimi_papers.rl.entropy_discrepancy import (
    EDControl, EDScheduler, bandit_ed, bandit_entropy_step_effect, entropy_bonus_from_logits, entropy_bonus_loss,
    entropy_bonus_reference, entropy_discrepancy, entropy_step, outcome_sides)
from kimi_papers.rl.entropy_discrepancy_experiment import (
    ScheduleConfig, bandit_theory, countdown_policy, make_control, measure_policy, random_bandits, run_entropy_schedule)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def reference_ed(surprisal_rows: list[list[float]], rewards: list[float], uid: list, pool: str) -> float:
    """Plain-Python ED: token-mean score per row; sides by r vs group mean; mixed groups only."""
    score = [sum(r) / max(len(r), 1) for r in surprisal_rows]
    groups: dict = {}
    for i, g in enumerate(uid):
        groups.setdefault(g, []).append(i)
    pos_all, neg_all, per_group = [], [], []
    for idx in groups.values():
        mean = sum(rewards[i] for i in idx) / len(idx)
        tol = 1e-6 * max(abs(rewards[i]) for i in idx)  # relative to the group's rewards: the reward's unit does not matter
        pos = [score[i] for i in idx if rewards[i] > mean + tol]
        neg = [score[i] for i in idx if rewards[i] < mean - tol]
        if pos and neg:
            pos_all += pos
            neg_all += neg
            per_group.append(sum(pos) / len(pos) - sum(neg) / len(neg))
    if not per_group:
        return math.nan
    if pool == "group":
        return sum(per_group) / len(per_group)
    return sum(pos_all) / len(pos_all) - sum(neg_all) / len(neg_all)


@pytest.mark.parametrize("pool", ["response", "group"])
@pytest.mark.parametrize("binary", [True, False])
def test_ed_matches_python_reference(pool, binary):
    rng = random.Random(0)
    rows, T = 24, 6
    lengths = [rng.randint(1, T) for _ in range(rows)]
    sur = [[rng.uniform(0, 3) for _ in range(n)] for n in lengths]
    rewards = [float(rng.random() < 0.4) if binary else round(rng.random(), 3) for _ in range(rows)]
    uid = [i // 4 for i in range(rows)]
    lp = torch.zeros(rows, T, dtype=torch.float64)
    mask = torch.zeros(rows, T, dtype=torch.long)
    for i, r in enumerate(sur):
        lp[i, T - len(r):] = -torch.tensor(r, dtype=torch.float64)  # right-aligned, like left-padded prompts
        mask[i, T - len(r):] = 1
    lp[mask == 0] = -50.0  # off-mask values must not count
    got = entropy_discrepancy(lp, None, mask, torch.tensor(rewards, dtype=torch.float64), torch.tensor(uid), pool=pool)
    assert got == pytest.approx(reference_ed(sur, rewards, uid, pool), rel=1e-12)


@pytest.mark.parametrize("scale", [1e-9, 1e-7, 1.0, 1e5])
def test_ed_does_not_depend_on_the_reward_unit(scale):
    """ED is the same whatever the reward's unit: an absolute 1e-6 tolerance made it NaN for rewards below ~1e-6."""
    rng = random.Random(1)
    rows, T = 16, 4
    lp = -torch.tensor([[rng.uniform(0, 3) for _ in range(T)] for _ in range(rows)], dtype=torch.float64)
    mask = torch.ones(rows, T, dtype=torch.long)
    uid = torch.tensor([i // 4 for i in range(rows)])
    for rewards in ([float(i % 2) for i in range(rows)], [round(rng.random(), 3) for _ in range(rows)]):
        r = torch.tensor(rewards, dtype=torch.float64)
        want = entropy_discrepancy(lp, None, mask, r, uid)
        got = entropy_discrepancy(lp, None, mask, r * scale, uid)
        assert math.isfinite(got) and got == pytest.approx(want, rel=1e-9)
    # rounding-level differences stay on neither side at any scale
    pos, neg = outcome_sides(torch.tensor([1.0, 1.0 + 2 ** -23]) * scale, torch.zeros(2))
    assert not pos.any() and not neg.any()
    with pytest.raises(ValueError, match="rtol"):
        outcome_sides(torch.tensor([0.0, 1.0]), torch.zeros(2), rtol=1.5)


def test_ed_nan_and_bad_input():
    lp, m = -torch.ones(4, 2), torch.ones(4, 2)
    assert math.isnan(entropy_discrepancy(lp, None, m, torch.tensor([1.0, 1, 0, 0]), torch.tensor([0, 0, 1, 1])))
    with pytest.raises(ValueError, match="kind="):
        entropy_discrepancy(lp, None, m, torch.ones(4), torch.zeros(4), kind="kl")
    with pytest.raises(ValueError, match="rewards: expected shape"):
        entropy_discrepancy(lp, None, m, torch.ones(3), torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        entropy_discrepancy(lp, None, m, torch.tensor([1.0, math.inf, 0, 0]), torch.zeros(4))


def test_bandit_identity_and_tempering():
    th = bandit_theory(1000, 12, seed=0, eta=1e-5)
    assert th.rel_err.max() < 1e-4 and th.sign_natural.all()
    assert 0.5 < th.sign_plain.mean() < 1.0  # the plain step is not covered by the identity: some signs differ
    z, r = random_bandits(3, 5, seed=2)
    pi = torch.softmax(z, -1)
    assert torch.allclose(torch.softmax(entropy_step(z, 0.4), -1), pi ** 0.6 / (pi ** 0.6).sum(-1, keepdim=True))
    # a hand case: pi = (1/2, 1/4, 1/4), arm 0 correct -> h+ = log 2, h- = log 4, ED = -log 2, prediction -(1/4) log 2
    z3 = torch.log(torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64))
    r3 = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    assert bandit_ed(z3, r3)[1].item() == pytest.approx(-math.log(2))
    dj, pred = bandit_entropy_step_effect(z3, r3)
    assert pred.item() == pytest.approx(-0.25 * math.log(2)) and dj.item() == pytest.approx(pred.item(), rel=1e-6)
    with pytest.raises(ValueError, match="rewards: expected shape"):
        bandit_ed(z3, r3[:, :2])


def test_scheduler_sequences_and_errors():
    s = EDScheduler("linear", 0.02, kappa=0.1, ema=0.5)
    assert [s.update(x) for x in (0.1, math.nan, -0.3)] == pytest.approx([0.01, 0.01, -0.01])  # EMA: 0.1, 0.1, -0.1
    sw = EDScheduler("switch", 0.02, delta=0.05, ema=0.0)
    assert [sw.update(x) for x in (0.04, 0.06, -0.2, math.nan)] == [0.0, 0.02, -0.02, -0.02]
    for kw in (dict(alpha_max=-1.0), dict(ema=1.0), dict(mode="sign"), dict(kappa=-1.0)):
        with pytest.raises(ValueError, match=list(kw)[0]):
            EDScheduler(**kw)


def test_entropy_bonus_guard():
    h, m = torch.full((2, 3), 1e-5), torch.ones(2, 3)
    with pytest.warns(RuntimeWarning, match="switched off"):
        assert entropy_bonus_loss(h, m, -0.1).item() == 0.0
    assert entropy_bonus_loss(h + 1.0, m, -0.1).item() == pytest.approx(0.1 * (1.0 + 1e-5))


def test_entropy_gradient_kernel():
    z = torch.randn(2, 4, 37, dtype=torch.float64, requires_grad=True)
    m = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])
    assert torch.autograd.gradcheck(lambda x: entropy_bonus_from_logits(x, m, 0.5, compiled=False), (z,))
    x = torch.randn(3, 16, 500, requires_grad=True)
    ones = torch.ones(3, 16)
    (gc,) = torch.autograd.grad(entropy_bonus_from_logits(x, ones, 0.2, compiled=True), x)
    (ge,) = torch.autograd.grad(entropy_bonus_reference(x, ones, 0.2), x)
    assert float((gc - ge).abs().max() / ge.abs().max()) < 1e-5
    assert entropy_bonus_from_logits(torch.zeros(1, 2, 77), torch.ones(1, 2), -1.0).item() == pytest.approx(math.log(77))


@pytest.fixture(scope="module")
def countdown():
    pol, info = countdown_policy()
    assert info["source"] == "countdown3_tiny.pt"  # the committed fixture, not a fresh SFT
    return pol, CountdownTask(n_numbers=3, max_number=9)


def test_trainer_applies_the_schedule_and_the_loss(countdown):
    pol, task = countdown
    ctl = EDControl(EDScheduler("linear", 0.5))
    tr = Trainer(replace(pol, model=copy.deepcopy(pol.model)), task, group_size=8, prompts_per_step=4,
                 max_new_tokens=10, progress=False, seed=1, **ctl.trainer_kwargs())
    b = tr.score_old(tr.rollout(tr.draw_problems()))
    b.adv, _ = tr.advantages(b)
    alpha = ctl.coef(0, {})
    assert ctl.rows[-1]["mixed_groups"] >= 1 and alpha == pytest.approx(max(-0.5, min(0.5, 2.0 * ctl.rows[-1]["ed"])))
    loss, metrics = tr.minibatch_loss(b)
    st = sequence_stats(tr.fwd, tr.policy.head(), b.input_ids, b.attn_mask, b.resp_mask)
    want = aggregate(ppo_clip_loss(st["logp"], b.old_logp, get_advantage("grpo")(b), b.resp_mask).per_token, b.resp_mask)
    want = want + entropy_bonus_loss(st["entropy"], b.resp_mask, alpha)
    assert metrics["entropy_coef"] == alpha and loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    run = run_entropy_schedule(dict(policy=pol, task=task, arm="switch", steps=2, prompts_per_step=2,
                                    max_new_tokens=10))
    assert (run.entropy_coef == run.alpha_applied).all() and run.arm.eq("switch").all()
    assert make_control(ScheduleConfig(pol, task, arm="fixed+", alpha_max=0.3)).schedule == 0.3


def test_measure_policy_shares_noise(countdown):
    pol, task = countdown
    probs = task.heldout(8)
    a = measure_policy(pol, task, probs, samples=4, k=(1, 2), max_new_tokens=10, seed=3)
    b = measure_policy(pol, task, probs, samples=4, k=(1, 2), max_new_tokens=10, seed=3)
    assert a["reward"] == b["reward"] and a["pass@1"] == pytest.approx(a["reward"]) and a["pass@2"] >= a["pass@1"]
    with pytest.raises(ValueError, match="samples"):
        measure_policy(pol, task, probs, samples=2, k=(4,))


@gpu
@needs_cuda
def test_on_cuda(countdown):
    cu = torch.device("cuda")
    lp, m = -torch.rand(8, 3, device=cu), torch.ones(8, 3, device=cu)
    r, uid = torch.tensor([1.0, 0] * 4, device=cu), torch.arange(8, device=cu) // 4
    assert entropy_discrepancy(lp, None, m, r, uid) == pytest.approx(entropy_discrepancy(lp.cpu(), None, m.cpu(), r.cpu(), uid.cpu()))
    x = torch.randn(2, 8, 4096, device=cu, requires_grad=True)
    torch.testing.assert_close(entropy_bonus_from_logits(x, torch.ones(2, 8, device=cu), 0.3),
                               entropy_bonus_reference(x, torch.ones(2, 8, device=cu), 0.3), atol=1e-5, rtol=1e-5)
    pol, task = countdown
    pc = replace(pol, model=copy.deepcopy(pol.model).to(cu))
    run = run_entropy_schedule(dict(policy=pc, task=task, arm="linear", steps=2, prompts_per_step=2, max_new_tokens=10))
    assert torch.isfinite(torch.tensor(run.loss.values)).all()


def test_moved_harness_names_still_resolve():
    """Names that lived in the method module before the split resolve from the experiment module, with a warning."""
    import kimi_papers.rl.entropy_discrepancy as method
    import kimi_papers.rl.entropy_discrepancy_experiment as experiment
    with pytest.warns(DeprecationWarning, match="entropy_discrepancy_experiment"):
        assert method.run_entropy_schedule is experiment.run_entropy_schedule
    with pytest.raises(AttributeError, match="no_such_name"):
        method.no_such_name
