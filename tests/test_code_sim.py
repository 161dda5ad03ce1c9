"""Tests of kimi_papers.decoding.code_sim: task generation against independent answers, the parsers on canned
responses, the sandbox wrapper's taxonomy (over core.sandbox), the batched paired-bootstrap kernel against its NumPy
loop, McNemar, the risk model's accounting and the bad inputs of the spec."""
import contextlib
import io
import math
import os
import tempfile

import numpy as np
import pandas as pd
import pytest
import torch

from kimi_papers.core.rl.rollout import scripted_policy
from kimi_papers.core.sandbox import bwrap_available
from kimi_papers.decoding.code_sim import (
    KINDS, RouteConfig, Task, after_code, bootstrap_mean_diffs, bootstrap_mean_diffs_compiled,
    bootstrap_mean_diffs_numpy, cell_bootstrap, extract_code, generate_texts, mcnemar, paired_bootstrap,
    parse_answer, parse_output, prompt_code, prompt_nl, prompt_reconstruct, prompt_sim,
    resample_indices, risk_model, run_sandboxed, score_execution)
from kimi_papers.decoding.code_sim_experiment import LEVELS, make_tasks, reference_program

needs_bwrap = pytest.mark.skipif(not bwrap_available(), reason="bubblewrap cannot create namespaces here")


# ---- tasks
def test_tasks_balanced_deterministic():
    ts = make_tasks(KINDS, LEVELS, 64, seed=3)
    assert ts == make_tasks(KINDS, LEVELS, 64, seed=3) and ts != make_tasks(KINDS, LEVELS, 64, seed=4)
    cells = pd.Series([(t.kind, t.level) for t in ts]).value_counts()
    assert len(cells) == len(KINDS) * len(LEVELS) and set(cells) == {2}
    assert all(t.set_id == 3 for t in ts)


def test_reference_programs_match_answers():
    """Our own reference programs (trusted, run in-process) print each task's gold answer: an independent check."""
    for t in make_tasks(KINDS, LEVELS, 96, seed=11):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(reference_program(t), {})
        assert parse_output(buf.getvalue(), t.kind) == t.answer, (t, buf.getvalue())


def test_task_difficulty_knobs():
    for t in make_tasks(["add", "mul", "sort"], [1, 4], 6, seed=0):
        nums = [int(x) for x in __import__("re").findall(r"\d+", t.question)]
        if t.kind == "add":
            assert all(len(str(x)) == t.level for x in nums)
        if t.kind == "mul":
            assert [len(str(x)) for x in nums] == [[1, 1], [3, 2]][t.level == 4]
        if t.kind == "sort":
            assert len(nums) == {1: 3, 4: 6}[t.level] and list(t.answer) == sorted(nums)


@pytest.mark.parametrize("kw, match", [(dict(kinds=["div"]), "kinds"), (dict(n=0), "n"), (dict(levels=[5]), "levels"),
                                       (dict(n=-2), "n"), (dict(kinds=[]), "kinds")])
def test_make_tasks_bad_input(kw, match):
    args = dict(kinds=KINDS, levels=LEVELS, n=4, seed=0) | kw
    with pytest.raises(ValueError, match=match):
        make_tasks(**args)


def test_prompts():
    t = make_tasks(["gcd"], [2], 1, 0)[0]
    assert t.question in prompt_nl(t) and "Do not write any code" in prompt_nl(t)
    assert t.question in prompt_code(t) and "Execution Attempt" in prompt_code(t)
    assert "print(3)" in prompt_sim("print(3)") and "print(3)" in prompt_reconstruct("print(3)")
    with pytest.raises(ValueError, match="code"):
        prompt_sim("  ")
    with pytest.raises(TypeError, match="task"):
        prompt_nl("What is 1 + 1?")


