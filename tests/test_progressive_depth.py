"""kimi_papers.architectures.progressive_depth as a library: expansion, Muon-NSGD, FLOP accounting, train_run's errors."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from kimi_papers.architectures.progressive_depth import (GPT, GPTConfig, MuonNSGD, cosine_lr, expand_depth,
                                                         flops_per_token, mup_init_, new_parameters, newton_schulz5,
                                                         newton_schulz5_compiled, ns_iterations_compiled, orthogonalize_all,
                                                         step_flops, wsd_lr)
from kimi_papers.architectures.progressive_depth_experiment import (History, LossGuard, matched_steps, mixing_time,
                                                                    stdlib_bytes, train_run)
from kimi_papers.core.kernels import compiled_ran
from kimi_papers.core.train import Corpus, lm_loss

CUDA = torch.cuda.is_available()
TINY = GPTConfig(d=32, n_head=2, n_layer=1, ctx=16)


def tiny_corpus(n: int = 20_000) -> Corpus:
    rng = np.random.default_rng(0)
    text = rng.integers(97, 110, n).astype(np.uint8)
    return Corpus(text, text[: n // 4].copy(), 256, "synthetic", "none")


def n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_expanded_model_has_the_fresh_models_parameter_count_and_shares_the_old_ones():
    src = GPT(TINY)
    for init in ("copy_stack", "copy_inter", "random", "zero"):
        big = expand_depth(src, 4, init)
        assert n_params(big) == n_params(GPT(TINY.with_depth(4)))
        assert big.emb is src.emb and big.norm is src.norm and big.layers[0] is src.layers[0]
        assert len(new_parameters(src, big)) == 3 * len(list(src.layers[0].parameters()))


def test_copy_stack_copies_values_into_distinct_tensors():
    src = GPT(TINY)
    big = expand_depth(src, 3, "copy_stack")
    for layer in big.layers[1:]:
        for a, b in zip(src.layers[0].parameters(), layer.parameters()):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_copy_inter_repeats_each_block_in_place():
    src = expand_depth(GPT(TINY), 2, "random")
    big = expand_depth(src, 6, "copy_inter")
    w = [layer.mixer.qkv.weight for layer in big.layers]
    assert all(torch.equal(w[i], src.layers[0].mixer.qkv.weight) for i in range(3))
    assert all(torch.equal(w[i], src.layers[1].mixer.qkv.weight) for i in range(3, 6))
    assert not torch.equal(w[0], w[3])


def test_zero_init_is_function_preserving_and_random_is_not():
    src = GPT(TINY, torch.Generator().manual_seed(0))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = src(ids)
        assert torch.allclose(expand_depth(src, 4, "zero")(ids), ref, atol=1e-6)
        assert not torch.allclose(expand_depth(src, 4, "random")(ids), ref, atol=1e-3)


def test_expand_depth_bad_inputs():
    src = GPT(TINY)
    with pytest.raises(ValueError, match="n_layer"):
        expand_depth(src, 1)
    with pytest.raises(ValueError, match="0-layer"):
        expand_depth(GPT(TINY.with_depth(0)), 3, "copy_stack")
    with pytest.raises(ValueError, match="init"):
        expand_depth(src, 3, "teleport")
    with pytest.raises(TypeError, match="GPT"):
        expand_depth(torch.nn.Linear(2, 2), 3)


def test_mup_init_std_follows_the_spectral_rule():
    for fan_out, fan_in in ((512, 128), (128, 512)):
        lin = mup_init_(torch.nn.Linear(fan_in, fan_out), torch.Generator().manual_seed(0))
        want = min(1.0, math.sqrt(fan_out / fan_in)) / math.sqrt(fan_in)
        assert lin.weight.std().item() == pytest.approx(want, rel=0.02)
    with pytest.raises(TypeError, match="Linear"):
        mup_init_(torch.nn.Conv1d(2, 2, 1))


def test_zero_layer_model_trains_its_embedding():
    m = GPT(TINY.with_depth(0))
    loss, _ = lm_loss(m, torch.randint(0, 256, (2, 17)))
    loss.backward()
    assert m.emb.weight.grad.abs().sum() > 0 and m.norm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("shape", [(128, 512), (512, 128), (96, 64)])
def test_newton_schulz_orthogonalises_along_the_singular_vectors(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = newton_schulz5(G)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    core = U.mT @ X @ Vh.mT                       # diagonal when X = U f(S) Vᵀ
    off = core - torch.diag_embed(torch.diagonal(core))
    assert off.abs().max() < 1e-8
    s = torch.linalg.svdvals(X)
    assert 0.6 <= s.min() and s.max() <= 1.25


def test_newton_schulz_batched_equals_per_matrix_and_bad_inputs():
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g), torch.randn(64, 32, generator=g)]
    for a, b in zip(orthogonalize_all(mats), orthogonalize_all(mats, batched=False)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="G"):
        newton_schulz5(torch.randn(5))
    with pytest.raises(ValueError, match="steps"):
        newton_schulz5(torch.randn(4, 4), steps=0)


@pytest.mark.slow
def test_compiled_newton_schulz_equals_eager():
    g = torch.Generator().manual_seed(0)
    for shape in ((128, 512), (512, 128), (6, 128, 512)):
        G = torch.randn(shape, generator=g)
        torch.testing.assert_close(newton_schulz5_compiled(G), newton_schulz5(G), rtol=1e-4, atol=1e-5)
        assert compiled_ran(ns_iterations_compiled)


def test_nsgd_first_step_by_hand_and_weight_decay_on_matrices_only():
    m = GPT(TINY)
    opt = MuonNSGD(m, lr=0.1, weight_decay=0.5)
    kinds = {g["kind"]: g["params"] for g in opt.param_groups}
    assert any(p is m.layers[0].mixer.qkv.weight for p in kinds["muon"])
    assert any(p is m.emb.weight for p in kinds["nsgd"]) and any(p is m.norm.bias for p in kinds["nsgd"])
    gain = m.norm.weight
    before_gain, before_emb = gain.detach().clone(), m.emb.weight.detach().clone()
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    gain.grad = torch.arange(1.0, 33.0)
    m.emb.weight.grad = None
    opt.step()
    d = 1.95 * gain.grad                           # Nesterov on the first step: g + 0.95 * (0.95*0 + g)
    want = before_gain - 0.1 * 0.2 * math.sqrt(32) * d / d.norm()   # no decay on a gain
    torch.testing.assert_close(gain.detach(), want)
    assert torch.equal(m.emb.weight.detach(), before_emb)          # no grad: untouched (not even decayed)
    w = m.layers[0].mixer.out.weight
    assert opt.state[w]["momentum"].abs().sum() == 0               # zero grad: only decay moved it


def test_muon_update_has_the_stated_rms():
    lin = torch.nn.Module()
    lin.layers = torch.nn.ModuleList([torch.nn.Linear(64, 192, bias=False)])
    opt = MuonNSGD(lin, lr=1.0, weight_decay=0.0)
    w0 = lin.layers[0].weight.detach().clone()
    lin.layers[0].weight.grad = torch.randn(192, 64, generator=torch.Generator().manual_seed(0))
    opt.step()
    step = lin.layers[0].weight.detach() - w0
    rms = step.pow(2).mean().sqrt().item()
    assert 0.2 * 0.7 <= rms <= 0.2 * 1.25          # 0.2 * sqrt(max) * ||NS||_F / sqrt(numel), NS singular values ~[0.7, 1.2]


def test_expansion_does_not_alias_optimizer_state_between_copies():
    src = GPT(TINY)
    opt = MuonNSGD(src, lr=0.01)
    loss, _ = lm_loss(src, torch.randint(0, 256, (2, 17)))
    loss.backward()
    opt.step()
    big = expand_depth(src, 3, "copy_stack")
    assert opt.add_params(big) == len(new_parameters(src, big))
    assert opt.add_params(big) == 0
    w1, w2 = big.layers[1].mixer.qkv.weight, big.layers[2].mixer.qkv.weight
    before2 = w2.detach().clone()
    for p in big.parameters():
        p.grad = None
    w1.grad = torch.randn_like(w1)
    opt.step()
    assert not torch.equal(w1, before2) and torch.equal(w2.detach(), before2)
    assert "momentum" not in opt.state[w2] and opt.state[w1]["momentum"] is not opt.state[src.layers[0].mixer.qkv.weight]["momentum"]


def test_flops_match_a_hand_count_and_the_paper_ratio():
    cfg = GPTConfig(d=64, n_head=4, n_layer=6, ctx=64)
    d, T = 64, 64
    per_layer_fwd = 2 * T * (d * 3 * d + d * d + d * 4 * d + 4 * d * d) + 2 * 2 * T * T * d
    assert flops_per_token(cfg) == pytest.approx(3 * 6 * per_layer_fwd / T, rel=1e-12)
    head = 3 * 2 * T * d * 256
    assert flops_per_token(cfg, "total") == pytest.approx((3 * 6 * per_layer_fwd + head) / T, rel=1e-12)
    assert flops_per_token(cfg.with_depth(0)) == 0.0
    ratio = (0.8 * flops_per_token(cfg.with_depth(1)) + 0.2 * flops_per_token(cfg)) / flops_per_token(cfg)
    assert ratio == pytest.approx(0.8 / 6 + 0.2, abs=1e-12)
    assert matched_steps(ratio * 100 * 16 * 64 * flops_per_token(cfg), cfg, 16) == round(ratio * 100)
    with pytest.raises(ValueError, match="convention"):
        flops_per_token(cfg, "params")
    with pytest.raises(ValueError, match="flops"):
        matched_steps(1.0, cfg.with_depth(0), 16)


def test_schedules_clamp_after_T_and_reject_bad_fractions():
    assert wsd_lr(0, 100, 1.0) == pytest.approx(0.5) and wsd_lr(50, 100, 1.0) == 1.0
    assert wsd_lr(95, 100, 1.0) == pytest.approx(0.5) and wsd_lr(100, 100, 1.0) == 0.0 and wsd_lr(150, 100, 1.0) == 0.0
    assert cosine_lr(150, 100, 1.0) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="warmup"):
        wsd_lr(0, 100, 1.0, warmup=0.5, decay=0.6)


def test_train_run_accounting_and_determinism():
    data = tiny_corpus()
    kw = dict(data=data, batch=2, lr=0.01, eval_every=5, eval_batches=1)
    a = train_run(TINY, 3, 20, 0.8, "copy_stack", seed=3, **kw)
    b = train_run(TINY, 3, 20, 0.8, "copy_stack", seed=3, **kw)
    assert a.final_val_loss == b.final_val_loss and a.taus == [16] and a.depths == [1, 3]
    one, three = (step_flops(GPT(TINY.with_depth(k)), 2, 16) for k in (1, 3))
    assert a.flops == pytest.approx(16 * one + 4 * three, rel=1e-12)
    assert a.flops_train_loop == pytest.approx(a.flops_total, rel=1e-12)
    ev = a.evals
    assert ev[ev.step == 16].phase.tolist() == ["pre", "post"] and ev.step.max() == 20
    assert a.val_at(16) == float(ev[(ev.step == 16) & (ev.phase == "post")].val_loss.iloc[0])
    fixed = train_run(TINY, 3, 20, seed=3, **kw)
    assert fixed.taus == [] and fixed.depths == [3] and fixed.flops == pytest.approx(20 * three, rel=1e-12)


def test_train_run_bad_inputs():
    data = tiny_corpus()
    for tau in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="tau_frac"):
            train_run(TINY, 3, 20, tau, data=data)
    with pytest.raises(ValueError, match="0-layer"):
        train_run(TINY.with_depth(0), 3, 20, 0.8, "copy_stack", data=data)
    with pytest.raises(ValueError, match="depth"):
        train_run(TINY, 1, 20, 0.8, data=data)
    short = Corpus(np.zeros(10, np.uint8), np.zeros(10, np.uint8), 256, "short", "none")
    with pytest.raises(ValueError, match="ctx"):
        train_run(TINY, 3, 20, 0.8, data=short)
    with pytest.raises(ValueError, match="warmup"):
        train_run(TINY, 3, 20, 0.8, data=data, warmup=0.5, decay=0.6)
    with pytest.raises(ValueError, match="schedule"):
        train_run(TINY, 3, 20, 0.8, data=data, schedule="step")


def test_non_finite_loss_names_step_and_phase():
    m = GPT(TINY)
    with torch.no_grad():
        m.layers[0].ffn.up.weight.fill_(float("inf"))
    guard = LossGuard(tau=10, lr_at=lambda s: 0.5)
    batch = torch.randint(0, 256, (2, 17))
    with pytest.raises(FloatingPointError, match=r"step 0 \(pre-expansion, 1 layers, lr 0.5\)"):
        guard(m, batch)
    guard.step = 12
    with pytest.raises(FloatingPointError, match=r"step 12 \(post-expansion"):
        guard(m, batch)
    with pytest.raises(FloatingPointError, match="fixed depth"):
        LossGuard(None)(m, batch)


def test_mixing_time_on_a_hand_made_pair():
    def hist(losses, taus):
        ev = pd.DataFrame(dict(step=[0, 10, 20, 30, 40], phase="", val_loss=losses, flops_nonembedding=0.0, flops_total=0.0))
        return History(ev, pd.DataFrame(), taus, [1, 6] if taus else [6], 40, 0.0, 0.0)
    fixed = hist([5.0, 3.0, 2.5, 2.2, 2.0], [])
    prog = hist([5.0, 3.2, 3.0, 2.3, 2.01], [10])
    assert mixing_time(prog, fixed) == 30                      # 2.01 <= 1.01 * 2.0 at step 40; 2.3 > 2.222 at 30
    assert mixing_time(prog, fixed, tol=0.05) == 20            # 2.3 <= 2.31 at step 30
    assert mixing_time(hist([5, 9, 9, 9, 9], [10]), fixed) is None
    with pytest.raises(ValueError, match="progressive"):
        mixing_time(fixed, fixed)


def test_stdlib_bytes_slices_the_corpus():
    a, b = stdlib_bytes(100), stdlib_bytes(50, offset=50)
    assert a.dtype == torch.uint8 and a.shape == (100,) and torch.equal(a[50:], b)
    with pytest.raises(ValueError, match="n_bytes"):
        stdlib_bytes(0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_train_run_and_newton_schulz_on_cuda():
    G = torch.randn(6, 128, 512, device="cuda")
    torch.testing.assert_close(newton_schulz5(G).cpu(), newton_schulz5(G.cpu()), rtol=1e-3, atol=1e-4)
    h = train_run(TINY, 3, 10, 0.8, data=tiny_corpus(), batch=2, eval_every=5, eval_batches=1, device="cuda")
    assert math.isfinite(h.final_val_loss)


def test_moved_names_resolve_from_the_method_module():
    import kimi_papers.architectures.progressive_depth as m
    for name in ("train_run", "History", "mixing_time"):
        with pytest.warns(DeprecationWarning, match=name):
            assert getattr(m, name) is not None
