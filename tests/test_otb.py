"""Device-safety of the OTB library (kimi_papers.rl.optimal_token_baseline): every public function on CPU and,
where a GPU is present, on CUDA with the same numbers. The notebook's own cells hold the hand-computed checks."""
import math

import pytest
import torch

from kimi_papers.core.rl import ADVANTAGES, RolloutBatch, Trainer, generate, tiny_policy
from kimi_papers.rl.optimal_token_baseline import (empirical_grad_variance, logit_grad_energy, otb_advantages,
                                                   otb_advantages_reference, otb_multiturn_advantages,
                                                   outcome_token_rewards, realized_energy, sum_pi_squared,
                                                   token_grad_energies, variance_proxy_metrics)
from kimi_papers.rl.optimal_token_baseline_experiment import ChainSumTask, OTBRun, bandit_expected_gradients, run_otb

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs a CUDA GPU")])]


def ragged(rows=24, T=17, n_groups=5, seed=0, dtype=torch.float64):
    """A random left-aligned batch of groups (outcome reward on the last response token), on the CPU."""
    g = torch.Generator().manual_seed(seed)
    L = torch.randint(1, T + 1, (rows,), generator=g)
    msk = (torch.arange(T)[None] < L[:, None]).to(dtype)
    rew = torch.zeros(rows, T, dtype=dtype)
    rew[torch.arange(rows), L - 1] = torch.randint(0, 2, (rows,), generator=g).to(dtype)
    logits = torch.randn(rows, T, 11, generator=g, dtype=torch.float64) * 2
    tok = torch.randint(0, 11, (rows, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, tok[..., None])[..., 0].to(dtype)
    uid = torch.randint(0, n_groups, (rows,), generator=g)
    return rew, msk, uid, lp, sum_pi_squared(logits).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_advantages_on_device_match_cpu_reference(device):
    rew, msk, uid, lp, q = ragged()
    isw = torch.rand(rew.shape, generator=torch.Generator().manual_seed(1), dtype=rew.dtype) + 0.5
    ref, _ = otb_advantages_reference(rew, msk, uid.tolist(), lp, q, is_weights=isw)
    on = [t.to(device) for t in (rew, msk, uid, lp, q, isw)]
    adv, ret = otb_advantages(*on[:5], is_weights=on[5])
    assert adv.device.type == device and ret.device.type == device and adv.dtype == rew.dtype
    assert torch.allclose(adv.cpu(), ref, atol=1e-10)
    ref_dev, _ = otb_advantages_reference(*on[:2], on[2].tolist(), *on[3:5], is_weights=on[5])
    assert torch.allclose(ref_dev.cpu(), ref, atol=1e-10)
    mt, _ = otb_multiturn_advantages(*on[:5], is_weights=on[5])
    assert mt.device.type == device and torch.allclose(mt.cpu(), ref, atol=1e-10)
    W = realized_energy(on[1], on[3], on[4])
    vm = variance_proxy_metrics(adv, on[1], torch.diff(W, dim=-1, prepend=torch.zeros_like(W[:, :1])), grad_norm=0.1)
    assert all(math.isfinite(v) for v in vm.values())


@pytest.mark.parametrize("device", DEVICES)
def test_proxy_and_registry_adapter_on_device(device):
    z = torch.randn(8, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(device) * 3
    a = torch.arange(8, device=device) % 50
    lp = torch.log_softmax(z, -1).gather(-1, a[:, None])[:, 0]
    ref = (torch.nn.functional.one_hot(a, 50) - torch.softmax(z, -1)).pow(2).sum(-1)
    assert torch.allclose(logit_grad_energy(lp, sum_pi_squared(z)), ref, atol=1e-12)
    R, T, P = 6, 9, 3
    resp = torch.zeros(R, T, dtype=torch.long, device=device)
    for i, L in enumerate([4, 2, 6, 3, 3, 1]):
        resp[i, P:P + L] = 1
    b = RolloutBatch(input_ids=torch.ones(R, T, dtype=torch.long, device=device), attn_mask=torch.ones_like(resp),
                     resp_mask=resp, reward=torch.tensor([1., 0, 0, 1, 1, 0], device=device),
                     uid=torch.tensor([5, 5, 5, 9, 9, 9], device=device),
                     old_logp=-0.5 * resp.float(), sum_pi2=0.3 * resp.float())
    A = ADVANTAGES["otb"](b)
    assert A.device.type == device and A.shape == (R, T) and (A[resp == 0] == 0).all()
    tok = outcome_token_rewards(b.reward, resp)
    assert tok.device.type == device and torch.equal(tok.sum(-1), b.reward)


@pytest.mark.parametrize("device", DEVICES)
def test_bandit_expectation_on_device(device):
    z, p = torch.tensor([3.0, 1.0, 0.0, -1.0, 2.5, -2.0]), torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3, 0.8])
    eg = bandit_expected_gradients(z.to(device), p.to(device), {"otb": "otb", "rloo": "rloo"}, group_size=3)
    assert all(v.device.type == device for v in eg.values())
    assert torch.allclose(eg["rloo"], eg["true"], rtol=1e-6, atol=1e-9)
    cos = float(torch.nn.functional.cosine_similarity(eg["otb"], eg["true"], 0))
    assert 0.9 < cos < 0.999                          # turned, not only shortened


@pytest.mark.parametrize("device", DEVICES)
def test_policy_level_functions_on_device(device):
    task = ChainSumTask(2, 3)
    pol, _ = tiny_policy(task, d_model=16, n_layers=1, n_heads=2, max_len=32, seed=0, fixture=False, progress=False)
    pol.model.to(device)
    prob = task.make_from([1, 2])
    ids, attn, resp, _ = generate(pol, [pol.encode_prompt(prob.prompt)] * 2, max_new_tokens=5,
                                  generator=torch.Generator().manual_seed(0))
    tk, sq = token_grad_energies(pol, ids, attn, resp, param_tokens=1)
    assert len(tk) and (tk.proxy - tk.exact_logit).abs().max() < 1e-4
    ev = empirical_grad_variance(pol, task, {"otb": "otb", "rloo": "rloo"}, prompts=[prob], groups=2, group_size=2,
                                 max_new_tokens=5)
    assert ev.trace_var.notna().all()
    cfg = OTBRun(arms={"OTB(2)": ("otb", 2)}, seeds=[0], steps=1, prompts_per_step=2, max_new_tokens=5, eval_n=4,
                 eval_points=1)
    df = run_otb(cfg, task, pol)
    assert len(df) == 1 and math.isfinite(df.grad_norm.iloc[0]) and math.isfinite(df.vp_total_power.iloc[0])
