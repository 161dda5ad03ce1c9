"""Unit tests of kimi_papers.serving.semantic_cache_distill on tiny random Llamas (core.kv): identities, hand-checked
cases and bad input. The compiled-kernel test is marked slow; a CUDA twin runs where a GPU exists."""
import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from kimi_papers.core.kv import cache_layers, kv_geometry, rope_apply, rope_cos_sin, rope_undo, tiny_llama
from kimi_papers.core.nn import LoRALinear, add_lora, apply_lora_factors, lora_factors, merge_lora
from kimi_papers.serving.semantic_cache_distill import (
    SCD, Payload, ReuseCodec, capture, collect_calibration, consumer_logits, droidspeak_style, efficiency_k,
    encode_reuse, fake_quant, fit_lowrank, fit_patch, fit_reuse, greedy_select, kl_per_token, kv_from_hidden,
    quantize_kv_4bit, raw_kv_transfer, reconstruct_reuse)
from kimi_papers.serving.semantic_cache_distill_experiment import (
    Pair, answer_f1, byte_codec, method_bytes, qa_prompts, run_seed, smollm2_pair, ttft_model)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def models():
    return tiny_llama(layers=3, seed=0), tiny_llama(layers=3, seed=1)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def calib(models, ids):
    return collect_calibration(*models, [ids[0], ids[1]])


