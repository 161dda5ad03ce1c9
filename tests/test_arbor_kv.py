"""ArborKV (serving/arbor_kv): tree bookkeeping, token-extractive allocation, rehydration, replay invariants and the
fused compacted-attention kernel, on core.kv's tiny random Llama (fast, CPU)."""
import math

import pytest
import torch

from kimi_papers.core.kv import cache_layers, tiny_llama
from kimi_papers.core.token_stats import kl_categorical
from kimi_papers.serving.arbor_kv import (
    MSVE, BlockKVStore, ThoughtTree, arborkv_allocate, build_path_cache, children_mask, compacted_attention,
    forward_children, kl_full_to, next_token_entropy, protected_set, rehydrate, split_budget)
from kimi_papers.serving.arbor_kv_experiment import (
    POLICIES, Puzzle, apply_step, branch_lru_evict, calibrate_msve, compacted_attention_reference, fit_logistic,
    flat_h2o_allocate, hand_built_log, make_puzzles, masked_full_attention, replay, solvable, step_value,
    streaming_allocate)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def log(model):
    return hand_built_log(model, seed=0)


def full_store(log):
    st = BlockKVStore()
    for b in range(len(log.tree)):
        st.put(b, log.store.k[b], log.store.v[b])
    return st


def test_tree_paths_and_distances():
    t = ThoughtTree([1, 2, 3])
    a = t.add_child(0, [4, 5])
    b = t.add_child(a, [6])
    c = t.add_child(0, [7, 8, 9])
    assert t.path(b) == [0, a, b] and t.distance(b, c) == 3 and t.distance(a, a) == 0
    assert t[b].start == 5 and t[c].start == 3 and t[c].offset == 6 and t.total == 9
    assert t.descendants(0) == [a, b, c] and t.descendants(b) == []
    assert t.add_child(a, []) is None and len(t) == 4          # zero-length blocks are skipped
    with pytest.raises(ValueError, match="parent=9"):
        t.add_child(9, [1])
    with pytest.raises(ValueError, match="root_ids"):
        ThoughtTree([])


def test_children_forward_matches_plain_forward(model, log):
    """The block cache + one forward with the 4-D mask gives the logits of running each path + child alone."""
    tree, leaf = log.tree, 4
    kids = [[5, 6, 7], [8, 9]]
    cp = forward_children(model, tree, log.store, leaf, kids)
    prefix = [t for b in tree.path(leaf) for t in tree[b].ids]
    for kid, lg in zip(kids, cp.logits):
        with torch.no_grad():
            ref = model(torch.tensor([prefix + kid])).logits[0, len(prefix):]
        torch.testing.assert_close(lg, ref, atol=1e-5, rtol=1e-5)


def test_eviction_keeps_positions(model, log):
    """A compacted cache equals the full path with −inf on the evicted keys at the ORIGINAL positions."""
    tree, leaf = log.tree, 8
    st = full_store(log)
    st.keep[0] = torch.tensor([0, 1, 2, 3, 10, 20, 23])
    st.keep[1] = torch.tensor([2, 5])
    kid = [11, 12, 13]
    cp = forward_children(model, tree, st, leaf, [kid])
    _, pos, gidx = build_path_cache(tree, st, leaf)
    assert pos[0, :7].tolist() == [0, 1, 2, 3, 10, 20, 23] and pos[0, 7:9].tolist() == [24 + 2, 24 + 5]
    prefix = [t for b in tree.path(leaf) for t in tree[b].ids]
    P = len(prefix)
    allowed = torch.zeros(P + 3, dtype=torch.bool)
    offs = 0
    for b in tree.path(leaf):
        allowed[offs + st.keep[b]] = True
        offs += tree[b].n
    mask = torch.full((3, P + 3), float("-inf"))
    for i in range(3):
        mask[i, allowed] = 0.0
        mask[i, P:P + i + 1] = 0.0
    full_mask = torch.zeros(P + 3, P + 3)
    full_mask[:P] = torch.triu(torch.full((P, P + 3), float("-inf")), 1)
    full_mask[P:] = mask
    with torch.no_grad():
        ref = model(torch.tensor([prefix + kid]), attention_mask=full_mask[None, None]).logits[0, P:]
    torch.testing.assert_close(cp.logits[0], ref, atol=1e-5, rtol=1e-5)
    # renumbering the retained tokens' successors (children right after the compacted cache) changes the result
    cache, _, _ = build_path_cache(tree, st, leaf)
    n = int(gidx.numel())
    with torch.no_grad():
        renum = model(torch.tensor([kid]), cache=cache, position_ids=torch.arange(n, n + 3)[None]).logits[0]
    assert not torch.allclose(cp.logits[0], renum, atol=1e-4)