# ---- parsers on canned responses
@pytest.mark.parametrize("text, kind, want", [
    ('Reasoning: 3 + 4 = 7.\n{"rationale": "add", "answer": 7}', "add", 7),
    ("{'answer': 12}", "add", 12),
    ('{"answer": 12.0}', "mul", 12),                       # a float equal to an integer is accepted
    ('{"answer": 12.5}', "mul", None),                     # a non-integer float for an integer task is wrong
    ('{"answer": "1,234"}', "add", 1234),
    ('{"answer": [3, 1, 2]}', "sort", (3, 1, 2)),
    ('{"answer": "[1, 2, 3]"}', "sort", (1, 2, 3)),
    ("so the list is [1, 5, 9] in the end", "sort", (1, 5, 9)),
    ("12 + 30 = 42, so the answer is 42", "add", 42),        # no JSON: the last integer
    ('{"answer": 5} and later {"answer": 6}', "add", 6),    # the last JSON object wins
    ("nothing numeric here", "gcd", None),
    ('{"answer": true}', "count", None),
])
def test_parse_answer(text, kind, want):
    assert parse_answer(text, kind) == want


def test_parse_answer_no_fallback_and_bad_kind():
    assert parse_answer("the answer is 42", "add", fallback=False) is None
    assert parse_answer('{"answer": 42}', "add", fallback=False) == 42
    with pytest.raises(ValueError, match="kind"):
        parse_answer("42", "division")


def test_extract_code():
    text = "Plan:\n- add\n```python\nprint(1 + 2)\n```\nExecution Attempt: it prints 3.\n{\"answer\": 3}"
    assert extract_code(text) == "print(1 + 2)"
    assert parse_answer(after_code(text), "add") == 3
    assert extract_code("```py\nx = 1\nprint(x)\n```") == "x = 1\nprint(x)"
    assert extract_code("```python\nprint(1)\n") is None          # unclosed (truncated) block: no code
    assert extract_code("```python\n\n```") is None               # empty block
    assert extract_code("no code at all") is None
    assert after_code("1 + 2 = 3") == "1 + 2 = 3"


def test_parse_output():
    assert parse_output("3\n", "add") == 3
    assert parse_output("working...\n[1, 2, 3]\n", "sort") == (1, 2, 3)
    assert parse_output("The answer is 42\n", "add") == 42
    assert parse_output("The answer is 42\n", "add", strict=True) is None
    assert parse_output("42.0\n", "add", strict=True) == 42
    assert parse_output("4.5\n", "add") is None
    assert parse_output("", "add") is None
    assert parse_output("\ufffd\ufffd 7\n", "count") == 7                # replaced non-UTF-8 bytes


# ---- the sandbox wrapper (core.sandbox underneath)
@needs_bwrap
@pytest.mark.parametrize("code, status", [
    ("print(6 * 7)", "ok"),
    ("def f(:\n    pass", "syntax"),
    ("x = [1]\nprint(x[3])", "runtime"),
    ("while True:\n    pass", "timeout"),
    ("x = bytearray(2 * 1024 ** 3)\nprint(len(x))", "runtime"),          # memory bomb: the 512 MiB address-space limit
    ("import os\nprint(os.listdir('/'))", "rejected"),                   # not on the import allow-list
    ("import socket\nsocket.create_connection(('127.0.0.1', 22))", "rejected"),
    ("open('/tmp/../etc/kimi_probe', 'w').write('x')", "rejected"),      # a write outside the work dir
])
def test_run_sandboxed_statuses(code, status):
    assert run_sandboxed(code, timeout=0.5).status == status


@needs_bwrap
def test_sandbox_gate_bypass_attempt_cannot_delete():
    """The review's bypass (reaching os through an allowed module) is stopped, and the file survives."""
    fd, path = tempfile.mkstemp(prefix="kimi_code_sim_probe_", dir="/var/tmp")
    os.close(fd)
    try:
        r = run_sandboxed(f"import fractions\nos = fractions.sys.modules['os']\nos.remove({path!r})\nprint('gone')",
                          timeout=1.0)
        assert r.status in ("rejected", "runtime") and "gone" not in r.stdout
        assert os.path.exists(path)
    finally:
        os.remove(path)


@needs_bwrap
def test_sandbox_output_cap_and_bytes():
    r = run_sandboxed("print('x' * 50000)", timeout=1.0)
    assert r.status == "ok" and r.stdout_truncated and len(r.stdout) <= 10_000
    r = run_sandboxed("open(1, 'wb', closefd=False).write(b'\\xff\\xfe 7\\n')", timeout=1.0)
    assert r.status == "ok" and parse_output(r.stdout, "count") == 7