def test_lora_identity_merge_and_factor_roundtrip():
    lin = nn.Linear(6, 5)
    x = torch.randn(3, 6)
    lo = LoRALinear(lin, 2, 4.0, torch.Generator().manual_seed(0))
    assert torch.equal(lo(x), lin(x))
    with torch.no_grad():
        lo.B.normal_()
    torch.testing.assert_close(lo.merged()(x), lo(x))
    torch.testing.assert_close(lo(x) - lin(x), 2.0 * x @ lo.A.T @ lo.B.T)
    m = tiny_llama(layers=2, seed=3)
    fresh = copy.deepcopy(m)
    adapters = add_lora(m, rank=4, alpha=8.0)
    assert len(adapters) == 2 * 7
    for a in adapters:
        with torch.no_grad():
            a.B.normal_(std=0.02)
    fac = lora_factors(m)
    merge_lora(m)
    apply_lora_factors(fresh, fac, alpha=8.0)
    x = torch.randint(0, 256, (1, 9))
    torch.testing.assert_close(fresh(x).logits, m(x).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rank"):
        LoRALinear(lin, 6, 1.0)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        apply_lora_factors(tiny_llama(layers=1), {"model.nope.A": torch.zeros(1, 1), "model.nope.B": torch.zeros(1, 1)})


def test_qa_items_and_f1():
    assert answer_f1("The Teal.", "teal") == 1.0 and answer_f1("dark teal", "teal") == pytest.approx(2 / 3)
    assert answer_f1("", "") == 1.0 and answer_f1("x", "teal") == 0.0
    items = qa_prompts(4, 3)
    assert [i.prompt for i in items] == [i.prompt for i in qa_prompts(4, 3)]
    for it in items:
        assert it.prompt.endswith("Answer:") and it.continuation.startswith(f" {it.answer}\n")
        assert it.answer in it.prompt.split("\nQuestion:")[0]


def test_capture_matches_forward_and_rope_roundtrip(models, ids):
    a, _ = models
    t = capture(a, ids)
    ref = a(input_ids=ids, use_cache=True)
    ref = getattr(ref, "cache", None) or ref.past_key_values
    assert all(torch.equal(k, rk) for k, (rk, _) in zip(t.keys, cache_layers(ref)))
    torch.testing.assert_close(t.h_in[1], a.model.layers[1].input_layernorm(t.resid[1]))
    cos, sin = rope_cos_sin(a, t.position_ids)
    torch.testing.assert_close(rope_apply(rope_undo(t.keys[2], cos, sin), cos, sin), t.keys[2], atol=1e-6, rtol=1e-6)


def test_lowrank_full_rank_recovers_linear_map():
    g = torch.Generator().manual_seed(0)
    xa = torch.randn(300, 8, generator=g)
    M = torch.randn(8, 6, generator=g)
    enc, _, dec_b = fit_lowrank(xa, xa @ M, 8, ridge=1e-9)
    torch.testing.assert_close(xa @ enc @ dec_b, xa @ M, atol=1e-3, rtol=1e-3)
    errs = []
    X = torch.cat([xa, xa @ M + 0.1 * torch.randn(300, 6, generator=g)], 1)
    sv = torch.linalg.svdvals(X.double())
    for r in (1, 3, 6, 8):
        _, da, db = fit_lowrank(X[:, :8], X[:, 8:], r)
        dec = torch.cat([da, db], 1)
        errs.append((X @ dec.T @ dec - X).norm().item())
        assert errs[-1] == pytest.approx(sv[r:].square().sum().sqrt().item(), rel=1e-4)   # Eckart-Young
    assert errs == sorted(errs, reverse=True) and errs[-1] < errs[0]


def test_patch_with_oracle_input_is_exact(models, ids):
    _, b = models
    t = capture(b, ids)
    cos, sin = rope_cos_sin(b, t.position_ids)
    for l in range(3):
        k, v = kv_from_hidden(b, l, t.h_in[l], cos, sin)
        torch.testing.assert_close(k, t.keys[l], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v, t.values[l], atol=1e-6, rtol=1e-6)


def test_reuse_kernel_equals_per_layer_loop_and_identity_codec(models):
    a, _ = models
    L, T, H, hd = 3, 7, 2, 16
    zk, zv = torch.randn(L, 1, T, 5), torch.randn(L, 1, T, 6)
    dk, dv = torch.randn(L, 5, H * hd), torch.randn(L, 6, H * hd)
    pos = torch.arange(3, 3 + T)[None]
    cos, sin = rope_cos_sin(a, pos)
    K, V = reconstruct_reuse(zk, dk, zv, dv, cos, sin)
    for l in range(L):
        k = (zk[l] @ dk[l]).view(1, T, H, hd).transpose(1, 2)
        torch.testing.assert_close(K[l], rope_apply(k, cos, sin), atol=1e-5, rtol=1e-5)
    eye = torch.eye(H * hd).expand(L, -1, -1)
    K2, _ = reconstruct_reuse(*[x for pair in zip(encode_reuse(K, V, eye, eye, cos, sin), (eye, eye)) for x in pair], cos, sin)
    torch.testing.assert_close(K2, K, atol=2e-2, rtol=2e-3)


def test_baselines_with_identical_models(models, ids):
    _, b = models
    t = capture(b, ids)
    oracle = list(zip(t.keys, t.values))
    tail = torch.randint(0, 256, (2, 5))
    ref = consumer_logits(b, oracle, tail, 20)
    torch.testing.assert_close(ref, b(input_ids=torch.cat([ids, tail], 1)).logits[:, 20:], atol=1e-5, rtol=1e-5)
    assert kl_per_token(ref, consumer_logits(b, raw_kv_transfer(t), tail, 20)).max() < 1e-4
    dr = droidspeak_style(b, t, 1, 2)
    assert kl_per_token(ref, consumer_logits(b, dr, tail, 20)).max() < 1e-4
    q = quantize_kv_4bit(oracle)
    assert all(qk.shape == k.shape for (qk, _), (k, _) in zip(q, oracle))


def test_fake_quant_bounds():
    x = torch.randn(2, 3, 37, 8)
    d = fake_quant(x, 2, 32)
    span = x[:, :, :32].amax(2, keepdim=True) - x[:, :, :32].amin(2, keepdim=True)
    assert d.shape == x.shape and ((d[:, :, :32] - x[:, :, :32]).abs() <= span / 30 + 1e-6).all()
    lv = torch.arange(16.).repeat(2)[None, None, :, None]
    torch.testing.assert_close(fake_quant(lv, 2, 32), lv)


def test_payload_accounting_and_ttft(models, ids, calib):
    a, b = models
    reuse = {l: fit_reuse(calib, l, 6, 8) for l in range(3)}
    patch = {l: fit_patch(calib, l, 12, hidden=16, steps=5) for l in range(3)}
    geo = kv_geometry(b)
    for kp in ([], [2], [0, 1, 2]):
        p = SCD(b, reuse, patch, kp).encode(capture(a, ids))
        assert p.nbytes == 2 * method_bytes("scd", 20, geo, 64, 6, 8, 12, len(kp))
    assert method_bytes("scd", 1, geo, 64, 6, 8, 12, 1) == 2 * (2 * 14 + 12)
    assert method_bytes("droidspeak", 1, geo, 64, width=1) == 2 * 2 * 32 * 2 + 64 * 2
    assert ttft_model(1e9, 8.0, 0.5, 3.0)["speedup"] == 2.0


def test_selection_rules():
    gain = {0: 0.1, 1: 0.5, 2: 0.3}
    order, curve = greedy_select(lambda S: 1.0 - sum(gain[l] for l in S), [0, 1, 2], 2)
    assert order == [1, 2] and curve == pytest.approx([1.0, 0.5, 0.2])
    assert efficiency_k(curve) == 1 and efficiency_k([1.0, 0.95, 0.3]) == 2


def test_run_seed_end_to_end(models):
    a, _ = models
    pair = Pair(a, copy.deepcopy(a), byte_codec())          # A = B: every transfer is (nearly) exact
    cfg = dict(n_calib=2, calib_len=40, r_k=8, r_v=8, r_h=16, patch_hidden=16, patch_steps=5, n_profile=1, profile_ctx=16,
               profile_tail=4, k=1, k_max=1, width=1, n_eval=2, n_cont=6, max_new=2, ks=(0, 1), error_prompts=1)
    res = run_seed(pair, 0, cfg)
    tab = res["table"].groupby("arm").kl.mean()
    assert tab["oracle"] == 0.0 and tab["raw"] < 1e-3 and tab["droidspeak"] < 1e-3
    assert {"kivi4", "scd_k0", "scd_k1", "scd", "oracle_patch", "producer_A"} <= set(tab.index)
    f1 = res["table"].groupby("arm").f1.mean()
    assert f1["oracle"] == f1["producer_A"]                 # the same model answers the same


def test_bad_inputs(models, ids, calib):
    a, b = models
    with pytest.raises(ValueError, match="same architecture"):
        collect_calibration(a, tiny_llama(layers=2), [ids[0]])
    with pytest.raises(ValueError, match="empty"):
        capture(a, ids[:, :0])
    with pytest.raises(ValueError, match="rank"):
        fit_reuse(calib, 0, 0, 4)
    with pytest.raises(ValueError, match="rank=33"):
        fit_reuse(calib, 0, 33, 4)
    with pytest.raises(ValueError, match="r_h=65"):
        fit_patch(calib, 0, 65)
    with pytest.raises(ValueError, match="rows N=40 < rank"):
        fit_lowrank(calib.ha[0], calib.hb[0], 50)
    with pytest.raises(ValueError, match="ridge"):
        fit_lowrank(calib.ka[0], calib.kb[0], 4, ridge=0.0)
    with pytest.raises(ValueError, match="layer=5"):
        fit_reuse(calib, 5, 4, 4)
    bad = copy.deepcopy(calib)
    bad.kb[1][3, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        fit_reuse(bad, 1, 4, 4)
    reuse = {l: fit_reuse(calib, l, 4, 4) for l in range(3)}
    with pytest.raises(ValueError, match="layer index"):
        SCD(b, reuse, {}, [7])
    with pytest.raises(ValueError, match="no PatchCodec"):
        SCD(b, reuse, {}, [1])
    with pytest.raises(ValueError, match="bw_gbps"):
        ttft_model(1.0, -1.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="seq_len=256"):
        smollm2_pair(seq_len=256)
    with pytest.raises(ValueError, match="method"):
        method_bytes("zip", 1, kv_geometry(b), 64)


@pytest.mark.slow
def test_compiled_reconstruction_equals_eager():
    from kimi_papers.core.kernels import compile_fn, compiled_ran
    fn = compile_fn(reconstruct_reuse)
    m = tiny_llama(d=256, heads=4, kv_heads=1, layers=1)
    cos, sin = rope_cos_sin(m, torch.arange(32)[None])
    args = (torch.randn(4, 1, 32, 16), torch.randn(4, 16, 128), torch.randn(4, 1, 32, 24), torch.randn(4, 24, 128), cos, sin)
    for x, y in zip(fn(*args), reconstruct_reuse(*args)):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    assert compiled_ran(fn)


@pytest.mark.gpu
def test_scd_on_cuda(models, ids, calib):
    a, b = (copy.deepcopy(m).cuda() for m in models)
    reuse = {l: ReuseCodec(l, *(t.cuda() for t in (c.enc_k, c.dec_k, c.enc_v, c.dec_v)))
             for l, c in ((l, fit_reuse(calib, l, 6, 8)) for l in range(3))}
    scd = SCD(b, reuse, {})
    layers = scd.decode(scd.encode(capture(a, ids.cuda())))
    assert layers[0][0].is_cuda
    out = consumer_logits(b, layers, torch.randint(0, 256, (2, 3), device="cuda"), 20)
    assert out.is_cuda and torch.isfinite(out).all()


def test_kl_per_token_is_the_core_kl_of_log_softmaxes_bit_for_bit():
    """kl_per_token now calls core.token_stats.kl_categorical: the same float32 numbers as the expression it replaced."""
    g = torch.Generator().manual_seed(3)
    p, q = torch.randn(5, 7, 50, generator=g), torch.randn(5, 7, 50, generator=g)
    lp, lq = p.float().log_softmax(-1), q.float().log_softmax(-1)
    assert torch.equal(kl_per_token(p, q), (lp.exp() * (lp - lq)).sum(-1))


def test_harness_names_moved_to_the_experiment_module():
    import kimi_papers.serving.semantic_cache_distill as method
    with pytest.warns(DeprecationWarning, match="semantic_cache_distill_experiment"):
        assert method.run_seed is run_seed
    with pytest.raises(AttributeError):
        method.no_such_name


def test_consumer_fingerprint_names_the_factors_and_the_fine_tune():
    """The fingerprint a rerun compares: any change of one factor element (one float32 ulp) or of a name changes the
    hash, dict order does not; the losses are the fine-tune's first and last."""
    from kimi_papers.serving.semantic_cache_distill_experiment import Pair, consumer_fingerprint, factors_sha256
    g = torch.Generator().manual_seed(0)
    f = {"l0.A": torch.randn(4, 8, generator=g), "l0.B": torch.randn(8, 4, generator=g)}
    h = factors_sha256(f)
    assert len(h) == 16 and h == factors_sha256(dict(reversed(list(f.items()))))
    bumped = {k: v.clone() for k, v in f.items()}
    bumped["l0.B"][3, 1] = torch.nextafter(bumped["l0.B"][3, 1], torch.tensor(math.inf))
    assert factors_sha256(bumped) != h
    assert factors_sha256({"l1.A": f["l0.A"], "l0.B": f["l0.B"]}) != h
    pair = Pair(nn.Identity(), nn.Identity(), None, {"lora_sha256": h, "loss_curve": [2.5, 1.25, 1.0000004]})
    assert consumer_fingerprint(pair) == {"lora_sha256": h, "loss_first": 2.5, "loss_last": 1.0}


def _logistic(r: float, x0: float, n: int = 200) -> list[float]:
    xs, x = [], x0
    for _ in range(n):
        x = r * x * (1.0 - x)
        xs.append(x)
    return xs[-10:]


def test_nudge_ulps_moves_by_exactly_n_floats():
    from kimi_papers.serving.semantic_cache_distill_experiment import nudge_ulps
    x = torch.tensor([0.3, -1.0, 0.0, 1e-20])
    up = nudge_ulps(x, 1)
    assert (up > x).all() and torch.equal(nudge_ulps(up, -1), x)
    assert torch.equal(nudge_ulps(x, 2), nudge_ulps(nudge_ulps(x, 1), 1)) and torch.equal(nudge_ulps(x, 0), x)
    assert ((up - x)[:2].abs() / x[:2].abs() < 1e-6).all()
    with pytest.raises(ValueError, match="ulps"):
        nudge_ulps(x, 0.5)


def test_perturbation_agreement_flags_a_chaotic_recipe():
    """The non-chaos check must fail on a chaotic setting: the logistic map at r = 3.9 turns a one-ulp change of x0 into
    other values after 200 steps; at r = 2.9 (a stable fixed point) the same perturbation stays within 1e-10."""
    from kimi_papers.serving.semantic_cache_distill_experiment import perturbation_agreement
    x0 = 0.3
    x1 = float(np.nextafter(x0, 1.0))
    chaotic = perturbation_agreement(_logistic(3.9, x0), _logistic(3.9, x1), rtol=0.1)
    assert not chaotic["stable"] and chaotic["max_rel_diff"] > 0.1
    calm = perturbation_agreement(_logistic(2.9, x0), _logistic(2.9, x1), rtol=0.1)
    assert calm["stable"] and calm["max_rel_diff"] < 1e-10
    assert perturbation_agreement([1.0, 2.0], [1.05, 2.3], rtol=0.1) == {
        "rel_diff": pytest.approx([0.05, 0.15]), "max_rel_diff": pytest.approx(0.15), "rtol": 0.1, "stable": False}
    for ref, pert, rtol in (([1.0], [1.0, 2.0], 0.1), ([], [], 0.1), ([0.0], [0.0], 0.1), ([1.0], [np.nan], 0.1),
                            ([1.0], [1.0], 0.0)):
        with pytest.raises(ValueError):
            perturbation_agreement(ref, pert, rtol)


def test_stability_margin():
    from kimi_papers.serving.semantic_cache_distill_experiment import stability_margin
    probe = {0: {"kl_raw": 0.4, "kl_raw_p": 0.42, "kl_bp": 0.004}, 1: {"kl_raw": 0.5, "kl_raw_p": 0.5, "kl_bp": 0.1}}
    np.testing.assert_allclose(stability_margin(probe), [0.05, 0.2])
    with pytest.raises(ValueError, match="perturbed"):
        stability_margin({0: {"kl_raw": 0.4}})


def test_consumer_probe_on_a_twin_and_on_identical_models(models):
    """A twin that is the same model has margin 0; producer = consumer has no misalignment; no twin, no twin keys."""
    from kimi_papers.serving.semantic_cache_distill_experiment import consumer_probe, stability_margin
    a, b = models
    probe = consumer_probe(Pair(a, b, byte_codec()), Pair(a, copy.deepcopy(b), byte_codec()), [0], 2, n_cont=4, max_new=2)
    v = probe[0]
    assert v["kl_raw"] > 1e-3 and v["kl_raw_p"] == pytest.approx(v["kl_raw"], abs=1e-6) and v["kl_bp"] < 1e-6
    assert 0 <= v["f1_b"] <= 1 and stability_margin(probe)[0] < 1e-4
    same = consumer_probe(Pair(a, a, byte_codec()), None, [0], 1, n_cont=4, max_new=2)
    assert same[0]["kl_raw"] < 1e-6 and "kl_bp" not in same[0]
    other = consumer_probe(Pair(a, b, byte_codec()), Pair(a, a, byte_codec()), [0], 1, n_cont=4, max_new=2)[0]
    assert other["kl_raw_p"] < 1e-6 and other["kl_bp"] > 1e-3     # a twin that is A: no misalignment, far from B
