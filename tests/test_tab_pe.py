"""kimi_papers.science.tab_pe as a library: the schema and APIs, the vote kernel against sklearn's brute-force neighbours
(ties, sensitivity, compiled == eager), the GDP/zCDP accounting against hand-computed cases, Tab-PE and the marginal
baselines on XOR tables with known parity, and bad input."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.neighbors import NearestNeighbors

from kimi_papers.science.tab_pe import (
    TableSchema, check_table, contingency, default_delta, discretise, embed, epsilon_for, gaussian_sigma_for, gdp_delta,
    independent_marginals, kway_marginal, marginal_tvd, mst_style, mutation_rate, nn_chunk_compiled, nn_vote,
    nn_vote_cdist, random_api, split_counts, tab_pe, undiscretise, variation_api, zcdp_rho)
from kimi_papers.science.tab_pe_experiment import downstream_accuracy, load_sklearn, make_xor, parity_fraction
from kimi_papers.science.tab_pe import _select

CUDA = torch.cuda.is_available()


def small_schema():
    return TableSchema(cat={"c": ["a", "b", "c"]}, num={"x": (0.0, 10.0, True), "z": (3.0, 3.0, False)}, label="y",
                       label_values=[0, 1], label_props=[0.25, 0.75])


@pytest.fixture(scope="module")
def xor3():
    return make_xor(3, 3000, rng=np.random.default_rng(0))


def test_schema_and_check_table_errors():
    sc = small_schema()
    df = pd.DataFrame({"c": ["a", "c"], "x": [0.0, 10.0], "z": [3.0, 3.0], "y": [0, 1]})
    assert check_table(df, sc) is df
    with pytest.raises(ValueError, match="empty category list"):
        TableSchema(cat={"c": []}, num={}, label="y", label_values=[0], label_props=[1.0])
    with pytest.raises(ValueError, match="lo <= hi"):
        TableSchema(cat={}, num={"x": (2.0, 1.0, False)}, label="y", label_values=[0], label_props=[1.0])
    with pytest.raises(ValueError, match="must not also be a feature"):
        TableSchema(cat={"y": [0]}, num={}, label="y", label_values=[0], label_props=[1.0])
    with pytest.raises(ValueError, match="public bounds"):
        check_table(df.assign(x=[0.0, 11.0]), sc)
    with pytest.raises(ValueError, match="NaN"):
        check_table(df.assign(x=[np.nan, 1.0]), sc)
    with pytest.raises(ValueError, match="missing columns"):
        check_table(df.drop(columns="z"), sc)
    with pytest.raises(TypeError, match="DataFrame"):
        check_table(df.to_numpy(), sc)


def test_random_and_variation_apis():
    sc, rng = small_schema(), np.random.default_rng(0)
    r = random_api(sc, 6000, rng)
    check_table(r, sc)
    assert abs((r.y == 1).mean() - 0.75) < 0.025 and set(r.x) == set(range(11)) and (r.z == 3.0).all()
    v = variation_api(r, sc, 0.3, rng)
    assert abs((v.c != r.c).mean() - 0.3 * 2 / 3) < 0.025       # resampled w.p. 0.3, lands elsewhere w.p. 2/3
    assert ((v.x - r.x).abs() <= 3).all() and (v.x != r.x).mean() > 0.5 and (v.z == 3.0).all() and (v.y == r.y).all()
    assert (variation_api(r, sc, 0.0, rng)[sc.columns].to_numpy() == r[sc.columns].to_numpy()).all()   # rate 0: identity
    assert mutation_rate(0, 20) == 0.5 and math.isclose(mutation_rate(20, 20), 0.01)
    assert math.isclose(mutation_rate(5, 20), 0.5 - 0.49 * 0.25 ** 0.2)
    with pytest.raises(ValueError, match="rate"):
        variation_api(r, sc, -0.1, rng)
    with pytest.raises(ValueError, match="n="):
        random_api(sc, -1, rng)


def test_embed_hand_case():
    sc = small_schema()
    e = embed(pd.DataFrame({"c": ["b"], "x": [5.0], "z": [3.0], "y": [1]}), sc, w_cat=0.5, w_num=2.0)
    assert e.dtype == np.float32 and np.allclose(e, [[0, 0.5, 0, 1.0, 0.0]])


def test_vote_matches_sklearn_brute_and_k2():
    g = torch.Generator().manual_seed(1)
    p, s = torch.rand(900, 5, generator=g, dtype=torch.float64), torch.rand(250, 5, generator=g, dtype=torch.float64)
    nn = NearestNeighbors(n_neighbors=2, algorithm="brute").fit(s.numpy())
    idx = nn.kneighbors(p.numpy(), return_distance=False)
    assert (nn_vote(p, s, chunk=100).numpy() == np.bincount(idx[:, 0], minlength=250)).all()
    assert (nn_vote(p.numpy(), s.numpy().astype(np.float32)) == np.bincount(idx[:, 0], minlength=250)).all()
    assert np.allclose(nn_vote(p, s, k=2).numpy(), np.bincount(idx.ravel(), minlength=250) / math.sqrt(2))
    assert (nn_vote_cdist(p, s).numpy() == np.bincount(idx[:, 0], minlength=250)).all()


def test_vote_tie_rule_lowest_index():
    s = torch.tensor([[1.0, 0.0], [0.0, 0.0], [-1.0, 0.0], [0.0, 0.0]])
    # origin: candidates 1 and 3 tie at 0 -> 1; (0.5, 0): 0 and 1 tie at 0.5 -> 0; (-0.5, 0): 1 and 2 tie -> 1
    assert nn_vote(torch.tensor([[0.0, 0.0], [0.5, 0.0], [-0.5, 0.0]]), s).tolist() == [1.0, 2.0, 0.0, 0.0]
    assert nn_vote(torch.tensor([[0.0, 0.0]]), s, k=2).mul(math.sqrt(2)).tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("k", [1, 2, 4])
def test_removing_one_row_moves_histogram_by_l2_one(k):
    g = torch.Generator().manual_seed(k)
    p, s = torch.rand(40, 3, generator=g), torch.rand(30, 3, generator=g)
    full = nn_vote(p, s, k=k)
    for i in range(40):
        assert math.isclose(torch.linalg.vector_norm(full - nn_vote(torch.cat([p[:i], p[i + 1:]]), s, k=k)).item(), 1.0, abs_tol=1e-12)


def test_vote_bad_input():
    p = torch.rand(5, 3)
    with pytest.raises(ValueError, match="widths differ"):
        nn_vote(p, torch.rand(4, 2))
    with pytest.raises(ValueError, match="k=5"):
        nn_vote(p, torch.rand(4, 3), k=5)
    with pytest.raises(ValueError, match="2-d"):
        nn_vote(torch.rand(5), torch.rand(4, 3))
    with pytest.raises(ValueError, match="NaN"):
        nn_vote(torch.full((2, 3), float("nan")), torch.rand(4, 3))
    with pytest.raises(ValueError, match="chunk"):
        nn_vote(p, torch.rand(4, 3), chunk=0)


@pytest.mark.slow
def test_compiled_vote_equals_eager():
    g = torch.Generator().manual_seed(2)
    for n, m in ((700, 300), (1500, 800)):
        p, s = torch.rand(n, 18, generator=g), torch.rand(m, 18, generator=g)
        assert (nn_vote(p, s, chunk=512, compiled=True) == nn_vote(p, s, chunk=512)).all()
    assert nn_chunk_compiled.compile_state.compiled_calls > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_vote_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(3)
    p, s = torch.rand(3000, 18, generator=g, dtype=torch.float64), torch.rand(900, 18, generator=g, dtype=torch.float64)
    out = nn_vote(p.cuda(), s.cuda())
    assert out.device.type == "cuda" and (out.cpu() == nn_vote(p, s)).all()


def test_gdp_accounting():
    d = default_delta(5000)
    assert math.isclose(d, 1 / (5000 * math.log(5000)))
    assert abs(gaussian_sigma_for(1.0, d, 20) - 15.81) < 0.01 and abs(gaussian_sigma_for(1.0, d, 19) - 15.41) < 0.01
    for eps in (0.3, 1.0, 5.0):
        for T in (1, 7, 30):
            assert abs(epsilon_for(gaussian_sigma_for(eps, 1e-5, T), 1e-5, T) - eps) < 1e-6
    assert math.isclose(epsilon_for(9.0, 1e-5, 9), epsilon_for(3.0, 1e-5, 1), rel_tol=1e-10)   # composition: mu = sqrt(T)/sigma
    assert math.isclose(gdp_delta(1.0, 2.0), 0.6914624612740131 - math.e * 0.06680720126885807, rel_tol=1e-10)  # Phi(.5) - e Phi(-1.5)
    assert epsilon_for(1000.0, 0.5, 1) == 0.0                                                     # delta above delta(0)
    with pytest.raises(ValueError, match="epsilon"):
        gaussian_sigma_for(-1.0, 1e-5, 3)
    with pytest.raises(ValueError, match="delta"):
        gaussian_sigma_for(1.0, 0.0, 3)
    with pytest.raises(ValueError, match="T="):
        gaussian_sigma_for(1.0, 1e-5, 0)
    with pytest.raises(ValueError, match="so large"):
        gaussian_sigma_for(500.0, 1e-5, 1)
    with pytest.raises(ValueError, match="sigma"):
        epsilon_for(0.0, 1e-5, 3)


def test_zcdp_rho_inverts():
    for eps, delta in ((0.5, 1e-6), (1.0, 2.3e-5), (8.0, 1e-3)):
        rho = zcdp_rho(eps, delta)
        assert math.isclose(rho + 2 * math.sqrt(rho * math.log(1 / delta)), eps, rel_tol=1e-12)


def test_split_counts_and_select():
    assert split_counts(10, [0.37, 0.63]) == [4, 6] and split_counts(7, [1 / 3] * 3) == [3, 2, 2] and split_counts(5, [1.0]) == [5]
    pop = pd.DataFrame({"v": np.arange(6)})
    assert _select(pop, np.array([0, 5, 1, 9, -3, 2.0]), 2, False, np.random.default_rng(0)).v.tolist() == [3, 1]
    picks = _select(pop, np.array([-1, -2, 0, -5, -1, -1.0]), 3000, True, np.random.default_rng(0)).v   # all <= 0: uniform
    assert set(picks) == set(range(6)) and picks.value_counts().min() > 400
    assert set(_select(pop, np.array([0, 0, 4, 0, -1, 0.0]), 50, True, np.random.default_rng(0)).v) == {2}


def test_tab_pe_runs_and_finds_parity_without_noise():
    df, sc = make_xor(2, 800, rng=np.random.default_rng(1))
    syn, h = tab_pe(df, sc, math.inf, T=6, N=101, rng=np.random.default_rng(2))
    check_table(syn, sc)
    assert len(syn) == 101 and len(h.selected) == len(h.rates) == 6 and (syn.y == 1).sum() == 50 and h.sigma == 0.0
    assert parity_fraction(h.selected[0], 2) < 0.8 < parity_fraction(syn, 2)
    again, _ = tab_pe(df, sc, math.inf, T=6, N=101, rng=np.random.default_rng(2))
    assert again.equals(syn)
    _, h1 = tab_pe(df, sc, 2.0, delta=1e-4, T=3, N=20, rng=np.random.default_rng(0))
    assert math.isclose(h1.sigma, gaussian_sigma_for(2.0, 1e-4, 3))
    with pytest.warns(RuntimeWarning, match="no private rows"):
        tab_pe(df[df.y == 1], sc, 1.0, T=2, N=10)
    with pytest.raises(ValueError, match="N=1"):
        tab_pe(df, sc, 1.0, N=1)
    with pytest.raises(ValueError, match="epsilon"):
        tab_pe(df, sc, 0.0)
    with pytest.raises(ValueError, match="public bounds"):
        tab_pe(df.assign(x0=df.x0 + 1.0), sc, 1.0)


def test_discretise_roundtrip_and_contingency(xor3):
    df, sc = xor3
    codes, sizes = discretise(df, sc, 16)
    assert sizes == [2] * 8 + [16, 16, 2]
    assert (discretise(undiscretise(codes, sc, 16, np.random.default_rng(0)), sc, 16)[0] == codes).all()
    tab = contingency(codes, sizes, [0, 1, 2, 10])
    assert tab.sum() == len(df) and tab[0, 0, 0, 1] == 0 and tab[1, 0, 0, 0] == 0 and tab[1, 1, 1, 1] > 0   # parity cells


def test_baselines_where_they_can_and_cannot_represent_parity(xor3):
    df, sc = xor3
    te, _ = make_xor(3, 1000, rng=np.random.default_rng(5))
    assert abs(parity_fraction(mst_style(df, sc, 1.0, 1e-5, N=3000, rng=np.random.default_rng(0)), 3) - 0.5) < 0.04
    assert parity_fraction(kway_marginal(df, sc, 1.0, 1e-5, N=1000, rng=np.random.default_rng(0)), 3) > 0.9
    assert parity_fraction(kway_marginal(df, sc, 1.0, 1e-5, N=1000, m=3, rng=np.random.default_rng(0)), 3) < 0.6
    d1, s1 = make_xor(1, 3000, rng=np.random.default_rng(3))
    t1, _ = make_xor(1, 1000, rng=np.random.default_rng(4))
    assert downstream_accuracy(mst_style(d1, s1, 1.0, 1e-5, N=800, rng=np.random.default_rng(0)), t1, s1) > 0.9
    ind = independent_marginals(df, sc, 1.0, 1e-5, N=4000, rng=np.random.default_rng(0))
    check_table(ind, sc)
    assert abs(ind.b0.astype(int).mean() - df.b0.mean()) < 0.05 and abs(parity_fraction(ind, 3) - 0.5) < 0.04
    with pytest.raises(ValueError, match="m=20"):
        kway_marginal(df, sc, 1.0, 1e-5, m=20)
    with pytest.raises(ValueError, match="delta"):
        mst_style(df, sc, 1.0, 1.0)


def test_marginal_tvd_hand_case():
    sc = TableSchema(cat={"c": [0, 1]}, num={}, label="y", label_values=[0, 1], label_props=[0.5, 0.5])
    a = pd.DataFrame({"c": [0, 0, 1, 1], "y": [0, 1, 0, 1]})
    b = pd.DataFrame({"c": [0, 0, 0, 0], "y": [0, 1, 0, 1]})
    assert marginal_tvd(a, a, sc, 2) == 0.0
    assert math.isclose(marginal_tvd(a, b, sc, 2, n_marginals=3), 0.5)    # the only 2-way marginal: (c, y)
    with pytest.raises(ValueError, match="way=3"):
        marginal_tvd(a, b, sc, 3)


def test_downstream_and_loaders(xor3):
    df, sc = xor3
    te, _ = make_xor(3, 800, rng=np.random.default_rng(6))
    assert downstream_accuracy(df, te, sc, "hgb") > 0.9 and downstream_accuracy(df.assign(y=1), te, sc) == (te.y == 1).mean()
    with pytest.raises(ValueError, match="evaluator"):
        downstream_accuracy(df, te, sc, "knn")
    tr, tt, bs = load_sklearn("breast_cancer", 1)
    check_table(tr, bs); check_table(tt, bs)
    assert (len(tr), len(tt), len(bs.num)) == (398, 171, 30) and bs.label_values == [0, 1]
    with pytest.raises(ValueError, match="name="):
        load_sklearn("adult")


def test_moved_harness_names_still_resolve():
    """Names that lived in the method module before the split resolve from the experiment module, with a warning."""
    import kimi_papers.science.tab_pe as method
    import kimi_papers.science.tab_pe_experiment as experiment
    with pytest.warns(DeprecationWarning, match="tab_pe_experiment"):
        assert method.make_xor is experiment.make_xor
    with pytest.raises(AttributeError, match="no_such_name"):
        method.no_such_name