@needs_bwrap
def test_score_execution_taxonomy():
    t = Task("add", 1, "What is 2 + 3?", 5)
    assert score_execution(None, None, 5, "add") == (None, "no code")
    assert score_execution("x", run_sandboxed("x = 5", timeout=1.0), 5, "add") == (None, "no output")
    assert score_execution("x", run_sandboxed("print(4)", timeout=1.0), 5, "add") == (4, "wrong value")
    assert score_execution("x", run_sandboxed(reference_program(t), timeout=1.0), 5, "add") == (5, "correct")


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), True])
def test_run_sandboxed_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout"):
        run_sandboxed("print(1)", timeout=timeout)


# ---- generation helper on a scripted (bigram) policy
def test_generate_texts_truncation_and_stop():
    pol = scripted_policy("ab}", {"a": "b", "b": "a"})           # after a: b, after b: a -> never stops
    out = generate_texts(pol, ["a", "b"], max_new_tokens=5, batch_size=2)
    assert [o["tokens"] for o in out] == [5, 5] and all(o["truncated"] for o in out)
    assert out[0]["text"] == "babab"
    pol = scripted_policy("ab}", {"a": "b", "b": "}"})           # a -> b -> } -> EOS
    out = generate_texts(pol, ["a"], max_new_tokens=8, batch_size=1, stop=("}",))
    assert out[0]["text"] == "b}" and not out[0]["truncated"]        # the closing brace is kept


def test_route_config_bad_input():
    with pytest.raises(ValueError, match="code_tokens"):
        RouteConfig(code_tokens=0)
    with pytest.raises(ValueError, match="timeout"):
        RouteConfig(timeout=0)


# ---- the bootstrap kernel
def test_kernel_matches_numpy_loop_exactly():
    g = torch.Generator().manual_seed(0)
    a = (torch.rand(5, 40, generator=g) < 0.4).float()
    b = (torch.rand(5, 40, generator=g) < 0.6).float()
    sizes = [40, 33, 20, 7, 2]
    idx = resample_indices(sizes, 300, seed=1)
    mask = (torch.arange(40)[None] < torch.tensor(sizes)[:, None]).float()
    want = bootstrap_mean_diffs_numpy(a.numpy(), b.numpy(), idx.numpy(), mask.numpy())
    assert np.array_equal(bootstrap_mean_diffs(a, b, idx, mask).numpy(), want)   # 0/1 data: exact sums, equal bits
    assert int(idx[3].max()) < 7 and int(idx[4].max()) < 2    # draws stay inside each cell
    assert not np.array_equal(bootstrap_mean_diffs(b, a, idx, mask).numpy(), want)   # the sign matters


@pytest.mark.slow
def test_compiled_kernel_matches_numpy_loop():
    from kimi_papers.core.kernels import compiled_ran
    g = torch.Generator().manual_seed(3)
    a, b = (torch.rand(4, 30, generator=g) < 0.5).float(), (torch.rand(4, 30, generator=g) < 0.3).float()
    sizes = [30, 12, 5, 2]
    idx = resample_indices(sizes, 200, seed=2)
    mask = (torch.arange(30)[None] < torch.tensor(sizes)[:, None]).float()
    got = bootstrap_mean_diffs_compiled(a, b, idx, mask)
    assert compiled_ran(bootstrap_mean_diffs_compiled)
    assert np.array_equal(got.numpy(), bootstrap_mean_diffs_numpy(a.numpy(), b.numpy(), idx.numpy(), mask.numpy()))


def test_kernel_real_valued_close():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 25, generator=g), torch.randn(3, 25, generator=g)
    idx = resample_indices([25, 25, 25], 200, seed=0)
    torch.testing.assert_close(bootstrap_mean_diffs(a, b, idx),
                               torch.as_tensor(bootstrap_mean_diffs_numpy(a.numpy(), b.numpy(), idx.numpy())),
                               atol=1e-6, rtol=1e-6)


def test_paired_bootstrap_edges():
    assert paired_bootstrap([1, 0, 1, 1], [1, 0, 1, 1], n_boot=500, compiled=False) == (0.0, 0.0, 0.0)
    m, lo, hi = paired_bootstrap([1, 1, 1, 0, 1, 1], [0, 0, 1, 0, 0, 0], n_boot=2000, seed=0, compiled=False)
    assert math.isclose(m, 4 / 6) and lo <= m <= hi and lo > 0
    with pytest.raises(ValueError, match="N >= 2"):
        paired_bootstrap([1], [0])
    with pytest.raises(ValueError, match="same length"):
        paired_bootstrap([1, 0], [0, 1, 1])


