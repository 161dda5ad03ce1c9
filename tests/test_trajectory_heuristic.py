"""kimi_papers.science.trajectory_heuristic as a library: the pocket cube against the published QTM histogram, the
log-space forward-backward against a float64 dense reference and brute-force path enumeration, Baum-Welch on exact
counts, the ranking metric and BWAS on the exact heuristic, short training runs, and bad input."""
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kimi_papers.science.trajectory_heuristic import (
    METHODS, HeuristicConfig, HeuristicNet, baum_welch_update, fb_step_compiled, hmm_forward_backward,
    initial_p_plus, scaled_log_emissions, trajectory_lengths, tridiag_log_transitions)
from kimi_papers.science.trajectory_heuristic_experiment import (
    GODS_NUMBER, N_STATES, QTM_HISTOGRAM, PocketCube, batched_weighted_astar, bwas_eval, heuristic_fn,
    local_ranking_accuracy, random_walk_trajectories, ranking_in_range, states_by_depth, train_heuristic)
from kimi_papers.core.kernels import compiled_ran
from scipy.special import logsumexp as np_logsumexp

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def cube():
    return PocketCube()


@pytest.fixture(scope="module")
def dist(cube):
    return cube.bfs_distances()


def exact(dist):
    return lambda i: dist[np.asarray(i)].astype(np.float64)


def test_bfs_matches_published_histogram_and_parity(cube, dist):
    assert tuple(np.bincount(dist)) == QTM_HISTOGRAM and dist.max() == GODS_NUMBER and sum(QTM_HISTOGRAM) == N_STATES
    probe = np.random.default_rng(0).integers(0, N_STATES, 50000)
    step = dist[cube.neighbors(probe)].astype(int) - dist[probe, None]
    assert set(np.unique(step)) == {-1, 1}
    assert (cube._bfs()[:100000] == dist[:100000]).all()  # the cached table equals a fresh search


def test_moves_group_structure(cube):
    s = np.random.default_rng(1).integers(0, N_STATES, 2000)
    for m in range(6):
        assert (cube.apply(cube.apply(s, m), m ^ 1) == s).all()
        x = s
        for _ in range(4):
            x = cube.apply(x, m)
        assert (x == s).all() and not (cube.apply(s, m) == s).all()
    perm_tab, twist_tab = cube.move_tables()
    assert perm_tab.shape == (5040, 6) and twist_tab.shape == (729, 6)
    assert all(sorted(perm_tab[:, m]) == list(range(5040)) for m in range(6))  # each move is a bijection
    x = cube.encode(s[:9])
    assert x.shape == (9, 70) and x.dtype == torch.float32 and torch.equal(x[:, :49].reshape(9, 7, 7).sum(1), torch.ones(9, 7))
    with pytest.raises(ValueError, match="move"):
        cube.apply(s, -1)


def test_random_walks_never_undo(cube):
    idx, lengths = random_walk_trajectories(300, 9, np.random.default_rng(2), cube)
    assert (idx[:, 0] == 0).all() and lengths.min() >= 1 and lengths.max() <= 9
    for b in range(100):
        s = idx[b, :lengths[b] + 1]
        assert (idx[b, lengths[b] + 1:] == -1).all()
        mv = [int(np.flatnonzero(cube.neighbors(s[t:t + 1])[0] == s[t + 1])[0]) for t in range(lengths[b])]
        assert all(mv[t] != mv[t - 1] ^ 1 for t in range(1, len(mv)))
    with pytest.raises(ValueError, match="k_min"):
        random_walk_trajectories(3, 4, np.random.default_rng(0), cube, k_min=5)
    with pytest.raises(ValueError, match="goal"):
        trajectory_lengths(torch.tensor([[3, 4]]))


