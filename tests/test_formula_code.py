"""kimi_papers.agents.formula_code as a library: speedup and advantage by hand at every level (and where applied, in
task_metrics), the failure semantics, the batched Mann-Whitney against scipy, the snapshot comparison, the patch policy,
the mutators' semantics, and patches run through core.sandbox (wrong, looping, escaping patches scored as failures)."""
import hashlib
import math

import numpy as np
import pandas as pd
import pytest
import scipy.stats
import torch

from kimi_papers.agents.formula_code import (
    LEVELS, BenchClass, NopAgent, OracleAgent, PatchRejected, Task, Transitions, Workload, advantage, apply_function_patch,
    capture_snapshots, check_patch, compare_snapshots, gmean, grouped_gmean_eager, make_workloads, mann_whitney_batch,
    observe, revert_on_failure, score_task, speedups, task_metrics, values_equal, verify_snapshots)
from kimi_papers.agents.formula_code_experiment import (
    HELPERS_SRC, MUTATORS, BlindRewriteAgent, BreakItAgent, mutate_source, parse_llm_function)
from kimi_papers.core.sandbox import bwrap_available

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap cannot create namespaces here")

WL = [Workload("bm1", "TimeA", "time_x", (1,), 0), Workload("bm1", "TimeA", "time_y", (1,), 0),
      Workload("bm2", "TimeB", "time_x", (1,), 0), Workload("bm2", "TimeB", "time_y", (1,), 0)]
SA, SO = np.array([2.0, 1, 1, 1]), np.array([1.0, 1, 4, 1])


# ---- metrics by hand
def test_advantage_hand_cases():
    assert advantage(SA, SO, WL, "workload") == pytest.approx(-0.5)
    assert advantage(SA, SO, WL, "function") == pytest.approx(-0.5)
    assert advantage(SA, SO, WL, "class") == pytest.approx((math.sqrt(2) - 2) / 2)
    assert advantage(SA, SO, WL, "module") == pytest.approx((math.sqrt(2) - 2) / 2)
    assert advantage(SA, SO, WL, "overall") == pytest.approx(2 ** 0.25 - math.sqrt(2))


def test_replay_is_zero_and_groups_are_prefixes():
    assert all(advantage(SO, SO, WL, lvl) == 0.0 for lvl in LEVELS)
    assert [w.group("module") for w in WL] == ["bm1", "bm1", "bm2", "bm2"]
    assert WL[0].key == "bm1/TimeA.time_x/" + hashlib.md5(repr((1,)).encode()).hexdigest()[:16]


def test_advantage_is_not_symmetric_in_sign():
    assert advantage(SO, SA, WL, "overall") == pytest.approx(-(2 ** 0.25 - math.sqrt(2)))


def test_speedups_use_medians_and_nop_over_agent():
    np.testing.assert_allclose(speedups([[4.0, 2, 3, 100]], [[1.0, 1, 1, 1]]), [3.5])
    np.testing.assert_allclose(speedups([2.0], [1.0]), [2.0])


@pytest.mark.parametrize("bad", [[0.0, 1.0], [float("nan"), 1.0], [-2.0, 1.0]])
def test_bad_timings_raise(bad):
    with pytest.raises(ValueError, match="timings"):
        speedups(bad, [1.0, 1.0])


def test_empty_group_warns_and_is_skipped():
    with pytest.warns(UserWarning, match="empty group"):
        assert advantage(SA, SO, [0, 0, 2, 2]) == pytest.approx((math.sqrt(2) - 2) / 2)


def test_grouped_gmean_matches_loop():
    g = torch.Generator().manual_seed(0)
    s = torch.rand(50, generator=g).double() + 0.5
    gid = torch.randint(0, 5, (50,), generator=g)
    out = grouped_gmean_eager(s, gid, 5)
    ref = [math.exp(np.mean([math.log(s[i]) for i in range(50) if gid[i] == k])) for k in range(5)]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12)


def test_failure_semantics():
    bad = Transitions(((3, 1, 0), (0, 0, 0), (0, 0, 0)), "failed")
    good = Transitions(((4, 0, 0), (0, 0, 0), (0, 0, 0)), "passed")
    assert (revert_on_failure([2.0, 0.5], bad) == 1).all()
    assert (revert_on_failure([2.0, 0.5], None) == 1).all()
    assert (revert_on_failure([2.0, 0.5], good) == [2.0, 0.5]).all()
    assert (revert_on_failure([2.0, 0.5], good, pytest_fail=2, pytest_fail_oracle=1) == 1).all()


def test_task_metrics_apply_the_formulas():
    df = pd.DataFrame(dict(sA=SA, sO=SO, failed=False, failure=""))
    m = task_metrics(df, WL)
    assert m["speedup"] == pytest.approx(2 ** 0.25) and m["oracle_speedup"] == pytest.approx(math.sqrt(2))
    assert m["adv_class"] == pytest.approx((math.sqrt(2) - 2) / 2) and m["best_workload"] == 2.0