def test_bootstrap_coverage_bernoulli_pair():
    """200 synthetic experiments (as cells of one batched call), P(a) = 0.6, P(b) = 0.4 independent: the 95%
    percentile interval covers the true difference 0.2 in about 95% of them."""
    rng = np.random.default_rng(0)
    C, N = 200, 120
    a, b = (rng.random((C, N)) < 0.6).astype(float), (rng.random((C, N)) < 0.4).astype(float)
    res = cell_bootstrap(a, b, [N] * C, n_boot=400, seed=1, compiled=False)
    cover = np.mean([lo <= 0.2 <= hi for _, lo, hi in res])
    assert 0.90 <= cover <= 0.99, cover


def test_cell_bootstrap_bad_sizes():
    with pytest.raises(ValueError, match="sizes"):
        cell_bootstrap(np.zeros((2, 3)), np.zeros((2, 3)), [3, 4], n_boot=100)


@pytest.mark.gpu
def test_kernel_on_cuda():
    a = (torch.rand(4, 30) < 0.5).float()
    b = (torch.rand(4, 30) < 0.5).float()
    idx = resample_indices([30] * 4, 500, 0)
    want = bootstrap_mean_diffs(a, b, idx)
    got = bootstrap_mean_diffs_compiled(a.cuda(), b.cuda(), idx.cuda())
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), want)


# ---- McNemar and the risk model
def test_mcnemar_hand_computed():
    a = [1, 1, 1, 1, 1, 0, 1]
    b = [0, 0, 0, 0, 0, 0, 1]
    assert math.isclose(mcnemar(a, b), 2 / 32)              # 5 discordant, all one way: 2 * 0.5^5
    assert mcnemar([1, 0], [1, 0]) == 1.0                   # no discordant pair
    assert math.isclose(mcnemar([1, 0, 1, 0], [0, 1, 0, 1]), 1.0)
    with pytest.raises(ValueError, match="same length"):
        mcnemar([1, 0], [1])


def test_risk_model_accounting():
    df = pd.DataFrame({"r1_ok": [1, 0, 0, 0, 1, 0], "r2_ok": [1, 0, 1, 0, 0, 1], "r3_ok": [1, 1, 1, 1, 0, 0]})
    r = risk_model(df)
    assert r["q_code"] == 4 / 6 and r["acc_r1"] == 2 / 6
    assert math.isclose(r["e_LM"], 1 - 2 / 4)                 # R2 right on 2 of the 4 tasks whose code is right
    assert math.isclose(r["predicted_r2"], 2 / 6)             # = P(R2 and R3 right)
    assert math.isclose(r["observed_r2"] - r["predicted_r2"], r["r2_right_r3_wrong"])
    assert math.isclose(r["q_nl_implied"], (2 / 6) / 0.5) and r["exec_dominates"]
    with pytest.raises(ValueError, match="r3_ok"):
        risk_model(df.drop(columns="r3_ok"))


def test_paired_bootstrap_is_the_ledgers_statistic_on_another_stream():
    """Same point estimate and (to resampling noise) the same interval as core.ledger.Estimate.bootstrap; not the same
    endpoints, so the kernel cannot replace the ledger's rows (or the reverse) without moving numbers."""
    from kimi_papers.core.ledger import Estimate
    rng = np.random.default_rng(0)
    a, b = (rng.random(120) < 0.6).astype(float), (rng.random(120) < 0.4).astype(float)
    m, lo, hi = paired_bootstrap(a, b, n_boot=4000, seed=1)
    e = Estimate.bootstrap(a, b, statistic=lambda u, v: u.mean() - v.mean(), n_boot=4000, seed=1)
    assert m == pytest.approx(e.value, abs=1e-12)
    assert lo == pytest.approx(e.low, abs=0.03) and hi == pytest.approx(e.high, abs=0.03)
    assert (lo, hi) != (e.low, e.high)


def test_moved_harness_names_resolve_with_a_warning():
    from kimi_papers.decoding import code_sim, code_sim_experiment
    with pytest.warns(DeprecationWarning, match="code_sim_experiment"):
        assert code_sim.make_tasks is code_sim_experiment.make_tasks
    with pytest.raises(AttributeError):
        code_sim.no_such_name
