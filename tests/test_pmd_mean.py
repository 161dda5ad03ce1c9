"""kimi_papers.rl.pmd_mean as a library: precision of the regression, device safety, the baselines against references."""
import math

import numpy as np
import pytest
import torch

from kimi_papers.core.rl import ADVANTAGES, LOSSES, RolloutBatch, aggregate
from kimi_papers.rl.pmd_mean import PMD_MODES, pmd_advantages, pmd_loss, pmd_trainer_kwargs
from kimi_papers.rl.pmd_mean_experiment import bandit_experiment, matched_progress_std, tune_grid

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def reference_advantages(r: list[float], uid: list, tau: float, mode: str) -> list[float]:
    """A plain-Python reference of the three baselines (float64, one group at a time; a lone sample gets A = r)."""
    out = []
    for i, (ri, gi) in enumerate(zip(r, uid)):
        group = [rj for rj, gj in zip(r, uid) if gj == gi]
        others = [rj for j, (rj, gj) in enumerate(zip(r, uid)) if gj == gi and j != i]
        if mode == "mean":
            base = sum(group) / len(group)
        elif not others:
            base = 0.0
        elif mode == "mean_loo":
            base = sum(others) / len(others)
        else:
            m = max(others)
            base = m + tau * math.log(sum(math.exp((x - m) / tau) for x in others) / len(others))
        out.append(ri - base)
    return out


def bf16_case(seed: int = 0):
    """bf16 log-probs near -2 with tiny log-ratios, bf16 advantages in [-1, 1], a random mask."""
    g = torch.Generator().manual_seed(seed)
    lp = (-2 + 0.3 * torch.randn(64, 12, generator=g)).bfloat16()
    old = (lp.double() + 1e-3 * torch.randn(64, 12, generator=g, dtype=torch.float64)).bfloat16()
    mask = (torch.rand(64, 12, generator=g) < 0.8).float()
    adv = (torch.rand(64, generator=g) * 2 - 1).bfloat16()
    return lp, old, adv, mask


@pytest.mark.parametrize("mode", PMD_MODES)
@pytest.mark.parametrize("tau", [0.01, 0.3, 5.0])
def test_advantages_match_reference(mode, tau):
    rng = np.random.default_rng(3)
    uid = rng.integers(0, 6, size=40).tolist()  # interleaved groups of random sizes, some of one
    r = rng.choice([0.0, 0.25, 1.0], size=40).tolist()
    got = pmd_advantages(torch.tensor(r, dtype=torch.float64), uid, tau, mode)
    assert torch.allclose(got, torch.tensor(reference_advantages(r, uid, tau, mode), dtype=torch.float64), atol=1e-10)


def test_lone_sample_gets_its_reward_like_openkimi():
    r, uid = torch.tensor([0.3, 1.0, 0.0]), [0, 1, 1]
    for mode in ("mean_loo", "partition_loo"):
        assert pmd_advantages(r, uid, 0.1, mode)[0] == pytest.approx(0.3)
        assert pmd_advantages(r, uid, 0.1, mode, lone="zero")[0] == 0.0
    assert pmd_advantages(r, uid, 0.1, "mean")[0] == 0.0


def test_bf16_regression_runs_in_float32():
    """Fails on a loss computed in bf16: A/τ ~ 100 has bf16 steps of 0.5, the residual's square is off by ~0.3%."""
    lp, old, adv, mask = bf16_case()
    want, _ = pmd_loss(lp.double(), old.double(), adv.double(), mask.double(), 0.01)
    leaf = lp.clone().requires_grad_(True)
    got, metrics = pmd_loss(leaf, old, adv, mask.bfloat16(), 0.01)
    assert got.dtype == torch.float32
    assert abs(got.item() / want.item() - 1) < 1e-5
    delta = ((lp.double() - old.double()) * mask.double()).sum(-1)
    assert metrics["pmd/log_ratio"] == pytest.approx(float(delta.mean()), abs=1e-6)
    (g,) = torch.autograd.grad(got, leaf)
    assert g.dtype == torch.bfloat16
    # the registered loss, aggregated by the core, gives the same float32 value
    per_seq = LOSSES["pmd_mean"](lp, old, adv, mask.bfloat16(), tau=0.01).per_seq
    assert per_seq.dtype == torch.float32
    assert abs(aggregate(None, mask, "seq-mean-token-mean", per_seq=per_seq).item() / want.item() - 1) < 1e-5


