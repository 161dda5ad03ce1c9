"""kimi_papers.architectures.cdat as a library: energies and their closed-form gradient, the dynamics, graphs, arms and errors."""
import math
import warnings

import numpy as np
import pytest
import torch

from kimi_papers.architectures.cdat import (CDAT, EnergyTransformer, GraphTransformer, adjacency_from_edges, cann_gain,
                                            dynamics_step, dynamics_step_autograd, dynamics_step_compiled, edge_index,
                                            energy_grad, energy_layernorm, gcn_propagate, hopfield_energy, knn_graph,
                                            laplacian_pe, softmax_attention_energy, total_energy, unit,
                                            vmf_attention_energy)
from kimi_papers.architectures.cdat_experiment import (ARMS, KINDS, build_arm, evaluate, fit, gad_metrics, inject_anomalies,
                                                       make_graph, sbm_graph, split_nodes)
from kimi_papers.core.kernels import compiled_ran

F64 = torch.float64


def rand_problem(n=50, d=12, heads=2, y=5, m=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    edges = edge_index(sbm_graph(n, 3, 0.2, 0.02, 4, np.random.default_rng(seed))[1])
    r = lambda *s: torch.randn(*s, dtype=F64, generator=gen)
    return edges, r(n, d), r(heads, y, d), r(heads, y, d), r(m, d)


def small_graph(n=120, seed=4):
    X, A, b = sbm_graph(n, 3, 0.15, 0.01, 6, np.random.default_rng(seed))
    X, A, lab, kind = inject_anomalies(X, A, 0.15, KINDS, np.random.default_rng(seed + 1), classes=b, clique=5)
    return make_graph(X, A, lab, kind, 4, 0)


@pytest.mark.parametrize("normalize,scale,use_pi", [(True, [2.0, 6.0], False), (True, [3.0, 1.0], True), (False, 0.3, False)])
def test_closed_form_gradient_matches_autograd(normalize, scale, use_pi):
    edges, g, Wq, Wk, xi = rand_problem()
    scale = torch.tensor(scale, dtype=F64)
    pi = torch.randn(edges.shape[1], dtype=F64, generator=torch.Generator().manual_seed(9)) if use_pi else None
    auto = torch.func.grad(lambda t: total_energy(t, edges, Wq, Wk, scale, xi, pi, normalize))(g)
    torch.testing.assert_close(energy_grad(g, edges, Wq, Wk, scale, xi, pi, normalize), auto, rtol=1e-6, atol=1e-9)


def test_hand_checked_energies():
    one = torch.tensor([[1.0, 2.0]], dtype=F64)
    wq, wk = torch.tensor([[[1.0, 0.0]]], dtype=F64), torch.tensor([[[0.0, 1.0]]], dtype=F64)
    loop = torch.tensor([[0], [0]])
    # one node with its self-loop: E = -(1/kappa) log exp(kappa cos) = -cos(q, k) = -1 (both along +axes)
    assert vmf_attention_energy(one, loop, wq, wk, torch.tensor([3.0])).item() == pytest.approx(-1.0)
    # ET: -(1/beta) * beta * <k, q> = -(2 * 1)
    assert softmax_attention_energy(one, loop, wq, wk, 0.5).item() == pytest.approx(-2.0)
    assert hopfield_energy(one, torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=F64)).item() == pytest.approx(-4.5)


def test_closed_form_step_matches_autograd_step_and_gain_bounds():
    edges, x, Wq, Wk, xi = rand_problem(seed=1)
    args = dict(edges=edges, gamma=torch.tensor(1.3, dtype=F64), delta=torch.zeros(12, dtype=F64), Wq=Wq, Wk=Wk,
                scale=torch.tensor([2.0, 5.0], dtype=F64), xi=xi, w_e=torch.tensor(1.0, dtype=F64),
                k_inh=torch.tensor(0.5, dtype=F64), eta=0.1)
    for normalize, modulate in ((True, True), (False, False), (True, False)):
        torch.testing.assert_close(dynamics_step(x, **args, normalize=normalize, modulate=modulate),
                                   dynamics_step_autograd(x, **args, normalize=normalize, modulate=modulate), rtol=1e-10, atol=1e-12)
    m = cann_gain(energy_layernorm(x, 1.0, 0.0), x, edges, 1.0, 0.5, 0.1)
    assert (m > 0).all() and (m <= 0.1).all()
    assert (cann_gain(x, 3 * x, edges, 1.0, 0.5, 0.1) < cann_gain(x, x, edges, 1.0, 0.5, 0.1)).all()


