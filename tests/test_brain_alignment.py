"""kimi_papers.evaluation.brain_alignment as a library: Lanczos downsampling and delays against hand-computed cases, the
noise ceiling against a known truth, himalaya's ridge against our SVD ridge and np.linalg.solve, the compiled fold
scoring against the float64 reference, the quantisers and pruners against their formulas, GPTQ against RTN, the chunked
feature extractor against explicit passes, the NIfTI loader on a file written here, and known-wrong variants that the
checks must tell apart."""
import math

import numpy as np
import pytest
import torch

import kimi_papers.evaluation.brain_alignment as ba
from kimi_papers.evaluation.brain_alignment_compress import _body_linears
from kimi_papers.core.models import tiny_causal_lm
from kimi_papers.evaluation.brain_alignment import (
    ALPHAS, fake_quant_groups, fold_scores_compiled, fold_scores_reference, gptq_matrix, input_stats, lanczos_downsample,
    load_bold, make_delays, noise_ceiling, pearson_columns, prune_magnitude, prune_wanda, quantize_rtn, ridge_closed_form,
    ridge_cv, ridge_cv_himalaya, roi_alignment, save_bold_nifti, token_hidden_states, wanda_mask)
from kimi_papers.evaluation.brain_alignment_experiment import (
    compress, make_stimulus, relative_weight_error, shuffle_weights, simulate_brain, spm_hrf)

TT = np.arange(0, 10, 2.0)


# ---- known-wrong variants ----------------------------------------------------------------------------------------
def noise_ceiling_r2(repeats):
    """WRONG: signal power normalised by R² instead of R(R−1) (biased low)."""
    Y = np.asarray(repeats, float)
    R = Y.shape[0]
    sp = (Y.sum(0).var(0, ddof=1) - Y.var(1, ddof=1).sum(0)) / R ** 2
    return np.sqrt(np.clip(sp, 0, None) / Y.mean(0).var(0, ddof=1))


def lanczos_normalised(feats, wt, tt, window=3):
    """WRONG: rows of the Lanczos matrix normalised to sum 1 (loses the word rate)."""
    cutoff = 1.0 / np.mean(np.diff(tt))
    S = ba.lanczos_kernel(cutoff * (np.asarray(tt)[:, None] - np.asarray(wt)[None, :]), window)
    S = S / np.where(S.sum(1, keepdims=True) == 0, 1, S.sum(1, keepdims=True))
    return S @ np.asarray(feats, float)


def make_delays_off_by_one(X, delays=(1, 2, 3, 4)):
    """WRONG: shifts by d + 1."""
    return make_delays(X, tuple(d + 1 for d in delays))


def wanda_mask_squared(w, sq_norm, sparsity, n_m=None):
    """WRONG: |W|·‖X‖² (the squared norm) instead of |W|·‖X‖."""
    return wanda_mask(w, sq_norm ** 2, sparsity, n_m)


def gptq_no_feedback(w, H, bits, group, damp=0.01, block=64):
    """WRONG: GPTQ without the error feedback = plain RTN."""
    return fake_quant_groups(w, bits, group)


# ---- downsampling and delays ---------------------------------------------------------------------------------------
def lanczos_cases(fn):
    one = fn(np.array([[2.0]]), [4.0], TT)[:, 0]
    mid = fn(np.array([[1.0]]), [3.0], TT)[:, 0]
    dense_t = np.arange(0, 200, 0.4)
    rate = fn(np.ones((len(dense_t), 1)), dense_t, np.arange(20, 180, 2.0))[:, 0]
    return (np.allclose(one, [0, 0, 2.0, 0, 0], atol=1e-12) and math.isclose(mid[1], 6 / math.pi ** 2, rel_tol=1e-9)
            and np.allclose(rate, 5.0, rtol=0.02))