def test_siblings_never_attend_each_other(model, log):
    mask = children_mask([2, 3], 4)
    assert mask.shape == (1, 1, 5, 9)
    assert torch.isinf(mask[0, 0, 2:, 4:6]).all() and torch.isinf(mask[0, 0, :2, 6:]).all()
    both = forward_children(model, log.tree, log.store, 3, [[1, 2], [3, 4, 5]])
    alone = forward_children(model, log.tree, log.store, 3, [[3, 4, 5]])
    torch.testing.assert_close(both.logits[1], alone.logits[0], atol=1e-5, rtol=1e-5)


def test_split_budget_hand_case():
    assert split_budget([1, 1, 2], [10, 1, 10], 8) == [2, 1, 5]
    assert split_budget([1, 1], [3, 3], 100) == [3, 3]
    assert split_budget([1, 3], [5, 5], 1) == [0, 1]
    assert split_budget([1, 1], [0, 4], 3) == [0, 3]


def test_arborkv_allocation(log):
    tree, st, leaf = log.tree, full_store(log), 8
    mass = log.mass_at(len(log.events))
    scores = {b: 1.0 for b in st.keep}
    prot = protected_set(tree, st, leaf)
    n_prot = sum(int(p.numel()) for p in prot.values())
    assert n_prot == 4 + 6 + 8 + 6 + 6     # sinks, leaf (6), tails of root (8), block 1 (6), block 4 (6)
    out = arborkv_allocate(tree, st, leaf, scores, mass, n_prot + 10)
    assert sum(int(v.numel()) for v in out.values()) == n_prot + 10
    for b, p in prot.items():
        assert bool(torch.isin(p, out[b]).all())
    assert out[9].numel() >= out[3].numel()     # the sibling (distance 2) keeps at least what a cousin (4) keeps
    # all-equal scores reduce to distance-only allocation
    other = arborkv_allocate(tree, st, leaf, {b: 0.3 for b in st.keep}, mass, n_prot + 10)
    assert all(torch.equal(out[b], other[b]) for b in out)
    # within a block the highest-mass tokens survive
    root_extra = out[0][~torch.isin(out[0], prot[0])]
    if root_extra.numel():
        cand = st.keep[0][~torch.isin(st.keep[0], prot[0])]
        assert mass[root_extra].min() >= mass[cand[~torch.isin(cand, root_extra)]].max()
    with pytest.raises(ValueError, match=f"minimum feasible budget here is {n_prot}"):
        arborkv_allocate(tree, st, leaf, scores, mass, n_prot - 1)
    with pytest.raises(ValueError, match="lam"):
        arborkv_allocate(tree, st, leaf, scores, mass, 60, lam=-0.1)


def test_allocation_rejects_missing_nan_negative_scores(log):
    """Missing block scores were a bare KeyError, NaN / negative ones silently counted as 0: now ValueErrors that
    name the blocks; short or NaN token scores (an IndexError / an arbitrary order before) name token_scores."""
    tree, st, leaf = log.tree, full_store(log), 8
    mass = log.mass_at(len(log.events))
    ok = {b: 1.0 for b in st.keep}
    with pytest.raises(ValueError, match=r"no block score s_i for block\(s\) \[3, 5\]"):
        arborkv_allocate(tree, st, leaf, {b: s for b, s in ok.items() if b not in (3, 5)}, mass, 40)
    with pytest.raises(ValueError, match=r"block\(s\) \[9\]"):            # a sequence indexed by block id, too short
        arborkv_allocate(tree, st, leaf, [1.0] * 9, mass, 40)
    for bad in (float("nan"), -1e-3, float("-inf"), float("inf")):
        with pytest.raises(ValueError, match=r"scores: block score\(s\) \{7: "):
            arborkv_allocate(tree, st, leaf, {**ok, 7: bad}, mass, 40)
    with pytest.raises(ValueError, match=r"token_scores: expected a \[74\] tensor"):
        arborkv_allocate(tree, st, leaf, ok, mass[:60], 40)
    with pytest.raises(ValueError, match="token_scores: 2 NaN, infinite or negative value.*token 3"):
        arborkv_allocate(tree, st, leaf, ok, torch.where(torch.isin(torch.arange(74), torch.tensor([3, 50])), -1.0, mass), 40)
    with pytest.raises(ValueError, match="token_scores"):
        flat_h2o_allocate(tree, st, mass[:10], 5)
    with pytest.raises(ValueError, match="weights"):
        split_budget([1.0, float("nan")], [3, 3], 4)
    gone = full_store(log)
    del gone.keep[4], gone.k[4], gone.v[4]
    with pytest.raises(ValueError, match=r"leaf=8: block\(s\) \[4\] on the path"):
        protected_set(tree, gone, 8)
    # a sequence / tensor indexed by block id gives what the mapping gives
    seq = arborkv_allocate(tree, st, leaf, torch.ones(len(tree)), mass, 40)
    assert all(torch.equal(seq[b], v) for b, v in arborkv_allocate(tree, st, leaf, ok, mass, 40).items())


