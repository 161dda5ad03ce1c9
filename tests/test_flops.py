"""kimi_papers.core.flops beyond the notebook's checks: more shapes, whole-model decode, dtypes, CUDA SDPA."""
import pytest
import torch

from kimi_papers.core import flops as FL
from kimi_papers.core import nn as N
from kimi_papers.core import train as TR

TOL = 1e-9  # analytic and FlopCounterMode count the same matmuls: equal up to float rounding


def _close(a, b):
    return abs(a - b) <= TOL * max(abs(a), abs(b), 1.0)


CONFIGS = {
    "dense-swiglu": dict(),
    "dense-gelu-learned-tied": dict(ffn="gelu", pos="learned", norm="layer", tie=True),
    "moe-softmax-topk": dict(ffn="moe", n_experts=8, top_k=2, d_expert=24),
    "moe-topk-softmax-relu2": dict(ffn="moe", n_experts=6, top_k=3, d_expert=16, router="topk_softmax", expert_act="relu2"),
    "moe-k-equals-E": dict(ffn="moe", n_experts=4, top_k=4, d_expert=16),
}


def _cfg(**kw):
    return N.LMConfig(**{**dict(vocab=96, d_model=48, n_layers=3, n_heads=4, max_len=128, d_ff=80, attn_impl="matmul"), **kw})


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("B,T", [(1, 1), (3, 17)])
def test_forward_matches_flop_counter(name, B, T):
    torch.manual_seed(0)
    for cls in (N.CausalLM, N.MaskedLM):
        lm = cls(_cfg(**CONFIGS[name]))
        ids = torch.randint(0, 96, (B, T))
        assert _close(FL.measured_flops(lambda: lm(ids)), FL.model_cost(lm, B, T).flops), (name, cls)


@pytest.mark.parametrize("name", ["dense-swiglu", "moe-softmax-topk"])
def test_train_step_is_three_forwards(name):
    torch.manual_seed(0)
    lm = N.CausalLM(_cfg(**CONFIGS[name]))
    batch = torch.randint(0, 96, (2, 13))
    got = FL.measured_flops(lambda: TR.lm_loss(lm, batch)[0], backward=True)
    assert _close(got, FL.model_cost(lm, 2, 12).train_flops)


def test_whole_model_decode_with_kv_cache():
    torch.manual_seed(0)
    lm = N.CausalLM(_cfg()).eval()
    ids = torch.randint(0, 96, (2, 21))
    cache = lm.new_cache()
    with torch.no_grad():
        lm(ids[:, :20], cache, 0)
        got = FL.measured_flops(lambda: lm(ids[:, 20:], cache, 20))
    cost = FL.model_cost(lm, 2, 1, start=20)
    assert _close(got, cost.flops)
    assert cost.kv_bytes == 3 * 4 * 2 * 48 * 2 * 21  # layers * fp32 * (k, v) * d * batch * (20 read + 1 written)
    table = FL.cost_table(lm, 2, 1, start=20)
    assert list(table["part"]) == ["mixer", "ffn"] * 3 + ["head"] and (table["flops_bwd"] == 2 * table["flops_fwd"]).all()


def test_attention_core_by_hand():
    # B=1, T=4, d=8: projections 2*4*8*24 + 2*4*8*8 = 2048; QK^T and AV: 2 * 2 * (4*4 pairs) * 8 = 512
    assert FL.attention_cost(1, 4, 8, 2).flops == 2048 + 512
    # causal_skip counts only the 10 unmasked pairs of 16
    assert FL.attention_cost(1, 4, 8, 2, causal_skip=True).flops == 2048 + 2 * 2 * 10 * 8


def test_bytes_follow_the_dtype_and_routing():
    torch.manual_seed(0)
    moe = N.MoE(16, 8, 2, 8).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    moe(x)
    active = int((moe.last.load() > 0).sum())
    assert active <= 6
    per_expert = 16 * 16 + 8 * 16
    assert FL.module_cost(moe, 1, 3, use_routing=True).weight_bytes == 2 * (16 * 8 + active * per_expert)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="top_k=5"):
        FL.moe_cost(4, 8, 4, 5, 8)
    with pytest.raises(TypeError, match="expected a kimi_papers.core.nn CausalLM"):
        FL.cost_table(torch.nn.Linear(2, 2), 1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sdpa_is_counted_and_matches_analytic():
    torch.manual_seed(0)
    lm = N.CausalLM(_cfg(attn_impl="sdpa")).cuda()
    ids = torch.randint(0, 96, (2, 32), device="cuda")
    measured = FL.measured_flops(lambda: lm(ids))
    analytic = FL.model_cost(lm, 2, 32).flops
    assert _close(measured, analytic)  # on CUDA FlopCounterMode counts SDPA as the full T x S matmuls
    print(f"CUDA SDPA: measured {measured:.4g}, analytic {analytic:.4g}")
