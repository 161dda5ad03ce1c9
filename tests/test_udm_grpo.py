"""kimi_papers.rl.udm_grpo as a library: the uniform path, the sampler step (eager = compiled, jump law), the training
pairs, the token-mean log-prob, the loss's value and gradient, the advantage, bad input, and CUDA where present."""
import math

import pytest
import torch

from kimi_papers.core.kernels import compiled_ran
from kimi_papers.rl.udm_grpo import (
    UDMGRPOConfig, UniformPath, group_adv, make_train_pairs, reward_sampling_var, token_mean_logp, train_udm_grpo,
    udm_grpo_loss, udm_sample, udm_step, udm_step_compiled, udm_step_reference, within_class_diversity)
from kimi_papers.rl.udm_grpo_experiment import (
    DigitReward, TinyUDM, dequantize, load_digit_tokens, noise_scaled_oscillation, oscillation, quantize_digits)

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def tiny(K=4, seed=0):
    torch.manual_seed(seed)
    return TinyUDM(K, d=16, layers=1, heads=2).eval()


def test_schedule_hand_values():
    p = UniformPath(4)
    assert p.times(4) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])  # shift 1: t_k = k/n
    s3 = UniformPath(4, shift=3.0)
    assert s3.t_at(5, 10) == pytest.approx(1 - 1.5 / 2.0)  # σ = 0.5: 1 − 3·0.5/(1 + 2·0.5)
    ts = s3.times(10)
    assert ts[0] == 0 and ts[-1] == pytest.approx(1) and all(b > a for a, b in zip(ts, ts[1:]))
    with pytest.raises(ValueError, match="k="):
        p.t_at(11, 10)
    with pytest.raises(ValueError, match="n_steps"):
        p.t_at(0, 0)


def test_forward_noise_limits_and_marginal():
    p, g = UniformPath(4), torch.Generator().manual_seed(0)
    x1 = torch.randint(0, 4, (400, 64), generator=g)
    assert torch.equal(p.forward_noise(x1, 1.0, g), x1)
    x0 = p.forward_noise(x1, 0.0, g)  # fully uniform: independent of x1, each token 1/4
    n = x0.numel()
    for v in range(4):
        assert abs(float((x0 == v).float().mean()) - 0.25) < 3 * math.sqrt(0.25 * 0.75 / n) + 1e-9
    assert abs(float((x0 == x1).float().mean()) - 0.25) < 3 * math.sqrt(0.25 * 0.75 / n)
    for t in (0.3, 0.9, 0.999):
        want = t + (1 - t) / 4
        got = float((p.forward_noise(x1, t, g) == x1).float().mean())
        assert abs(got - want) < 3 * math.sqrt(want * (1 - want) / n) + 1e-9
    per_row = p.forward_noise(x1[:2], torch.tensor([0.0, 1.0]), g)
    assert torch.equal(per_row[1], x1[1])
    with pytest.raises(ValueError, match="t:"):
        p.forward_noise(x1, 1.5)
    with pytest.raises(ValueError, match="empty"):
        p.forward_noise(x1[:0], 0.5)


def test_jump_prob_and_bad_times():
    assert float(UniformPath.jump_prob(0.5, 0.1)) == pytest.approx(1 - math.exp(-0.2))
    assert float(UniformPath.jump_prob(0.0, math.inf)) == 1.0
    with pytest.raises(ValueError, match="t=.*divides by zero"):
        UniformPath.jump_prob(1.0, 0.1)
    with pytest.raises(ValueError, match="dt="):
        UniformPath.jump_prob(0.2, -0.1)
    with pytest.raises(ValueError, match="K="):
        UniformPath(1)


def step_inputs(B=64, L=64, K=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, K, generator=g) * 2
    x = torch.randint(0, K, (B, L), generator=g)
    gum = -torch.log(-torch.log(torch.rand(B, L, K, generator=g).clamp(1e-12, 1 - 1e-7)))
    return logits, x, torch.rand(B, generator=g) * 0.9, torch.rand(B, generator=g) * 0.2, gum, torch.rand(B, L, generator=g)