def hmm_reference_dense(log_emit: np.ndarray, log_trans: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """float64 reference with a dense (D+1)x(D+1) transition matrix, one trajectory at a time: log gamma [B, T, D+1]."""
    e, lt = np.asarray(log_emit, np.float64), np.asarray(log_trans, np.float64)
    n = lt.shape[0]
    log_a = np.full((n, n), -np.inf)
    for d in range(n):
        for j, nd in enumerate((d - 1, d, d + 1)):
            if 0 <= nd < n:
                log_a[d, nd] = lt[d, j]
    out = np.full(e.shape, -np.log(n))
    for b, L in enumerate(np.asarray(lengths)):
        al = [np.where(np.arange(n) == 0, 0.0, -np.inf) + e[b, 0]]
        for t in range(1, L + 1):
            al.append(e[b, t] + np_logsumexp(al[-1][:, None] + log_a, axis=0))
        be = [np.zeros(n)]
        for t in range(L - 1, -1, -1):
            be.append(np_logsumexp(log_a + (e[b, t + 1] + be[-1])[None], axis=1))
        post = np.array(al) + np.array(be[::-1])
        out[b, :L + 1] = post - np_logsumexp(post, axis=1, keepdims=True)
    return out


def brute_force(log_emit, log_trans, L):
    n = log_trans.shape[0]
    post, total = np.zeros((L + 1, n)), 0.0
    for path in itertools.product(range(n), repeat=L):
        p, lw = (0,) + path, log_emit[0, 0]
        for t in range(1, L + 1):
            step = p[t] - p[t - 1]
            lw = -np.inf if abs(step) > 1 else lw + log_trans[p[t - 1], step + 1] + log_emit[t, p[t]]
        if np.isfinite(lw):
            post[np.arange(L + 1), p] += np.exp(lw)
            total += np.exp(lw)
    return post / total


@pytest.mark.parametrize("D,T,pz", [(4, 7, 0.0), (3, 6, 0.3), (1, 5, 0.0), (2, 4, 0.5)])
def test_forward_backward_matches_dense_and_brute_force(D, T, pz):
    pp = (1 - pz) * initial_p_plus(D)
    pp[0] = 1 - pz
    lt = tridiag_log_transitions(pp, torch.full((D + 1,), pz)).double()
    le = torch.randn(5, T, D + 1, generator=torch.Generator().manual_seed(D), dtype=torch.float64)
    ln = torch.tensor([T - 1, 0, 2, T - 2, 1])
    lg, xi = hmm_forward_backward(le, lt, ln, compiled=False)
    ref = hmm_reference_dense(le.numpy(), lt.numpy(), ln.numpy())
    assert np.abs(lg.exp().numpy() - np.exp(ref)).max() < 1e-5
    for b in range(5):
        assert np.abs(brute_force(le[b].numpy(), lt.numpy(), int(ln[b])) - lg[b, :ln[b] + 1].exp().numpy()).max() < 1e-10
    assert torch.allclose(lg.exp().sum(-1), torch.ones(5, T, dtype=torch.float64))
    assert abs(xi.sum().item() - ln.sum().item()) < 1e-9


def test_uniform_emissions_respect_parity():
    """beta = 0 with p_0 = 0: the distance at step t has the parity of t (every move changes it by one)."""
    lg, _ = hmm_forward_backward(torch.zeros(3, 9, 17), tridiag_log_transitions(initial_p_plus(16)), torch.tensor([8, 5, 1]),
                                 compiled=False)
    g = lg.exp()
    for t in range(6):
        wrong = (torch.arange(17) % 2) != (t % 2)
        assert g[1, t, wrong].max() < 1e-6 and g[1, t, t + 1:].max() < 1e-6  # no distance beyond t
    assert torch.allclose(g[2, 1], F.one_hot(torch.tensor(1), 17).double().float())


def test_exact_emissions_recover_truth_and_counts(cube, dist):
    idx, _ = random_walk_trajectories(300, 20, np.random.default_rng(4), cube)
    ti = torch.from_numpy(idx)
    true = torch.from_numpy(dist[np.maximum(idx, 0)].astype(np.int64))
    le = torch.where(F.one_hot(true, 17).bool(), 0.0, -math.inf)
    lg, xi = hmm_forward_backward(le, tridiag_log_transitions(initial_p_plus(16)), trajectory_lengths(ti), compiled=False)
    on = ti >= 0
    assert torch.equal(lg.argmax(-1)[on], true[on])
    mv = on[:, 1:]
    up = torch.bincount(true[:, :-1][mv & (true[:, 1:] > true[:, :-1])], minlength=17).float()
    dn = torch.bincount(true[:, :-1][mv & (true[:, 1:] < true[:, :-1])], minlength=17).float()
    assert torch.allclose(xi[:, 2], up, atol=1e-3) and torch.allclose(xi[:, 0], dn, atol=1e-3)
    p = baum_welch_update(xi, smoothing=1.0)
    assert torch.allclose(p[1:-1], ((up + 1) / (up + dn + 2))[1:-1], atol=1e-5) and p[0] == 1 and p[-1] == 0


def test_bad_input_raises():
    lt = tridiag_log_transitions(initial_p_plus(4))
    with pytest.raises(ValueError, match="D >= 1"):
        tridiag_log_transitions(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="sum to 1"):
        tridiag_log_transitions(torch.tensor([1.0, 0.5, 0.4]))  # p_+(D) != 0
    with pytest.raises(ValueError, match="probabilities"):
        tridiag_log_transitions(torch.tensor([1.0, 1.5, 0.0]))
    with pytest.raises(ValueError, match="sum to 1"):
        hmm_forward_backward(torch.zeros(1, 3, 5), lt + 0.01, torch.tensor([2]), compiled=False)
    with pytest.raises(ValueError, match="lengths"):
        hmm_forward_backward(torch.zeros(1, 3, 5), lt, torch.tensor([-1]), compiled=False)
    with pytest.raises(ValueError, match="lengths"):
        hmm_forward_backward(torch.zeros(1, 3, 5), lt, torch.tensor([3]), compiled=False)
    with pytest.raises(ValueError, match="log_emit"):
        hmm_forward_backward(torch.zeros(1, 3, 4), lt, torch.tensor([2]), compiled=False)
    imp = torch.zeros(1, 4, 5)
    imp[0, 2] = -math.inf
    with pytest.raises(ValueError, match="impossible trajectory 0"):
        hmm_forward_backward(imp, lt, torch.tensor([3]), compiled=False)
    with pytest.raises(ValueError, match="beta"):
        scaled_log_emissions(torch.zeros(2, 5), -0.1, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="smoothing"):
        baum_welch_update(torch.ones(5, 3), smoothing=-1.0)
    for kw, name in ((dict(d_max=0), "d_max"), (dict(k_max=0), "k_max"), (dict(beta=-1.0), "beta"), (dict(lr=0.0), "lr")):
        with pytest.raises(ValueError, match=name):
            HeuristicConfig(**kw)


def test_scaled_emissions_divide_out_the_prior():
    logits = torch.randn(6, 5)
    le = scaled_log_emissions(logits, 1.0, torch.ones(6, dtype=torch.bool))
    q = torch.softmax(logits, -1)
    assert torch.allclose(le.exp(), q / q.mean(0), atol=1e-5)
    assert torch.equal(scaled_log_emissions(logits, 0.0, torch.ones(6, dtype=torch.bool)), torch.zeros(6, 5))
    assert torch.allclose(scaled_log_emissions(logits, 2.0, torch.ones(6, dtype=torch.bool)), 2 * le)


def test_ranking_metric_on_known_heuristics(cube, dist):
    ev = states_by_depth(dist, 15, range(1, 15), np.random.default_rng(5))
    r = local_ranking_accuracy(exact(dist), ev, dist, cube)
    assert r["pairwise"] == 1.0 and r["top1"] == 1.0 and ranking_in_range(r, 6, 13) == 1.0
    assert np.isnan(r["per_state"][r["per_state"].d == 14].pairwise).all()  # no farther neighbour at 14
    assert local_ranking_accuracy(lambda i: -exact(dist)(i), ev, dist, cube)["pairwise"] == 0.0
    flat = local_ranking_accuracy(lambda i: np.zeros(len(i)), ev, dist, cube)
    closer_share = (dist[cube.neighbors(ev)] < dist[ev, None]).mean(1).mean()
    assert flat["pairwise"] == 0.5 and abs(flat["top1"] - closer_share) < 1e-12
    with pytest.raises(ValueError, match="goal"):
        local_ranking_accuracy(exact(dist), np.array([0, 5]), dist, cube)


def test_bwas_exact_heuristic_is_optimal_and_budget_binds(cube, dist):
    starts = states_by_depth(dist, 2, range(8, 15), np.random.default_rng(6))
    for s in starts:
        ok, length, spent = batched_weighted_astar(exact(dist), int(s), cube, budget=2000)
        assert ok and length == dist[s] and 0 < spent <= 2000
    res = bwas_eval(lambda i: np.zeros(len(i)), starts[-2:], dist, cube, budget=128)
    assert res["solve_rate"] == 0.0 and res["expansions"] <= 128
    assert batched_weighted_astar(exact(dist), 0, cube) == (True, 0.0, 0)
    with pytest.raises(ValueError, match="start"):
        batched_weighted_astar(exact(dist), N_STATES, cube)
    with pytest.raises(ValueError, match="budget"):
        batched_weighted_astar(exact(dist), 5, cube, budget=0)


@pytest.mark.parametrize("method", METHODS)
def test_training_reduces_loss_and_is_seeded(cube, method):
    cfg = HeuristicConfig(steps=24, batch=16, k_max=10, em_every=8, width=32, depth=2, compiled=False)
    net, info = train_heuristic(method, cfg, cube)
    loss = info["history"].loss.to_numpy()
    assert np.isfinite(loss).all() and loss[-4:].mean() < loss[:4].mean()
    net2, _ = train_heuristic(method, cfg, cube)
    x = cube.encode(np.arange(50))
    assert torch.equal(net(x), net2(x))
    h = heuristic_fn(net, cube)(np.arange(10))
    assert h.shape == (10,) and h.dtype == np.float64
    if method == "hmm":
        assert info["em_rounds"] == 2
    with pytest.raises(ValueError, match="method"):
        train_heuristic("bogus", cfg, cube)


def test_heuristic_is_posterior_mean():
    net = HeuristicNet(d_max=4, width=8, depth=1)
    x = torch.randn(3, 70)
    assert torch.allclose(net.heuristic(x), torch.softmax(net(x), -1) @ torch.arange(5.0))
    assert HeuristicNet(d_max=4, width=8, depth=1, scalar=True)(x).shape == (3, 1)


@pytest.mark.slow
def test_compiled_scan_equals_eager():
    for B, T in ((5, 7), (33, 21)):
        args = (torch.randn(B, T, 17), tridiag_log_transitions(initial_p_plus(16)), torch.randint(0, T, (B,)))
        lc, xc = hmm_forward_backward(*args, compiled=True)
        assert compiled_ran(fb_step_compiled)
        le, xe = hmm_forward_backward(*args, compiled=False)
        assert (lc.exp() - le.exp()).abs().max() < 1e-5 and torch.allclose(xc, xe, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_matches_cpu(cube):
    cu = torch.device("cuda")
    args = (torch.randn(4, 9, 17), tridiag_log_transitions(initial_p_plus(16)), torch.randint(0, 9, (4,)))
    lg, xi = hmm_forward_backward(*(a.to(cu) for a in args), compiled=False)
    assert lg.device.type == "cuda" and (lg.exp().cpu() - hmm_forward_backward(*args, compiled=False)[0].exp()).abs().max() < 1e-5
    assert cube.encode(np.arange(4), cu).device.type == "cuda"
    net, _ = train_heuristic("hmm", HeuristicConfig(steps=4, batch=4, k_max=5, em_every=2, width=16, depth=1), cube, cu)
    assert next(net.parameters()).device.type == "cuda"


def test_moved_harness_names_still_resolve():
    """Names that lived in the method module before the split resolve from the experiment module, with a warning."""
    import kimi_papers.science.trajectory_heuristic as method
    import kimi_papers.science.trajectory_heuristic_experiment as experiment
    with pytest.warns(DeprecationWarning, match="trajectory_heuristic_experiment"):
        assert method.PocketCube is experiment.PocketCube
    with pytest.raises(AttributeError, match="no_such_name"):
        method.no_such_name


def test_posterior_labels_take_any_state_encoder():
    """posterior_labels needs only `encode(idx, device)`: a toy encoder of a line's states gives the same labels as
    the cube when the emissions are off (beta = 0: the dynamics alone)."""
    from kimi_papers.science.trajectory_heuristic import posterior_labels, tridiag_log_transitions

    class Line:
        def encode(self, idx, device=None):
            return F.one_hot(idx.long(), 8).float().to(device or "cpu")

    idx = torch.tensor([[0, 1, 2, 1, -1], [0, 1, 2, 3, 4]])
    lt = tridiag_log_transitions(initial_p_plus(7))
    target = torch.nn.Linear(8, 8)
    a = posterior_labels(idx, Line(), target, lt, beta=0.0, compiled=False)
    b = posterior_labels(idx, PocketCube(), None, lt, beta=0.0, compiled=False)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    lg, _ = posterior_labels(idx, Line(), target, lt, beta=1.0, compiled=False)   # emissions from the target on Line
    assert torch.allclose(lg.exp().sum(-1), torch.ones(2, 5))