def test_kl_full_to_is_core_kl_clamped():
    g = torch.Generator().manual_seed(3)
    ref = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    logits = torch.randn(5, 11, generator=g)
    old = (ref.exp() * (ref - torch.log_softmax(logits, -1))).sum(-1).clamp(min=0)
    assert torch.equal(kl_full_to(ref, logits), old)                   # bit-identical to the expression it replaced
    assert torch.equal(kl_full_to(ref, logits), kl_categorical(ref, torch.log_softmax(logits, -1)).clamp(min=0))
    assert float(kl_full_to(ref, ref).abs().max()) == 0.0


def test_moved_names_still_resolve():
    import kimi_papers.serving.arbor_kv as m
    import kimi_papers.serving.arbor_kv_experiment as e
    with pytest.warns(DeprecationWarning, match="arbor_kv_experiment"):
        assert m.replay is e.replay and m.hand_built_log is e.hand_built_log
    with pytest.raises(AttributeError):
        m.not_a_name


def test_baseline_allocators(log):
    tree, st = log.tree, full_store(log)
    mass = torch.arange(tree.total, dtype=torch.float32)      # newer tokens score higher
    h2o = flat_h2o_allocate(tree, st, mass, 10)
    kept = torch.cat([tree.global_index(b, h2o[b]) for b in sorted(h2o)])
    assert sorted(kept.tolist()) == list(range(tree.total - 10, tree.total))
    sl = streaming_allocate(tree, st, 8, 14)
    assert sl[0].tolist() == [0, 1, 2, 3] and sl[8].tolist() == list(range(6))
    assert sl[4].tolist() == [2, 3, 4, 5] and all(sl[b].numel() == 0 for b in sl if b not in (0, 4, 8))
    lru = branch_lru_evict(tree, st, 8, {b: b for b in st.keep}, 24 + 6 + 6 + 6)
    assert all(lru[b].numel() == tree[b].n for b in tree.path(8))
    assert sum(int(v.numel()) for v in lru.values()) <= 42
    with pytest.raises(ValueError, match="budget"):
        streaming_allocate(tree, st, 8, 2)


