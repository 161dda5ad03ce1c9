"""kimi_papers.core.nn beyond the notebook's checks: CUDA, analytic FLOPs in train()."""
import itertools
import math

import numpy as np
import pytest
import torch

from kimi_papers.core import flops as FL
from kimi_papers.core import nn as N
from kimi_papers.core import train as TR

def needs_cuda(fn):
    """Marked `gpu` (run by `pytest -m gpu`, see bench/gpu_check.sh) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))

SPEC_KEYS = ((".n1.", ".norm1."), (".attn.", ".mixer."), (".n2.", ".norm2."), (".moe.", ".ffn."))


def spec_md_config(**kw) -> N.LMConfig:
    """The LMConfig that expresses spec_md's TinyMoE (OLMoE-style: RMSNorm, interleaved RoPE, SDPA, softmax-top-k)."""
    base = dict(vocab=256, d_model=64, n_layers=3, n_heads=4, max_len=128, ffn="moe", n_experts=8, top_k=2,
                d_expert=32, expert_act="swiglu", router="softmax_topk", renormalize=False, norm="rms", pos="rope",
                rope_style="interleaved", attn_impl="sdpa", tie=False)
    return N.LMConfig(**{**base, **kw})


# spec_md now builds on core.nn: its equality with the old TinyMoE is proved in tests/test_spec_md.py against a
# fixture recorded from the old code (tests/fixtures/spec_md_tinymoe_ref.npz).


def test_train_counts_analytic_flops_and_tokens():
    cfg = N.LMConfig(vocab=256, d_model=32, n_layers=2, n_heads=2, max_len=64, d_ff=64, ffn="moe", n_experts=4,
                     top_k=2, d_expert=16)
    torch.manual_seed(0)
    lm = N.CausalLM(cfg)
    batch = next(TR.stdlib_corpus(100_000).batches(3, 20, seed=0))
    res = TR.train(lm, itertools.repeat(batch), 5, log_every=2)
    assert res.flops == 5 * FL.model_cost(lm, 3, 20).train_flops and res.tokens == 5 * 3 * 20
    assert res.history["step"].tolist() == [0, 2, 4] and (res.history["lb"] > 0).all()


def test_masked_lm_learns_and_masks():
    cfg = N.LMConfig(vocab=256, d_model=32, n_layers=2, n_heads=2, max_len=64, d_ff=64)
    torch.manual_seed(0)
    mlm = N.MaskedLM(cfg)
    batch = next(TR.stdlib_corpus(100_000).batches(4, 32, seed=0))[:, :32]
    g = torch.Generator().manual_seed(0)
    res = TR.train(mlm, itertools.repeat(batch), 40, lr=1e-2, schedule="constant",
                  loss_fn=lambda m, b: TR.masked_lm_loss(m, b, 0.3, g))
    assert res.final_loss < 0.5 * res.history["loss"].iloc[0]
    assert res.tokens == 40 * 4 * 32 and res.flops == 40 * FL.model_cost(mlm, 4, 32).train_flops
    with pytest.raises(ValueError, match="mask_prob"):
        TR.masked_lm_loss(mlm, batch, 0.0)


def test_custom_mixer_plugs_in_and_is_counted():
    class ShiftMixer(torch.nn.Module):  # a causal token-shift mixer: y_t = W x_{t-1}
        def __init__(self, d):
            super().__init__()
            self.w = torch.nn.Linear(d, d, bias=False)

        def forward(self, x, cache=None, start=0):
            return self.w(torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1])

    cfg = N.LMConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, max_len=64, d_ff=48)
    lm = N.CausalLM(cfg, mixer=lambda c, i: ShiftMixer(c.d_model), ffn=lambda c, i: None if i == 0 else N.MLP(c.d_model, 48))
    assert lm.layers[0].ffn is None and lm.layers[0].norm2 is None
    ids = torch.randint(0, 64, (2, 10))
    with pytest.raises(TypeError, match="ShiftMixer"):
        FL.model_cost(lm, 2, 10)
    FL.register_cost(ShiftMixer)(lambda m, b, t, s, r: FL.linear_cost(b * t, 32, 32))
    assert FL.model_cost(lm, 2, 10).flops == FL.measured_flops(lambda: lm(ids))