def test_step_compiled_equals_eager():
    for B in (64, 37):  # two shapes: dynamic, no recompile per shape
        logits, x, t, dt, gum, u = step_inputs(B)
        a = udm_step(logits, x, t, dt, gum, u, compiled=False)
        b = udm_step(logits, x, t, dt, gum, u, compiled=True)
        assert compiled_ran(udm_step_compiled), "the compiled sampler step fell back to eager"
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the reference itself: argmax of logits + gumbel, and the jump rule by hand
    x_next, draw = udm_step_reference(logits, x, t[:, None], dt[:, None], gum, u)
    assert torch.equal(draw, (logits + gum).argmax(-1))
    p = 1 - torch.exp(-dt[:, None] / (1 - t[:, None]))
    assert torch.equal(x_next, torch.where((draw != x) & (u < p), draw, x))


def test_step_jump_frequency_matches_rate():
    # a fixed f_θ that always proposes token 1 on x_t = 0: the jump frequency is 1 − exp(−dt/(1−t)) exactly
    N, t, dt = 100_000, 0.4, 0.1
    g = torch.Generator().manual_seed(1)
    logits = torch.tensor([-30.0, 30.0, -30.0, -30.0]).expand(1, N, 4).contiguous()
    x = torch.zeros(1, N, dtype=torch.long)
    gum = -torch.log(-torch.log(torch.rand(1, N, 4, generator=g).clamp(1e-12, 1 - 1e-7)))
    x_next, _ = udm_step(logits, x, t, dt, gum, torch.rand(1, N, generator=g), compiled=False)
    p = 1 - math.exp(-dt / (1 - t))
    assert abs(float((x_next == 1).float().mean()) - p) < 3 * math.sqrt(p * (1 - p) / N)
    # a uniform f_θ: a token jumps when the draw differs (3/4) and the clock fires
    x_next, _ = udm_step(torch.zeros(1, N, 4), x, t, dt, gum, torch.rand(1, N, generator=g), compiled=False)
    q = 0.75 * p
    assert abs(float((x_next != 0).float().mean()) - q) < 3 * math.sqrt(q * (1 - q) / N)


def test_step_bad_input():
    logits, x, t, dt, gum, u = step_inputs(4)
    with pytest.raises(ValueError, match="non-finite"):
        udm_step(logits.index_fill(0, torch.tensor([1]), float("nan")), x, t, dt, gum, u)
    with pytest.raises(ValueError, match="t="):
        udm_step(logits, x, 1.0, dt, gum, u)
    with pytest.raises(ValueError, match="logits"):
        udm_step(logits[:, :3], x, t, dt, gum, u)
    x_next, draw = udm_step(logits, x, t, math.inf, gum, u, compiled=False)  # dt = inf: the last step takes x̂₁
    assert torch.equal(x_next, draw)


def test_model_is_bidirectional_and_checks_input():
    m = tiny()
    x = torch.randint(0, 4, (2, 64))
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 4
    a, b = m(x, 0.5, torch.tensor([1, 2])), m(y, 0.5, torch.tensor([1, 2]))
    assert a.shape == (2, 64, 4) and not torch.allclose(a[:, 0], b[:, 0])  # a later token changes position 0
    assert not torch.allclose(m(x, 0.5, torch.tensor([1, 2])), m(x, 0.5, torch.tensor([3, 2])))  # class conditions
    assert not torch.allclose(m(x, 0.1, torch.tensor([1, 2])), m(x, 0.9, torch.tensor([1, 2])))  # t conditions
    with pytest.raises(ValueError, match="cls"):
        m(x, 0.5, torch.tensor([1, 11]))
    with pytest.raises(ValueError, match="x_t"):
        m(x + 4, 0.5, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="t:"):
        m(x, 1.5, torch.tensor([1, 2]))


def test_sampler_trajectory_and_bad_input():
    m = tiny()
    cls = torch.tensor([0, 3, 9])
    x1, st, dr = udm_sample(m, cls, 5, gen=torch.Generator().manual_seed(2), compiled=False)
    assert x1.shape == (3, 64) and st.shape == dr.shape == (5, 3, 64) and torch.equal(dr[-1], x1)
    # x_{t_{k+1}} either keeps x_{t_k} or takes that step's draw
    for k in range(4):
        assert bool(((st[k + 1] == st[k]) | (st[k + 1] == dr[k])).all())
    again = udm_sample(m, cls, 5, gen=torch.Generator().manual_seed(2), compiled=False)
    assert torch.equal(again[0], x1) and torch.equal(again[1], st)  # deterministic under a seed
    assert udm_sample(m, cls, 1, record=False, compiled=False)[1] is None
    with pytest.raises(ValueError, match="n_steps"):
        udm_sample(m, cls, 0)
    with pytest.raises(ValueError, match="unknown class"):
        udm_sample(m, torch.tensor([10]), 3)
    with pytest.raises(ValueError, match="cfg_free"):
        udm_sample(m, cls, 3, guidance=3.0)
    with pytest.raises(ValueError, match="empty"):
        udm_sample(m, torch.tensor([], dtype=torch.long), 3)
    assert udm_sample(m, cls, 3, guidance=3.0, cfg_free=False, compiled=False)[0].shape == (3, 64)


