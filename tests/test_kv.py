"""kimi_papers.core.kv beyond the notebook's checks: left-padded batches, decoding from a pruned cache, CUDA."""
import pytest
import torch

from kimi_papers.core import kv as KV


def needs_cuda(fn):
    """Marked `gpu` (run by `pytest -m gpu`, see bench/gpu_check.sh) and skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


def _keys_before_rope(model, ids, pos):
    got = {}
    h = model.model.layers[1].self_attn.k_proj.register_forward_hook(lambda _m, _i, o: got.setdefault("k", o))
    try:
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=pos, use_cache=True)
    finally:
        h.remove()
    g = KV.kv_geometry(model)
    return got["k"].view(*ids.shape, g.kv_heads, g.head_dim).transpose(1, 2), KV.cache_layers(out.past_key_values)[1][0]


def test_rope_roundtrip_on_layer1_with_large_positions():
    m = KV.tiny_llama(layers=2, seed=3, rope_theta=500.0)
    ids = torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)[None] + torch.tensor([[0], [100], [731]])
    raw, cached = _keys_before_rope(m, ids, pos)
    cos, sin = KV.rope_cos_sin(m, pos)
    torch.testing.assert_close(KV.rope_apply(raw, cos, sin), cached, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(KV.rope_undo(KV.rope_apply(raw, cos, sin), cos, sin), raw, rtol=1e-5, atol=1e-5)


def test_pruned_cache_equals_masked_full_cache():
    """Decoding from a cache that keeps tokens {0, 2, 5} (original positions) equals attending to the full cache with the
    other keys masked out: the token-extractive eviction identity the serving papers rely on."""
    m = KV.tiny_llama(seed=0)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([0, 2, 5])
    with torch.no_grad():
        full = m(input_ids=ids[:, :6], use_cache=True).past_key_values
        pruned = KV.make_cache(KV.select_tokens(KV.cache_layers(full), keep))
        held = KV.kv_bytes(pruned)
        a = m(input_ids=ids[:, 6:], position_ids=torch.tensor([[6]]), cache=pruned,
              attention_mask=torch.ones(1, 4, dtype=torch.long)).logits
        mask = torch.full((1, 1, 1, 7), float("-inf"))
        mask[..., keep], mask[..., 6] = 0.0, 0.0
        full2 = m(input_ids=ids[:, :6], use_cache=True).past_key_values
        b = m(input_ids=ids[:, 6:], position_ids=torch.tensor([[6]]), cache=full2, attention_mask=mask).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert held == 3 * KV.kv_bytes_per_token(m, torch.float32)


@needs_cuda
def test_kv_on_cuda():
    m = KV.tiny_llama(seed=0).cuda()
    ids = torch.randint(0, 256, (2, 5), device="cuda")
    pos = torch.arange(5, device="cuda")[None].repeat(2, 1)
    raw, cached = _keys_before_rope(m, ids, pos)
    cos, sin = KV.rope_cos_sin(m, pos)
    assert cos.device.type == "cuda"
    torch.testing.assert_close(KV.rope_apply(raw, cos, sin), cached, rtol=1e-4, atol=1e-4)
    sel = KV.select_tokens(KV.cache_layers(KV.make_cache([(cached, cached)])), torch.tensor([4, 1]))
    assert sel[0][0].device.type == "cuda" and sel[0][0].shape[2] == 2