def test_energy_is_monotone_over_50_steps_at_random_init():
    g = small_graph(150, seed=3)
    for cls in (CDAT, EnergyTransformer):
        torch.manual_seed(0)
        model = cls(g.inputs().shape[1], d=16, heads=2, head_dim=4, memories=8, eta=0.1)
        with torch.no_grad():
            _, E, _ = model.states(g.inputs(), g.edges, 50, return_energy=True)
        assert (E.diff() <= 1e-6 * E[:-1].abs()).all()
        assert E[-1] < E[0]


def test_rising_energy_warns_and_backtracking_repairs_it():
    g = small_graph()
    torch.manual_seed(0)
    model = CDAT(g.inputs().shape[1], d=16, heads=2, head_dim=4, memories=8)
    ascent = lambda x, **p: 2 * x - dynamics_step(x, **p)
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="rose at steps"):
        model.states(g.inputs(), g.edges, 3, return_energy=True, step_fn=ascent)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        _, E, halvings = model.states(g.inputs(), g.edges, 3, return_energy=True, backtrack=True, step_fn=ascent)
    assert (E.diff() <= 1e-6 * E[:-1].abs()).all() and min(halvings) > 0


def test_graph_construction_and_anomalies():
    a = knn_graph(np.array([[0.0], [1.0], [3.0], [10.0]]), 1)
    assert (a == np.array([[0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 1, 0]], bool)).all()
    X, A, blk = sbm_graph(200, 4, 0.1, 0.005, 8, np.random.default_rng(0))
    X2, A2, lab, kind = inject_anomalies(X, A, 0.12, KINDS, np.random.default_rng(1), classes=blk, clique=4)
    assert set(kind[lab == 1]) == set(KINDS) and (X2[lab == 0] == X[lab == 0]).all()
    st = np.flatnonzero(kind == "structural")
    assert (A2[np.ix_(st, st)].sum(1) >= 3).all() and (A2 == A2.T).all() and not A2.diagonal().any()
    tr, va, te = split_nodes(lab, np.random.default_rng(0))
    assert len(np.union1d(np.union1d(tr, va), te)) == 200 and lab[te].sum() >= 1 and lab[tr].sum() >= 1
    pe = laplacian_pe(A2, 3)
    d = np.maximum(A2.sum(1), 1)
    L = np.eye(200) - A2 / np.sqrt(np.outer(d, d))
    assert np.allclose(L @ pe, pe * (pe * (L @ pe)).sum(0), atol=1e-4)


def test_bad_inputs_raise_clear_errors():
    edges, g, Wq, Wk, xi = rand_problem()
    with pytest.raises(ValueError, match="square"):
        edge_index(np.ones((3, 4)))
    with pytest.raises(ValueError, match="symmetric"):
        edge_index(np.triu(np.ones((3, 3)), 1))
    with pytest.raises(ValueError, match="0 nodes"):
        edge_index(np.zeros((0, 0)))
    with pytest.raises(ValueError, match="NaN"):
        knn_graph(np.array([[0.0], [np.nan], [1.0]]), 1)
    with pytest.raises(ValueError, match="rows"):
        inject_anomalies(np.zeros((5, 2)), np.zeros((4, 4)), 0.2, ["contextual"], np.random.default_rng(0))
    with pytest.raises(ValueError, match="kappa"):
        vmf_attention_energy(g, edges, Wq, Wk, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="gamma"):
        energy_layernorm(g, torch.ones(12), torch.zeros(12))
    with pytest.raises(ValueError, match="eta"):
        cann_gain(g, g, edges, 1.0, 0.5, -0.1)
    with pytest.raises(ValueError, match="eta"):
        CDAT(10, eta=0.0)
    with pytest.raises(ValueError, match="arm"):
        build_arm("GAT", 4, {}, 0)
    with pytest.raises(ValueError, match="split"):
        evaluate(build_arm("MLP", 10, {}, 0), small_graph(), split="train")