def test_lanczos_hand_computed_and_wrong_variant():
    assert lanczos_cases(lanczos_downsample)
    assert not lanczos_cases(lanczos_normalised)
    with pytest.raises(ValueError, match="word_times"):
        lanczos_downsample(np.ones((3, 1)), [0.0, 1.0], TT)
    with pytest.raises(ValueError, match="tr_times"):
        lanczos_downsample(np.ones((1, 1)), [0.0], [1.0])


def test_delays_hand_case():
    X = np.array([[1.0], [2.0], [3.0]])
    assert make_delays(X, (1, 2)).tolist() == [[0, 0], [1, 0], [2, 1]]
    assert make_delays_off_by_one(X, (1, 2)).tolist() != [[0, 0], [1, 0], [2, 1]]
    with pytest.raises(ValueError, match="delays"):
        make_delays(X, (-1,))


# ---- scores and ceilings -------------------------------------------------------------------------------------------
def test_pearson_and_zero_variance():
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((40, 3)) + 5, rng.standard_normal((40, 3))
    assert pearson_columns(A, B) == pytest.approx([np.corrcoef(A[:, j], B[:, j])[0, 1] for j in range(3)])
    with pytest.warns(UserWarning, match="zero-variance"):
        assert pearson_columns(np.ones((10, 1)), rng.standard_normal((10, 1)))[0] == 0.0


def ceiling_ok(fn) -> bool:
    rng = np.random.default_rng(1)
    s = rng.standard_normal(6000)
    reps = np.stack([np.c_[s, s + 2 * rng.standard_normal(6000)] for _ in range(4)])
    reps[:, :, 1] = s + 2 * rng.standard_normal((4, 6000))
    cc = fn(reps)
    return math.isclose(cc[0], 1.0, abs_tol=1e-9) and abs(cc[1] - 1 / math.sqrt(1 + 4 / 4)) < 0.03


def test_noise_ceiling_known_truth_and_wrong_variant():
    assert ceiling_ok(noise_ceiling)
    assert not ceiling_ok(noise_ceiling_r2)
    with pytest.raises(ValueError, match="repeats"):
        noise_ceiling(np.ones((1, 4, 2)))


def test_roi_alignment_excludes_and_reports_nan():
    out = roi_alignment(np.array([0.2, 0.4, 0.3, 0.1]), np.array([0.5, 0.8, np.nan, 0.05]), ["a", "a", "b", "b"])
    assert out["a"] == pytest.approx(0.45) and math.isnan(out["b"])


def test_simulated_ceiling_matches_truth():
    rng = np.random.default_rng(0)
    z = [rng.standard_normal((400, 5)) for _ in range(3)] + [rng.standard_normal((3000, 5))]
    b = simulate_brain(z, 3, {"AG": 0.9, "EAC": 0.1}, 20, (0.3, 0.8), 4, rng)
    assert np.corrcoef(b.cc_true, b.meta["cc_empirical"])[0, 1] > 0.95
    assert np.abs(noise_ceiling(b.Y_test_repeats) - b.cc_true).mean() < 0.05


# ---- ridge ---------------------------------------------------------------------------------------------------------
def _ridge_data(seed=1, T=120, p=300, V=30):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((T, p))
    Y = X @ (0.05 * rng.standard_normal((p, V))) + rng.standard_normal((T, V)) * np.linspace(0.3, 4, V)
    return X, Y


def test_himalaya_equals_own_ridge_and_closed_form():
    X, Y = _ridge_data()
    own, him = ridge_cv(X, Y, ALPHAS), ridge_cv_himalaya(X, Y, ALPHAS)
    assert np.allclose(own.best_alpha, him.best_alpha, rtol=1e-9) and len(np.unique(own.best_alpha)) > 1
    assert np.abs(own.W - him.W).max() <= 1e-8 * np.abs(own.W).max()
    assert np.allclose(him.predict(X[:5]), X[:5] @ him.W)
    assert np.abs(ridge_closed_form(X, Y, own.best_alpha) - own.W).max() <= 1e-8 * np.abs(own.W).max()
    # a wrong α (one notch off the grid choice) gives different weights: the comparison can fail
    shifted = np.asarray(ALPHAS)[np.clip(np.searchsorted(ALPHAS, own.best_alpha) + 1, 0, len(ALPHAS) - 1)]
    assert np.abs(ridge_closed_form(X, Y, shifted) - own.W).max() > 1e-3 * np.abs(own.W).max()