@needs_cuda
def test_gpu_blocks_match_cpu_and_cache_decodes():
    cfg = N.LMConfig(vocab=64, d_model=64, n_layers=2, n_heads=4, max_len=64, ffn="moe", n_experts=8, top_k=2, d_expert=32)
    torch.manual_seed(0)
    cpu = N.CausalLM(cfg).eval()
    gpu = N.CausalLM(cfg).cuda().eval()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        full = gpu(ids.cuda())
        assert torch.allclose(full.cpu(), cpu(ids), atol=1e-4)
        cache = gpu.new_cache()
        inc = torch.cat([gpu(ids[:, :16].cuda(), cache, 0)] + [gpu(ids[:, t:t + 1].cuda(), cache, t) for t in range(16, 24)], 1)
        assert torch.allclose(inc, full, atol=1e-4) and cache[0]["k"].device.type == "cuda"
    res = TR.train(gpu, TR.stdlib_corpus(100_000).batches(4, 32, device="cuda"), 3)
    assert math.isfinite(res.final_loss)
    loss, _ = TR.masked_lm_loss(N.MaskedLM(cfg).cuda(), ids.cuda(), 0.3, None)
    assert loss.device.type == "cuda"


def test_progress_bar_quiet_headless_and_shown_on_request(capfd):
    cfg = N.LMConfig(vocab=256, d_model=16, n_layers=1, n_heads=2, max_len=32, d_ff=16)
    batch = next(TR.stdlib_corpus(50_000).batches(2, 8, seed=0))
    TR.train(N.CausalLM(cfg), itertools.repeat(batch), 3, count_flops=False)  # KIMI_PAPERS_HEADLESS=1 (conftest)
    assert "train" not in capfd.readouterr().err
    TR.train(N.CausalLM(cfg), itertools.repeat(batch), 3, count_flops=False, progress=True, desc="visible-bar")
    assert "visible-bar" in capfd.readouterr().err


def test_bad_arguments_name_the_parameter():
    lm = N.CausalLM(N.LMConfig(vocab=256, d_model=16, n_layers=1, n_heads=2, max_len=32, d_ff=16))
    batch = torch.zeros(1, 9, dtype=torch.long)
    for kw, match in [(dict(steps=0), "steps=0"), (dict(schedule="linear"), "schedule='linear'"),
                      (dict(warmup=0.9, decay=0.2, schedule="wsd"), "warmup=0.9, decay=0.2")]:
        with pytest.raises(ValueError, match=match):
            TR.train(lm, itertools.repeat(batch), **{"steps": 2, **kw})
    with pytest.raises(ValueError, match="top_k=3"):
        N.MoE(8, 2, 3, 4)
    with pytest.raises(ValueError, match="impl='flash'"):
        N.Attention(8, 2, impl="flash")
    with pytest.raises(ValueError, match="cache: expected 1 per-layer"):
        lm(batch, cache=[{}, {}])


def test_unregistered_block_flops_measured_on_the_first_step_without_side_effects():
    class Mean(torch.nn.Module):  # causal running-mean mixer, no FLOP count registered
        def __init__(self, d):
            super().__init__()
            self.w = torch.nn.Linear(d, d, bias=False)

        def forward(self, x, cache=None, start=0):
            return self.w(x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None])

    cfg = N.LMConfig(vocab=256, d_model=16, n_layers=2, n_heads=2, max_len=32, d_ff=24)
    batch = next(TR.stdlib_corpus(50_000).batches(2, 12, seed=0))
    runs = []
    for count in (True, False):
        torch.manual_seed(0)
        lm = N.CausalLM(cfg, mixer=lambda c, i: Mean(c.d_model))
        runs.append((lm, TR.train(lm, itertools.repeat(batch), 3, count_flops=count)))
    (a, ra), (b, rb) = runs
    # counting runs step 0 under FlopCounterMode (its dispatch may change the last bit), nothing else differs
    assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(a.parameters(), b.parameters()))
    torch.manual_seed(0)
    fresh = N.CausalLM(cfg, mixer=lambda c, i: Mean(c.d_model))
    one = FL.measured_flops(lambda: TR.lm_loss(fresh, batch)[0], backward=True)
    assert one > 0 and ra.flops == 3 * one and np.isnan(rb.flops)