def test_rehydrate_restores_full_kv(model, log):
    st = full_store(log)
    st.keep[1] = st.keep[1][:2]          # 2 of 6 retained: below rho_min = 0.5
    st.keep[4] = st.keep[4][:5]          # 5 of 6: stays
    n = rehydrate(model, log.tree, st, 8)
    assert n == log.tree[1].n
    torch.testing.assert_close(st.k[1], log.store.k[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(st.v[1], log.store.v[1], atol=1e-5, rtol=0)
    assert st.keep[4].numel() == 5 and rehydrate(model, log.tree, st, 0) == 0   # the root needs no rehydration
    with pytest.raises(ValueError, match="rho_min"):
        rehydrate(model, log.tree, st, 8, rho_min=1.5)


def test_full_cache_replay_reproduces_reference(model, log):
    for t, ev in enumerate(log.events):
        cp = forward_children(model, log.tree, log.store, ev.node, [log.tree[c].ids for c in ev.children])
        torch.testing.assert_close(torch.log_softmax(torch.cat(cp.logits), -1), log.ref_logp[t], atol=1e-5, rtol=0)


def test_replay_invariants(model, log):
    theta = torch.tensor([1.0, 0.0, 0.0, 0.0])
    full = replay(model, log, "full", 1.0, reserve=14)
    assert full.mean_kl == 0.0 and full.peak == log.full_peak
    for pol in POLICIES[1:]:
        r = replay(model, log, pol, 0.7, theta=theta, reserve=14)
        assert not r.infeasible and math.isfinite(r.mean_kl) and r.mean_kl >= 0
        if pol != "branch_lru":
            assert r.max_after_alloc <= r.budget - r.reserve
            assert max(r.resident) <= r.budget or pol == "arborkv"
    lru = replay(model, log, "branch_lru", 0.7, reserve=14)
    assert lru.mean_kl == 0.0                  # exact recompute
    tiny = replay(model, log, "arborkv", 0.3, theta=theta, reserve=14)
    assert "minimum feasible budget" in tiny.infeasible and math.isnan(tiny.mean_kl)
    with pytest.raises(ValueError, match="policy"):
        replay(model, log, "lru", 0.5)
    with pytest.raises(ValueError, match="budget_frac"):
        replay(model, log, "flat_h2o", 1.5)
    with pytest.raises(ValueError, match="theta"):
        replay(model, log, "arborkv", 0.5)


def test_msve_and_calibration(model, log):
    X = torch.tensor([[0.0, 1.0], [1.0, 1.0], [2.0, 1.0], [3.0, 1.0]])
    th = fit_logistic(X, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    assert th[0] > 0 and torch.sigmoid(X @ th)[3] > 0.5 > torch.sigmoid(X @ th)[0]
    with pytest.raises(ValueError, match="theta"):
        MSVE([1.0, 2.0])
    s = MSVE([0.0, 0.0, 0.0, 100.0])(torch.ones(3, 4))
    assert torch.all(s <= 1) and torch.all(s >= 0.99)
    theta, data = calibrate_msve(model, [log])
    assert theta.shape == (4,) and len(data["drop"]) == 3      # blocks 1, 2, 4 have descendants
    assert torch.equal(data["label"], (data["drop"] > data["threshold"]).float())


def test_entropy_and_countdown():
    assert next_token_entropy(torch.tensor([0.0, float("-inf"), float("-inf")])) == 0.0
    assert math.isclose(float(next_token_entropy(torch.zeros(8))), math.log(8), rel_tol=1e-6)
    assert solvable((3, 5, 2), 10) and solvable((9, 4), 5) and not solvable((1, 1), 5)
    assert apply_step("8+5=13 (left: 13 2)", (2, 5, 8)) == (2, 13)
    assert apply_step("8+5=12", (2, 5, 8)) is None and apply_step("7+5=12", (2, 5, 8)) is None
    assert step_value(None, 5) == 0.0 and step_value((2, 3), 5) == 1.0 and step_value((2, 9), 5) == 0.5 / 4
    ps = make_puzzles(3, seed=1)
    assert ps == make_puzzles(3, seed=1) and all(solvable(p.numbers, p.target) for p in ps)
    assert isinstance(ps[0], Puzzle)


def test_kernel_matches_masked_attention():
    g = torch.Generator().manual_seed(0)
    q, K, V = torch.randn(2, 6, 5, 8, generator=g), torch.randn(2, 3, 40, 8, generator=g), torch.randn(2, 3, 40, 8, generator=g)
    idx = torch.tensor([0, 1, 7, 8, 9, 20, 33, 39])
    out, col = compacted_attention(q, K, V, idx)
    out_m, col_m = masked_full_attention(q, K, V, idx)
    torch.testing.assert_close(out, out_m, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(col, col_m[..., idx], atol=1e-5, rtol=1e-5)
    assert col_m[..., [2, 3, 4]].abs().max() == 0
    assert torch.allclose(col.sum(-1), torch.full((2,), 6.0 * 5))      # every query's row sums to 1
    blocks = [(K[..., :10, :], V[..., :10, :], idx[idx < 10]), (K[..., 10:, :], V[..., 10:, :], idx[idx >= 10] - 10)]
    out_r, col_r = compacted_attention_reference(q, [b[0] for b in blocks], [b[1] for b in blocks], [b[2] for b in blocks])
    torch.testing.assert_close(out, out_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(col, col_r, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda():
    q, K, V = (torch.randn(*s, device="cuda") for s in ((9, 4, 64), (3, 50, 64), (3, 50, 64)))
    idx = torch.arange(0, 50, 3, device="cuda")
    out, col = compacted_attention(q, K, V, idx)
    out_m, col_m = masked_full_attention(q, K, V, idx)
    torch.testing.assert_close(out, out_m, atol=1e-4, rtol=1e-4)
    assert out.device.type == "cuda" and col.shape == (idx.numel(),)