def test_train_pairs_switches():
    g = torch.Generator().manual_seed(0)
    st, dr = torch.randint(0, 4, (10, 8, 64), generator=g), torch.randint(0, 4, (10, 8, 64), generator=g)
    x1, ts = dr[-1], UniformPath(4).times(10)
    naive = make_train_pairs(x1, st, dr, ts, [2, 3, 4], False, False)
    assert [p.k for p in naive] == [2, 3, 4] and all(torch.equal(p.state, st[p.k]) and torch.equal(p.action, dr[p.k])
                                                     for p in naive)
    udm = make_train_pairs(x1, st, dr, ts, [0, 1, 2], True, True, g, K=4)
    assert all(torch.equal(p.action, x1) for p in udm) and udm[1].t == pytest.approx(0.1)
    kept = float((make_train_pairs(x1, st, dr, ts, [9], True, True, g, K=4)[0].state == x1).float().mean())
    assert abs(kept - (0.9 + 0.1 / 4)) < 0.05  # forward-noised at t = 0.9
    with pytest.raises(ValueError, match="window"):
        make_train_pairs(x1, st, dr, ts, [8, 9, 10], True, True, g, K=4)
    with pytest.raises(ValueError, match="window"):
        UDMGRPOConfig(train_steps=4, window=3, max_start=2)


def test_token_mean_logp_matches_manual():
    m = tiny()
    s, a, cls = torch.randint(0, 4, (3, 64)), torch.randint(0, 4, (3, 64)), torch.tensor([1, 2, 3])
    want = torch.log_softmax(m(s, 0.3, cls), -1).gather(-1, a[..., None]).squeeze(-1).mean(-1)
    got = token_mean_logp(m, s, 0.3, a, cls)
    assert torch.allclose(got, want, atol=1e-6) and got.requires_grad


def test_loss_value_and_gradient_by_hand():
    lp = torch.tensor([-1.0, -1.3, -0.7, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.1, -1.3, -0.5, -2.2], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    loss, m = udm_grpo_loss(lp, ref, adv, 0.05)
    d = lp.detach() - ref
    k3 = torch.exp(-d) + d - 1
    assert float(loss.detach()) == pytest.approx(float((-adv + 0.05 * k3).mean()), abs=1e-12)
    loss.backward()
    assert torch.allclose(lp.grad, (-adv + 0.05 * (1 - torch.exp(-d))) / 4, atol=1e-12)
    assert m["kl"] == pytest.approx(float(k3.mean()))
    z = torch.zeros(4, requires_grad=True)
    l0, _ = udm_grpo_loss(z, z.detach(), torch.zeros(4), 0.05)  # A = 0 and π = π_ref: no gradient
    l0.backward()
    assert float(z.grad.abs().max()) == 0
    with pytest.raises(ValueError, match="beta"):
        udm_grpo_loss(lp, ref, adv, -1.0)
    with pytest.raises(ValueError, match="logp/ref_logp/adv"):
        udm_grpo_loss(lp, ref[:2], adv, 0.05)


def test_group_advantage_hand_case():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = group_adv(r, 4)
    sd = math.sqrt(0.25 * 0.75)  # ddof = 0
    assert torch.allclose(a[:4], torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=torch.float64) / (sd + 1e-4))
    assert float(a[4:].abs().max()) == 0  # identical rewards: 0, no NaN
    assert float(group_adv(torch.tensor([1.0] + [0.0] * 99), 100).max()) == 5.0  # clipped at 5
    g = group_adv(r, 4, std="global")
    assert torch.allclose(g[:4], (r[:4].double() - 0.25) / (r.double().std(unbiased=False) + 1e-4))
    with pytest.raises(ValueError, match="non-finite"):
        group_adv(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError, match="empty"):
        group_adv(torch.tensor([]), 2)
    with pytest.raises(ValueError, match="whole groups"):
        group_adv(r, 3)


