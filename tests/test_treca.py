"""kimi_papers.science.treca as a library: the TRECA objective against a float64 reference and its identities,
the nuisances and pseudo-outcomes against hand-checked cases, the rules' abstention counts, bounds, bad input."""
import math

import numpy as np
import pytest
import torch

from kimi_papers.science import treca
from kimi_papers.science import treca_experiment as trx
from kimi_papers.science.treca import (
    TrecaConfig, chow_rule, clip_propensity, crossfit_nuisances, dr_pseudo_outcome, fit_treca, frechet_bounds,
    gamma_bounds, n_abstain, plugin_rho, responder_bounds, robust_chow, treca_cost_objective, treca_objective)
from kimi_papers.science.treca_experiment import (
    accepted_error, bayes_chow, cvar_identity, evaluate_arm, load_nsw, load_thornton, make_world, real_data_split, regret,
    simulate_responders, treca_objective_reference, true_risk)

CUDA = torch.cuda.is_available()


def case(n: int, seed: int = 0, dtype=torch.float64, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(n, generator=g, dtype=dtype)
    phi = 2 * torch.randn(n, generator=g, dtype=dtype) + 0.4
    rho = torch.rand(n, generator=g, dtype=dtype)
    if ties:  # many equal plug-in losses: f saturated and rho on a coarse grid
        f = 40 * torch.sign(f)
        rho = torch.round(rho * 4) / 4
    return f, phi, rho


@pytest.mark.parametrize("n,alpha,ties", [(200, 0.2, False), (333, 0.05, False), (50, 0.3, True), (64, 0.0, True),
                                          (10, 0.85, False)])
def test_objective_matches_float64_reference(n, alpha, ties):
    f, phi, rho = case(n, ties=ties)
    loss, t = treca_objective(f, phi, rho, alpha, 0.5, compiled=False)
    ref_loss, ref_t = treca_objective_reference(f.numpy(), phi.numpy(), rho.numpy(), alpha, 0.5)
    assert abs(loss.item() - ref_loss) < 1e-12 and abs(t.item() - ref_t) < 1e-12


def test_alpha_zero_is_the_mean_dr_loss():
    f, phi, rho = case(300, 1)
    h = torch.sigmoid(f / 0.3)
    loss, _ = treca_objective(f, phi, rho, 0.0, 0.3, compiled=False)
    assert torch.allclose(loss, (h * (1 - phi) + (1 - h) * phi).mean(), atol=1e-13)


def test_oracle_phi_gives_mean_minus_alpha_cvar():
    f, _, rho = case(500, 2)
    h = torch.sigmoid(f / 0.7)
    ell = (h * (1 - rho) + (1 - h) * rho).numpy()
    for alpha in (0.1, 0.2, 0.36):  # alpha n integer: the plug-in quantile is the Rockafellar-Uryasev maximiser
        loss, _ = treca_objective(f, rho, rho, alpha, 0.7, compiled=False)
        assert abs(loss.item() - cvar_identity(ell, alpha)) < 1e-12
    loss, t = treca_objective(f, rho, rho, 0.2013, 0.7, compiled=False)  # otherwise within one gap / n
    assert abs(loss.item() - cvar_identity(ell, 0.2013)) <= (np.sort(ell)[-1] - np.sort(ell)[0]) / 500 + 1e-12


def test_abstains_exactly_ceil_alpha_n_with_ties():
    f, phi, rho = case(40, ties=True)
    h = torch.sigmoid(f / 0.1)
    l_hat = rho + h * (1 - 2 * rho)
    _, t = treca_objective(f, phi, rho, 0.25, 0.1, compiled=False)
    assert (l_hat > t).sum() < 10 <= (l_hat >= t).sum()  # ties at t: index order decides the rest
    assert n_abstain(3000, 0.2) == 600 and n_abstain(7, 0.2) == 2 and n_abstain(5, 0.0) == 0


def test_no_accepted_unit_gives_all_abstain_without_nan():
    f, phi, rho = case(3)
    loss, t = treca_objective(f, phi, rho, 0.9, 0.5, compiled=False)
    assert loss.item() == 0.0 and t.item() == -math.inf
    pred = np.full(3, -1)
    assert true_risk(pred, rho.numpy(), c=0.3) == pytest.approx(0.3)


def test_gradient_flows_only_through_accepted_units_and_t():
    f, phi, rho = case(100, 3)
    f.requires_grad_(True)
    loss, t = treca_objective(f, phi, rho, 0.2, 0.5, compiled=False)
    loss.backward()
    h = torch.sigmoid(f.detach() / 0.5)
    l_hat = rho + h * (1 - 2 * rho)
    zero = (l_hat > t.detach()) & (f.grad == 0)
    assert zero.sum() >= 19  # abstained units, except the quantile unit itself when it is the argmax tie


def test_cost_form_hand_case():
    f = torch.tensor([10.0, -10.0, 10.0], dtype=torch.float64)  # h ~ (1, 0, 1) at tau = 0.01
    rho = torch.tensor([0.9, 0.2, 0.45], dtype=torch.float64)
    phi = torch.tensor([1.5, -0.5, 2.0], dtype=torch.float64)
    # plug-in losses 0.1, 0.2, 0.55: the third (> c = 0.3) pays c; the others pay 1 - phi and phi
    loss = treca_cost_objective(f, phi, rho, 0.3, 0.01, compiled=False)
    assert loss.item() == pytest.approx((-0.5 - 0.5 + 0.3) / 3, abs=1e-9)


@pytest.mark.slow
def test_compiled_equals_eager_and_reference():
    for n, dtype, tol in ((512, torch.float32, 1e-6), (777, torch.float32, 1e-6)):
        f, phi, rho = case(n, 4, dtype)
        f1, f2 = f.clone().requires_grad_(True), f.clone().requires_grad_(True)
        lc, tc = treca_objective(f1, phi, rho, 0.2, 0.3, compiled=True)
        le, te = treca_objective(f2, phi, rho, 0.2, 0.3, compiled=False)
        ref, tref = treca_objective_reference(f.double().numpy(), phi.double().numpy(), rho.double().numpy(), 0.2, 0.3)
        lc.backward(), le.backward()
        assert abs(lc.item() - le.item()) < tol and abs(lc.item() - ref) < tol and abs(tc.item() - tref) < tol
        assert torch.allclose(f1.grad, f2.grad, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_objective_on_cuda_matches_cpu():
    f, phi, rho = case(400, 5, torch.float32)
    lc, tc = treca_objective(f.cuda(), phi.cuda(), rho.cuda(), 0.2, 0.3, compiled=False)
    le, te = treca_objective(f, phi, rho, 0.2, 0.3, compiled=False)
    assert lc.device.type == "cuda" and abs(lc.item() - le.item()) < 1e-5 and abs(tc.item() - te.item()) < 1e-6


def test_dr_pseudo_outcome_hand_case_and_unbiasedness():
    T, Y = np.array([1, 0, 1, 0]), np.array([1, 1, 0, 0])
    mu0, mu1, e = np.full(4, 0.25), np.full(4, 0.75), np.full(4, 0.5)
    assert np.allclose(dr_pseudo_outcome(T, Y, mu0, mu1, e), [0.5 + 0.5, 0.5 - 1.5, 0.5 - 1.5, 0.5 + 0.5])
    rng = np.random.default_rng(0)  # wrong outcome model, right propensity: still unbiased for the ATE
    n = 200_000
    Tn = (rng.random(n) < 0.3).astype(int)
    Yn = (rng.random(n) < np.where(Tn == 1, 0.8, 0.3)).astype(int)
    phi = dr_pseudo_outcome(Tn, Yn, np.full(n, 0.6), np.full(n, 0.1), np.full(n, 0.3))
    assert abs(phi.mean() - 0.5) < 0.01
    assert np.allclose(plugin_rho(np.array([0.5, 0.1]), np.array([0.2, 0.9])), [0.0, 0.8])


def test_simulator_truth_is_consistent():
    X = load_thornton().X
    d = simulate_responders(X, "rct", np.random.default_rng(0))
    assert np.allclose(d.rho, d.mu1 - d.mu0) and (d.mu1 <= 1).all() and (d.rho >= 0).all()
    assert abs(d.responder.mean() - d.rho.mean()) < 0.03 and abs(d.T.mean() - 0.78) < 0.03
    nm = simulate_responders(X, "nonmonotone", np.random.default_rng(0))
    lo, hi = frechet_bounds(nm.mu0, nm.mu1)
    assert (lo <= nm.rho + 1e-12).all() and (nm.rho <= hi + 1e-12).all() and (nm.rho > nm.mu1 - nm.mu0 + 1e-9).any()
    cf = simulate_responders(X, "confounded", np.random.default_rng(0))
    assert cf.e.min() >= 0.1 and cf.e.max() <= 0.9 and cf.e.std() > 0.05


def test_crossfit_is_out_of_fold_and_seeded():
    d = simulate_responders(load_thornton().X[:600], "confounded", np.random.default_rng(1))
    a = crossfit_nuisances(d.X, d.T, d.Y, "logistic", k=3, seed=7, X_new=d.X[:5])
    b = crossfit_nuisances(d.X, d.T, d.Y, "logistic", k=3, seed=7)
    assert np.array_equal(a.mu1, b.mu1) and a.mu0_new.shape == (5,)
    assert ((a.e >= 0.01) & (a.e <= 0.99)).all() and not np.allclose(a.e, a.e[0])
    r = crossfit_nuisances(d.X, d.T, d.Y, "logistic", k=3, known_e=0.5)
    assert np.all(r.e == 0.5)


def test_rules_abstain_on_the_budget_and_oracle_is_the_floor():
    rng = np.random.default_rng(2)
    rho = rng.random(1000)
    oracle = bayes_chow(rho, alpha=0.2)
    assert (oracle == -1).sum() == 200 and regret(oracle, rho) == pytest.approx(0.0)
    noisy = np.clip(rho + 0.2 * rng.standard_normal(1000), 0, 1)
    rule = chow_rule(noisy, alpha=0.2)
    pred = rule.predict(noisy)
    assert (pred == -1).sum() == 200 and regret(pred, rho) > 0
    assert accepted_error(oracle, rho) < accepted_error(bayes_chow(rho, alpha=0.0), rho)
    cost_pred = bayes_chow(np.array([0.1, 0.5, 0.8]), c=0.25)
    assert cost_pred.tolist() == [0, -1, 1]


def test_fit_treca_learns_a_clean_boundary():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((800, 2))
    rho = 1 / (1 + np.exp(-3 * X[:, 0]))  # continuous: no ties among the plug-in losses
    rule = fit_treca(X, rho, rho, alpha=0.1, model="linear", cfg=TrecaConfig(steps=150), compiled=False)
    pred = rule.predict(X, rho)
    assert (pred == -1).sum() == 80
    assert ((pred == 1) == (X[:, 0] > 0))[pred != -1].mean() > 0.97


def test_bounds():
    mu0, mu1 = np.array([0.2, 0.6]), np.array([0.7, 0.3])
    lo, hi = frechet_bounds(mu0, mu1)
    assert np.allclose(lo, [0.5, 0.0]) and np.allclose(hi, [0.7, 0.3])
    l1, h1 = gamma_bounds(np.array([0.5]), np.array([0.5]), 1.0)
    assert np.allclose(l1, 0.5) and np.allclose(h1, 0.5)
    l2, h2 = gamma_bounds(np.array([0.5]), np.array([0.5]), 3.0)  # unobserved arm in [1/4, 3/4]
    assert np.allclose(l2, 0.5 * 0.5 + 0.5 * 0.25) and np.allclose(h2, 0.5 * 0.5 + 0.5 * 0.75)
    lo1, hi1 = responder_bounds(mu0, mu1, np.array([0.5, 0.5]), 1.0)
    lo2, hi2 = responder_bounds(mu0, mu1, np.array([0.5, 0.5]), 2.0)
    assert np.allclose(lo1, lo) and (lo2 <= lo1).all() and (hi2 >= hi1).all()
    assert robust_chow(np.array([0.8, 0.1, 0.3]), np.array([0.9, 0.2, 0.9]), 0.25).tolist() == [1, 0, -1]


def test_real_data_loaders_drop_nan_rows():
    th = load_thornton()
    assert len(th) == 2825 and th.n_dropped == 4820 - 2825 and np.isfinite(th.X).all()
    assert 0.77 < th.known_e < 0.79 and th.names == ["distvct", "age", "hiv2004"]
    nsw = load_nsw()
    assert len(nsw) == 445 and set(np.unique(nsw.Y)) == {0, 1}
    with pytest.raises(ValueError, match="dropna=True"):
        load_thornton(dropna=False)


def test_evaluate_arm_row():
    w = make_world(load_thornton().X, 0, 400, 300)
    row = evaluate_arm(w, "plugin", alpha=0.2)
    assert row["abstain"] == pytest.approx(0.2, abs=0.08) and row["regret"] >= -1e-12
    assert evaluate_arm(w, "oracle", alpha=0.2)["regret"] == pytest.approx(0.0, abs=1e-12)


def test_bad_inputs():
    f, phi, rho = case(10)
    with pytest.raises(ValueError, match="alpha"):
        treca_objective(f, phi, rho, 1.0, 0.5)
    with pytest.raises(ValueError, match="tau"):
        treca_objective(f, phi, rho, 0.2, 0.0)
    with pytest.raises(ValueError, match="shapes"):
        treca_objective(f, phi[:5], rho, 0.2, 0.5)
    with pytest.raises(ValueError, match="c="):
        treca_cost_objective(f, phi, rho, 0.5, 0.5)
    with pytest.raises(ValueError, match="gamma"):
        gamma_bounds(np.array([0.5]), np.array([0.5]), 0.9)
    X = np.random.default_rng(0).standard_normal((20, 3))
    T, Y = np.tile([0, 1], 10), np.tile([0, 0, 1, 1], 5)
    with pytest.raises(ValueError, match="binary"):
        crossfit_nuisances(X, T, Y * 2)
    with pytest.raises(ValueError, match="both treatment arms"):
        crossfit_nuisances(X, np.ones(20, int), Y)
    with pytest.raises(ValueError, match="mismatched"):
        crossfit_nuisances(X[:19], T, Y)
    Xn = X.copy()
    Xn[3, 1] = np.nan
    with pytest.raises(ValueError, match=r"keep = np.isfinite\(X\).all\(1\)") as err:  # issue 20: no dropna= here
        crossfit_nuisances(Xn, T, Y)
    assert "pass dropna=True" not in str(err.value) and "check_covariates(X, dropna=True)" in str(err.value)
    assert treca.check_covariates(Xn, dropna=True)[1].sum() == 19   # the option the message names exists
    with pytest.raises(ValueError, match="overlap"):
        clip_propensity(np.r_[np.full(10, 0.001), np.full(90, 0.5)])
    with pytest.warns(RuntimeWarning, match="clipped 2"):
        e, k = clip_propensity(np.r_[0.001, 0.999, np.full(98, 0.5)])
    assert k == 2 and e.min() == 0.01
    with pytest.raises(ValueError, match="exactly one"):
        fit_treca(X, phi.numpy(), rho.numpy(), alpha=0.2, cost=0.3)
    with pytest.raises(ValueError, match="regime"):
        simulate_responders(X, "observational", np.random.default_rng(0))


def test_real_data_split_scores_both_rules_on_held_out_units():
    nsw = load_nsw()
    row = real_data_split(nsw, 0, 0.2, "linear", cfg=TrecaConfig(steps=30), compiled=False, gammas=(1.0, 2.0))
    assert (row["n_train"], row["n_test"]) == (311, 134)
    assert abs(row["abstain_plugin"] - 0.2) < 0.1 and 0 <= row["disagree"] <= 1
    if row["disagree"] == 0:  # the same decisions: the same DR risk
        assert row["dr_risk_treca"] == row["dr_risk_plugin"]
    assert row["robust_abstain_gamma_2"] >= row["robust_abstain_gamma_1"]  # a larger Gamma never labels more units
    with pytest.raises(ValueError, match="test_frac"):
        real_data_split(nsw, 0, test_frac=1.0)


def test_gain_decomposition_adds_up_and_reads_labels():
    rho = np.array([0.9, 0.8, 0.45, 0.3, 0.1])
    # A (TRECA-like) labels unit 1 responder and abstains on unit 2; B (plug-in-like) labels unit 1 non-responder
    dec = trx.gain_decomposition(np.array([1, 1, 0, 0, 0]), np.array([0, 0, 1, 0, 0], bool),
                                   np.array([1, 0, 1, 0, 0]), np.array([0, 0, 0, 0, 1], bool), rho)
    assert dec["disagree"] == pytest.approx(0.4) and dec["disagree_abstained"] == pytest.approx(0.5)
    assert dec["from_labels"] + dec["from_abstention"] == pytest.approx(dec["total"])
    hybrid = trx.regret(np.array([1, 0, -1, 0, 0]), rho)    # B's labels on A's accepted units
    assert dec["from_labels"] == pytest.approx(hybrid - trx.regret(np.array([1, 1, -1, 0, 0]), rho))
    same = trx.gain_decomposition(np.array([1, 0]), np.array([False, True]), np.array([1, 0]), np.array([False, True]),
                                    np.array([0.7, 0.4]))
    assert same["total"] == same["from_labels"] == same["from_abstention"] == 0.0
    with pytest.raises(ValueError, match="labels_a"):
        trx.gain_decomposition(np.array([2, 0]), np.array([0, 0], bool), np.array([1, 0]), np.array([0, 0], bool), rho[:2])


def test_evaluate_arm_units():
    w = make_world(load_thornton().X, 1, 400, 300)
    row = evaluate_arm(w, "plugin", alpha=0.2, units=True)
    assert row["labels"].shape == (300,) and row["abstain_units"].mean() == pytest.approx(row["abstain"])
    assert "labels" not in evaluate_arm(w, "plugin", alpha=0.2)