# ---- Mann-Whitney against scipy
def test_mann_whitney_hand_and_scipy():
    u, p = mann_whitney_batch([[1.0, 2, 3]], [[2.0, 4]])
    assert u[0] == 1.5
    rng = np.random.default_rng(3)
    x, y = rng.integers(0, 5, (30, 8)).astype(float), rng.integers(1, 6, (30, 12)).astype(float)
    U, P = mann_whitney_batch(x, y)
    ref = [scipy.stats.mannwhitneyu(a, b, method="asymptotic") for a, b in zip(x, y)]
    np.testing.assert_allclose(U, [r.statistic for r in ref], atol=1e-9)
    np.testing.assert_allclose(P, [r.pvalue for r in ref], atol=1e-9)


def test_mann_whitney_power_limits():
    # 8 vs 8 fully separated can reach p < 0.002; 5 vs 5 cannot (review correction 2)
    assert mann_whitney_batch(np.zeros((1, 8)), np.ones((1, 8)))[1][0] < 0.002
    assert mann_whitney_batch(np.zeros((1, 5)), np.ones((1, 5)))[1][0] > 0.002


# ---- snapshots, patches, mutators
def test_values_equal_and_transitions():
    assert values_equal({"f": "nan"}, {"f": "nan"}) and values_equal(1.0, 1.0 + 1e-10) and not values_equal(1, 1.0)
    base = {"a": {"status": "pass", "value": 1}, "b": {"status": "pass", "value": 2.0}, "c": {"status": "skip"}}
    tr = compare_snapshots(base, {"a": {"status": "pass", "value": 1}, "b": {"status": "pass", "value": 2.5}, "c": {"status": "skip"}})
    assert tr.status == "failed" and tr.pass_to_fail == 1 and tr.matrix[2] == (0, 0, 1)
    assert compare_snapshots(base, {"a": {"status": "pass", "value": 1}}).pass_to_fail == 1   # missing workload fails


SRC = "S = set(range(500))\ndef count(xs):\n    return sum(1 for x in xs if x in S)\n"


@pytest.mark.parametrize("patch, msg", [("def count(xs):\n    import os\n    return 0", "imports"),
                                        ("def count(xs):\n    return eval('1')", "eval"),
                                        ("def count(xs):\n    return xs.__dict__", "attribute"),
                                        ("def count(xs) return", "parse"), ("def other(xs):\n    return 0", "expected")])
def test_patch_policy(patch, msg):
    with pytest.raises(PatchRejected, match=msg):
        apply_function_patch(SRC, "count", patch)


def test_llm_reply_parsing():
    assert parse_llm_function("x\n```python\ndef f():\n    pass\n```") == "def f():\n    pass"


def test_mutators_preserve_semantics_and_count():
    src = "import functools\nS = {1, 2}\ndef f(xs, w='ab'):\n    out = []\n    n = len(xs)\n    for x in xs:\n" \
          "        if x in S and 'b' in w:\n            out.append(x + n)\n    return '-'.join(map(str, out))\n"
    mut, cnt = mutate_source(src, ["f"], list(MUTATORS))
    assert cnt["set_to_list"] == 2 and cnt["unhoist"] == 1 and cnt["join_to_concat"] == 1
    a, b = {}, {}
    exec(src, a)
    exec(mut, b)
    assert a["f"]([1, 2, 3]) == b["f"]([1, 2, 3]) == "4-5"
    assert b["_fc_members"]("ab") == "ab"   # a string keeps its substring meaning


# ---- through the sandbox
@pytest.fixture(scope="module")
def toy():
    bsrc, wls = make_workloads("bench_t", [BenchClass("TimeCount", ([200],), ("n",), "self.xs = list(range(0, 3 * n, 3))",
                                                      {"time_count": "return target.count(self.xs)"})])
    base = mutate_source(SRC, ["count"], ["set_to_list"])[0]
    task = Task("toy", "toy", base, SRC + HELPERS_SRC, {"bench_t": bsrc}, wls, ("count",), imports=("random",))
    capture_snapshots(task)
    return task


@needs_bwrap
def test_bad_patches_are_failures_not_crashes(toy):
    assert verify_snapshots(toy, SRC.replace("sum(1", "sum(2")).pass_to_fail == 1
    assert "timeout" in verify_snapshots(toy, SRC.replace("return", "while True: pass\n    return"), timeout=2).reason
    assert "sandbox gate" in verify_snapshots(toy, SRC + "open('/usr/x_fc', 'w')\n").reason
    assert verify_snapshots(toy, toy.expert_src).status == "passed"


@needs_bwrap
def test_agents_and_revert_to_one(toy):
    obs = observe(toy)
    res = {a.name: check_patch(toy, a, obs) for a in (NopAgent(), OracleAgent({"toy": toy}), BreakItAgent(), BlindRewriteAgent())}
    assert res["oracle"].ok and not res["break-it"].ok
    df = score_task(toy, res, seed=0, reps=5)
    assert (df[df.agent == "break-it"].sA == 1.0).all()
    assert (df[df.agent == "oracle"].sO > 2).all()