def test_ridge_bad_input():
    X, Y = _ridge_data()
    for bad in ([0.0], [-1.0, 1.0], []):
        with pytest.raises(ValueError, match="alphas"):
            ridge_cv_himalaya(X, Y, bad)
    with pytest.raises(ValueError, match="n_folds"):
        ridge_cv(X[:6], Y[:6], ALPHAS, n_folds=5)
    with pytest.raises(ValueError, match="X, Y"):
        ridge_cv(X, Y[:-1], ALPHAS)


def test_fold_kernel_compiled_equals_reference():
    X, Y = _ridge_data(T=200, p=400, V=50)
    tr, va = np.arange(40, 200), np.arange(40)
    U, s, Vt = np.linalg.svd(X[tr], full_matrices=False)
    a64 = [torch.as_tensor(a) for a in (X[va] @ Vt.T, s, U.T @ Y[tr], Y[va], np.asarray(ALPHAS))]
    ref = fold_scores_reference(*a64)
    cmp = fold_scores_compiled(*[a.float() for a in a64])
    assert (cmp.double() - ref).abs().max() <= 1e-4
    direct = pearson_columns(X[va] @ ridge_closed_form(X[tr], Y[tr], ALPHAS[6]), Y[va])
    assert np.abs(ref[6].numpy() - direct).max() <= 1e-8


# ---- compression ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return tiny_causal_lm(vocab_size=64, d_model=64, n_layers=2, n_heads=4, seed=0).eval()


def test_fake_quant_formula():
    w = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0, 0.0, 0.4, 2.0]])
    assert fake_quant_groups(w, 2, 4).tolist() == [[0.0, 1.0, 2.0, 3.0, -1.0, 0.0, 0.0, 2.0]]
    torch.manual_seed(0)
    wr = torch.randn(8, 128)
    g = wr.view(8, 2, 64)
    s = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15
    z = torch.round(-g.amin(-1, keepdim=True) / s)
    assert torch.equal(fake_quant_groups(wr, 4, 64), ((torch.clamp(torch.round(g / s) + z, 0, 15) - z) * s).view(8, 128))
    with pytest.raises(ValueError, match="bits"):
        fake_quant_groups(wr, 5, 64)
    with pytest.raises(ValueError, match="group"):
        fake_quant_groups(wr, 4, 48)


def test_quantize_touches_body_only_and_copies(tiny):
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    q = quantize_rtn(tiny, 4, 64)
    assert all(torch.equal(before[k], v) for k, v in tiny.state_dict().items())
    changed = {k for k, v in q.state_dict().items() if not torch.equal(before[k], v)}
    assert changed and all(".layers." in k and k.endswith("proj.weight") for k in changed)
    assert 0 < relative_weight_error(tiny, q) < 0.2


def test_pruning(tiny):
    pm = prune_magnitude(tiny, 0.5)
    for (_, a), (_, b) in zip(_body_linears(tiny), _body_linears(pm)):
        assert (b.weight == 0).sum().item() == int(0.5 * a.weight.numel())
    w, n2 = torch.tensor([[1.0, 1.0, 2.0, 0.1]]), torch.tensor([1.0, 9.0, 1.0, 100.0])
    assert wanda_mask(w, n2, 0.5).tolist() == [[False, True, True, False]]
    assert wanda_mask_squared(w, n2, 0.5).tolist() != [[False, True, True, False]]
    assert (wanda_mask(torch.randn(4, 16), torch.rand(16), 0.5, n_m=(2, 4)).view(4, 4, 4).sum(-1) == 2).all()
    calib = torch.randint(0, 64, (3, 12))
    pw = prune_wanda(tiny, calib, 0.5)
    assert all(abs((b.weight == 0).float().mean().item() - 0.5) < 0.02 for _, b in _body_linears(pw))
    with pytest.raises(ValueError, match="sparsity"):
        prune_magnitude(tiny, 1.0)
    with pytest.raises(ValueError, match="calib_ids"):
        input_stats(tiny, torch.zeros(0, 3, dtype=torch.long))


