"""Library tests of kimi_papers.serving.spec_md that are cheaper as pytest than in the notebook."""
import math

import numpy as np
import pytest

from kimi_papers.serving.spec_md import (
    HardwareModel, PrefetchPlan, Trace, access_sequence, capacity_slots, load_trace, make_policy, olmoe_hardware,
    predict_prefetch, save_trace, simulate, synthetic_trace)

ONLINE = ("lru", "lfu", "fifo", "lfru", "least_stale")


def _trace_from_sets(passes: list, n_experts: int) -> Trace:
    """One request, one token per routed expert."""
    counts = np.zeros((1, len(passes), len(passes[0]), n_experts), np.uint16)
    for p, layers in enumerate(passes):
        for l, s in enumerate(layers):
            counts[0, p, l, list(s)] = 1
    z = np.zeros((1, len(passes), 2, len(passes[0]), 1))
    return Trace(counts, z.astype(np.uint8), z.astype(np.float16), top_k=1)


@pytest.fixture(scope="module")
def syn() -> Trace:
    return synthetic_trace(n_requests=3, n_decode=20, period=4, seed=7)


@pytest.mark.parametrize("capacity", [0, 1, 5, 13, 40, 256])
def test_least_stale_equals_lru_without_prefetch(syn, capacity):
    for hw in (None, olmoe_hardware(32)):
        a, b = simulate(syn, None, "lru", capacity, hw), simulate(syn, None, "least_stale", capacity, hw)
        assert np.array_equal(a.outcomes, b.outcomes) and a.ttft_s == b.ttft_s


@pytest.mark.parametrize("capacity", [1, 7, 13, 26])
def test_belady_bounds_every_policy(syn, capacity):
    opt = simulate(syn, None, "belady", capacity).misses
    for pol in ONLINE:
        assert simulate(syn, None, pol, capacity).misses >= opt
        for d in (1, 2):
            assert simulate(syn, predict_prefetch(syn, d, "dynamic"), pol, capacity).transfers >= opt


def test_timed_without_prefetch_matches_count_only(syn):
    for pol in (*ONLINE, "belady"):
        a, b = simulate(syn, None, pol, 13), simulate(syn, None, pol, 13, olmoe_hardware(16))
        assert np.array_equal(a.outcomes, b.outcomes) and b.late == 0


def test_accounting_and_extremes(syn):
    plan = predict_prefetch(syn, 2, "fixed", k=4)
    for hw in (None, olmoe_hardware(16)):
        r = simulate(syn, plan, "least_stale", 13, hw)
        assert r.hits + r.misses + r.late == r.accesses == len(access_sequence(syn))
        assert simulate(syn, plan, "lru", 0, hw).hits == 0
    full = simulate(syn, None, "fifo", capacity_slots(100, syn.n_layers, syn.n_experts))
    assert full.misses == full.compulsory == len(set(access_sequence(syn)))


def test_least_stale_keeps_pending_prefetch():
    four = _trace_from_sets([[[0], [0], [0], [0, 1]]], n_experts=2)
    plan = PrefetchPlan(1, [[(0,), (0,), (0, 1), ()]])
    assert list(simulate(four, plan, "lru", 3).outcomes) == [1, 0, 3, 0, 0]
    assert list(simulate(four, plan, "least_stale", 3).outcomes) == [1, 0, 0, 0, 0]


def test_timed_hand_case():
    hw = HardwareModel(1.0, 1.0, 1.0, measured=dict(dense_fixed_s=0.1, dense_per_token_s=0.0,
                                                     expert_fixed_s=0.2, expert_per_token_s=0.0))
    r = simulate(_trace_from_sets([[[0], [0], [0]]], 1), PrefetchPlan(1, [[(0,), (0,), ()]]), "lru", 3, hw)
    assert list(r.outcomes) == [1, 0, 4] and math.isclose(r.ttft, 3.6) and math.isclose(r.stall_s, 2.7)


def test_trace_roundtrip_is_atomic(tmp_path, syn):
    path = save_trace(syn, tmp_path / "t.npz")
    back = load_trace(path)
    assert np.array_equal(back.counts, syn.counts) and np.array_equal(back.la_prob, syn.la_prob)
    assert [p.name for p in tmp_path.iterdir()] == ["t.npz"]


def test_bad_input(syn):
    with pytest.raises(ValueError, match="capacity=-2"):
        simulate(syn, None, "lru", -2)
    with pytest.raises(ValueError, match="policy='arc'"):
        make_policy("arc", 3)
    with pytest.raises(ValueError, match="lookahead=0"):
        predict_prefetch(syn, 0)
    with pytest.raises(ValueError, match="bw_bytes_s"):
        HardwareModel(1.0, -1.0, 1.0)
    with pytest.raises(ValueError, match="capacity pct"):
        capacity_slots(120, 8, 32)