def test_unit_is_zero_with_zero_gradient_at_the_origin():
    z = torch.zeros(2, 3, requires_grad=True)
    unit(z).sum().backward()
    assert (unit(z) == 0).all() and (z.grad == 0).all()


def test_metrics_and_baselines():
    assert gad_metrics([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1])["auroc"] == 0.75
    with pytest.warns(RuntimeWarning, match="one class"):
        assert math.isnan(gad_metrics([0.1, 0.2], [0, 0])["auroc"])
    p = gcn_propagate(torch.tensor([[1.0], [2.0], [4.0]]), edge_index(np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]])))
    assert p[1, 0].item() == pytest.approx(1 / 6 ** 0.5 + 2 / 3 + 4 / 6 ** 0.5)
    torch.manual_seed(0)
    gt, x = GraphTransformer(3, d=8, heads=2), torch.randn(4, 3)
    e = edge_index(np.array([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]]))
    x2 = x.clone()
    x2[3] += 5
    assert torch.allclose(gt(x, e)[:2], gt(x2, e)[:2]) and not torch.allclose(gt(x, e)[3], gt(x2, e)[3])


def test_training_lowers_the_loss_for_every_arm():
    g = small_graph()
    for arm in ARMS:
        model = build_arm(arm, g.inputs().shape[1], dict(d=16, steps=2, heads=2, head_dim=4, memories=8), 0)
        hist = fit(model, g, 40, 1e-2).history
        assert hist.loss.iloc[-1] < hist.loss.iloc[0], arm


@pytest.mark.slow
def test_compiled_kernel_equals_eager_and_trains_the_same():
    edges, x, Wq, Wk, xi = rand_problem()
    args = dict(edges=edges, gamma=torch.tensor(1.0), delta=torch.zeros(12), Wq=Wq.float(), Wk=Wk.float(),
                scale=torch.tensor([2.0, 5.0]), xi=xi.float(), w_e=torch.tensor(1.0), k_inh=torch.tensor(0.5), eta=0.1)
    out = dynamics_step_compiled(x.float(), **args)
    assert compiled_ran(dynamics_step_compiled)
    torch.testing.assert_close(out, dynamics_step_autograd(x.float(), **args), rtol=1e-5, atol=1e-5)
    g = small_graph()
    losses = []
    for compiled in (False, True):
        model = build_arm("CDAT", g.inputs().shape[1], dict(d=16, steps=2, heads=2, head_dim=4, memories=8), 0)
        losses.append(fit(model, g, 3, 1e-2, compiled=compiled).history.loss.to_numpy())
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4)


@pytest.mark.gpu
def test_cuda_forward_matches_cpu():
    g = small_graph()
    model = build_arm("CDAT", g.inputs().shape[1], dict(d=16, steps=2, heads=2, head_dim=4, memories=8), 0)
    cpu = model(g.inputs(), g.edges)
    gc = make_graph(*(v for v in (g.x.numpy(), g.adj, g.labels.numpy(), g.kind)), 4, 0, device="cuda")
    torch.testing.assert_close(model.cuda()(gc.inputs(), gc.edges).cpu(), cpu, rtol=1e-4, atol=1e-4)


def test_adjacency_from_edges():
    """An undirected edge list -> the symmetric adjacency (hand-checked), duplicates and self-loops dropped; bad ids named."""
    a = adjacency_from_edges([(0, 1), (1, 0), (1, 2), (3, 3)], 4)
    assert (a == np.array([[0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]], bool)).all()
    assert edge_index(a).shape == (2, 4 + 4) and not adjacency_from_edges([], 3).any()
    with pytest.raises(ValueError, match="pairs"):
        adjacency_from_edges([(0, 4)], 4)
    with pytest.raises(ValueError, match="pairs"):
        adjacency_from_edges([(-1, 0)], 4)


def test_moved_harness_names_resolve_with_a_warning():
    """Names that moved to cdat_experiment in the module split still import from cdat (deprecated)."""
    import kimi_papers.architectures.cdat as method
    import kimi_papers.architectures.cdat_experiment as experiment
    with pytest.warns(DeprecationWarning, match="cdat_experiment"):
        assert method.fit is experiment.fit and method.make_graph is experiment.make_graph
    with pytest.raises(AttributeError, match="no_such_name"):
        method.no_such_name