def gptq_ok(fn) -> bool:
    torch.manual_seed(0)
    w = torch.randn(16, 128, dtype=torch.float64)
    same = torch.allclose(fn(w, torch.eye(128, dtype=torch.float64), 4, 64), fake_quant_groups(w, 4, 64))
    Xc = torch.randn(512, 128, dtype=torch.float64) @ torch.randn(128, 128, dtype=torch.float64)
    H = 2 * Xc.T @ Xc
    err = lambda Q: float(torch.trace((w - Q) @ H @ (w - Q).T))
    return same and err(fake_quant_groups(w, 4, 64)) > 1.5 * err(fn(w, H, 4, 64))


def test_gptq_against_rtn_and_wrong_variant():
    assert gptq_ok(gptq_matrix)
    assert not gptq_ok(gptq_no_feedback)


def test_broken_models_and_compress(tiny):
    sh = shuffle_weights(tiny, 0)
    for (_, a), (_, b) in zip(tiny.state_dict().items(), sh.state_dict().items()):
        assert torch.equal(a.flatten().sort().values, b.flatten().sort().values)
    assert compress(tiny, "fp32") is tiny
    assert torch.equal(compress(tiny, "w4_rtn_g64").model.layers[0].mlp.up_proj.weight,
                       quantize_rtn(tiny, 4, 64).model.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="variant"):
        compress(tiny, "awq")


# ---- features and files --------------------------------------------------------------------------------------------
def test_chunked_hidden_states(tiny):
    ids = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    full = token_hidden_states(tiny, ids, [2], window=64, stride=32)[2]
    with torch.no_grad():
        ref = tiny.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[2][0].numpy()
        win = tiny.model(torch.tensor([ids[16:32]]), output_hidden_states=True).hidden_states[2][0].numpy()
    assert np.allclose(full, ref, atol=1e-5)
    ch = token_hidden_states(tiny, ids, [2], window=16, stride=8)[2]
    assert np.allclose(ch[:16], ref[:16], atol=1e-5) and np.allclose(ch[30], win[14], atol=1e-5)   # passes start 0, 8, 16: token 30 from 16
    with pytest.raises(ValueError, match="stride"):
        token_hidden_states(tiny, ids, [2], window=8, stride=9)


def test_nifti_round_trip(tmp_path):
    vol = np.random.default_rng(0).standard_normal((2, 3, 2, 7)).astype(np.float32)
    p = save_bold_nifti(tmp_path / "bold.nii.gz", vol, tr=1.5)
    mask = np.zeros((2, 3, 2), bool)
    mask[0, :2, 0] = True
    atlas = np.zeros((2, 3, 2), int)
    atlas[0, 0, 0] = 4
    Y, tr, roi = load_bold(p, mask, atlas, {4: "AG"})
    assert Y.shape == (7, 2) and tr == 1.5 and list(roi) == ["AG", "0"]
    assert np.allclose(Y[:, 1], vol[0, 1, 0])
    assert [f.name for f in tmp_path.iterdir()] == ["bold.nii.gz"]
    with pytest.raises(ValueError, match="atlas"):
        load_bold(p, mask, np.zeros((2, 2, 2), int))


def test_stimulus_and_hrf():
    h = spm_hrf(1.0)
    assert abs(h.sum() - 1) < 1e-12 and int(np.argmax(h)) == 5
    st = make_stimulus(400, seed=0)
    assert [len(s) for s in st.stories] == [100] * 4 and len(st.calib_text.split()) == 3000
    assert st.word_times[0][0] == pytest.approx(1.0) and st.tr_times[0][-1] >= st.word_times[0][-1]