def test_float64_inputs_stay_float64():
    lp, old, adv, mask = (x.double() for x in bf16_case(1))
    assert pmd_loss(lp, old, adv, mask, 0.1)[0].dtype == torch.float64


def test_tune_grid_extends_at_an_edge_only():
    seen = []
    best, tab = tune_grid(lambda v: seen.append(v) or -abs(math.log10(v) + 2), [1e-4, 1e-3], factor=10, max_extend=4)
    assert best == pytest.approx(1e-2) and len(seen) == 4 and tab.chosen.sum() == 1  # 1e-2 then 1e-1: best inside
    assert tab.loc[tab.chosen, "extension"].item() == 1


def test_matched_progress_reads_the_faster_arm_early():
    a = np.array([[0.0, 0.5, 1.0], [0.0, 0.9, 1.0]])  # mean reaches 0.7 at index 1
    b = np.array([[0.0, 0.3, 0.6], [0.0, 0.5, 0.8]])  # final mean 0.7
    d = matched_progress_std(a, b)
    assert (d["iter_a"], d["iter_b"]) == (1, 2) and d["std_a"] == pytest.approx(np.std([0.5, 0.9], ddof=1))


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", PMD_MODES)
def test_advantages_on_cuda(mode):
    r = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 2.0], device="cuda")
    cpu = pmd_advantages(r.cpu(), [0, 0, 0, 1, 1, 2], 0.1, mode)
    for uid in ([0, 0, 0, 1, 1, 2], torch.tensor([0, 0, 0, 1, 1, 2]), torch.tensor([0, 0, 0, 1, 1, 2], device="cuda")):
        got = pmd_advantages(r, uid, 0.1, mode)
        assert got.device.type == "cuda" and torch.allclose(got.cpu(), cpu)


@gpu
@needs_cuda
def test_loss_and_registered_advantages_on_cuda():
    lp, old, adv, mask = (x.cuda() for x in bf16_case())
    want, _ = pmd_loss(lp.double().cpu(), old.double().cpu(), adv.double().cpu(), mask.double().cpu(), 0.01)
    got, _ = pmd_loss(lp, old, adv, mask, 0.01)
    assert got.device.type == "cuda" and abs(got.item() / want.item() - 1) < 1e-5
    mk = torch.tensor([[0, 1, 1], [0, 1, 0], [1, 1, 1], [1, 0, 0]])
    rb = RolloutBatch(input_ids=torch.ones(4, 3, dtype=torch.long), attn_mask=torch.ones(4, 3, dtype=torch.long),
                      resp_mask=mk, reward=torch.tensor([1.0, 0.0, 0.0, 1.0]), uid=torch.tensor([0, 0, 1, 1])).to("cuda")
    for name in ("pmd_mean", "pmd_partition"):
        a = ADVANTAGES[name](rb, tau=0.1)
        assert a.device.type == "cuda" and a.shape == (4, 3)


@gpu
@needs_cuda
def test_bandit_on_cuda_matches_cpu():
    kw = dict(arms=8, group=4, iters=20, seeds=(0, 1), fit_steps=5, tau=0.1)
    assert np.allclose(bandit_experiment(device="cuda", **kw).p_correct, bandit_experiment(**kw).p_correct, atol=1e-9)


@gpu
@needs_cuda
@pytest.mark.parametrize("arm", ["pmd_mean", "pmd_partition"])
def test_trainer_step_on_cuda(arm):
    from kimi_papers.core.rl import ArithmeticTask, Trainer, tiny_policy
    task = ArithmeticTask(digits=2, ops="+-")
    policy, _ = tiny_policy(task, d_model=64, n_layers=2, seed=0, sft_steps=2400, target_acc=0.3, eval_every=100,
                            progress=False)
    policy.model.to("cuda")
    hist = Trainer(policy, task, group_size=4, max_new_tokens=6, progress=False,
                   **pmd_trainer_kwargs(arm, staleness=2, prompts=2, tau=0.1)).fit(1)
    assert np.isfinite(hist.loss).all()


def test_moved_names_still_resolve():
    import kimi_papers.rl.pmd_mean as m
    import kimi_papers.rl.pmd_mean_experiment as e
    with pytest.warns(DeprecationWarning, match="pmd_mean_experiment"):
        assert m.tune_grid is e.tune_grid and m.bandit_experiment is e.bandit_experiment
    with pytest.raises(AttributeError):
        m.not_a_name