def test_quantize_round_trip_and_metrics():
    tok = torch.randint(0, 4, (5, 64))
    assert torch.equal(quantize_digits(dequantize(tok, 4), 4), tok)
    assert quantize_digits(torch.tensor([[0.0, 4.0, 5.0, 16.0]]), 4).tolist() == [[0, 0, 1, 3]]
    with pytest.raises(ValueError, match="X"):
        quantize_digits(torch.tensor([[17.0]]), 4)
    x = torch.tensor([[0, 0], [0, 1], [1, 1], [1, 1]])
    assert within_class_diversity(x, torch.tensor([0, 0, 1, 1])) == pytest.approx((0.5 + 0.0) / 2)
    assert oscillation([0, 1, 0, 1]) == pytest.approx(torch.tensor([1.0, -1.0, 1.0]).std().item())


def test_reward_classifier_and_short_run():
    data = load_digit_tokens(4)
    rew = DigitReward(data)
    assert rew.accuracy > 0.9  # on the pretraining split, which it never saw
    prob, ok = rew(data.train_x[:50], data.train_y[:50])
    assert prob.shape == (50,) and float(ok.float().mean()) > 0.8
    run = train_udm_grpo(UDMGRPOConfig(updates=2, classes=3, group=4, train_steps=4, window=2, max_start=1,
                                       compiled=False, eval_every=2, eval_per_class=2), tiny(), rew)
    h = run.history
    assert len(h) == 2 and h.loss.notna().all() and h.kl.iloc[0] == 0.0  # π = π_ref before the first step
    assert list(run.evals["update"]) == [0, 2]


def test_oscillation_controls_for_the_reward_level():
    """Pure sampling noise at two reward levels: the raw oscillation differs by the binomial noise alone (the confound
    of comparing arms at 0.63 and 0.74), the noise-scaled one is ~1 at both."""
    import numpy as np
    rng = np.random.default_rng(1)
    raw, scaled = {}, {}
    for p in (0.63, 0.74):
        r = rng.binomial(1, p, size=(3000, 10, 8)).astype(float)  # batches x prompts x group
        curve = r.mean((1, 2))
        noise = np.array([reward_sampling_var(torch.tensor(b.ravel()), 8) for b in r])
        raw[p], scaled[p] = oscillation(curve), noise_scaled_oscillation(curve, noise)
    assert raw[0.63] - raw[0.74] == pytest.approx(math.sqrt(2 * .63 * .37 / 80) - math.sqrt(2 * .74 * .26 / 80), abs=0.003)
    assert raw[0.63] - raw[0.74] > 0.004 and abs(scaled[0.63] - scaled[0.74]) < 0.06
    assert all(abs(v - 1) < 0.05 for v in scaled.values()), scaled
    assert reward_sampling_var(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2) == pytest.approx(0.0625)  # (0.5 + 0) / 2 / 4
    with pytest.raises(ValueError, match="noise_var"):
        noise_scaled_oscillation([0.1, 0.2, 0.3], [0.1, 0.1])
    with pytest.raises(ValueError, match="group"):
        reward_sampling_var(torch.ones(4), 1)


@gpu
@needs_cuda
def test_cuda_matches_cpu():
    m = tiny()
    cu = torch.device("cuda")
    logits, x, t, dt, gum, u = step_inputs(8)
    a = udm_step(logits, x, t, dt, gum, u, compiled=False)
    b = udm_step(logits.to(cu), x.to(cu), t.to(cu), dt.to(cu), gum.to(cu), u.to(cu), compiled=True)
    assert b[0].device.type == "cuda" and torch.equal(a[0], b[0].cpu())
    mc = tiny().to(cu)
    x1, st, _ = udm_sample(mc, torch.tensor([1, 2], device=cu), 4, gen=torch.Generator().manual_seed(0), compiled=True)
    assert x1.device.type == "cuda" and st.device.type == "cuda"
    assert UniformPath(4).forward_noise(x1, 0.5).device.type == "cuda"
    assert token_mean_logp(mc, x1, 0.5, x1, torch.tensor([1, 2], device=cu)).device.type == "cuda"


def test_moved_names_resolve_from_the_method_module():
    import kimi_papers.rl.udm_grpo as m
    for name in ("TinyUDM", "DigitReward", "pretrained_base"):
        with pytest.warns(DeprecationWarning, match=name):
            assert getattr(m, name) is not None
