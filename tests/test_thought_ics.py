"""Tests of kimi_papers.decoding.thought_ics: problems with gold intermediates, the step-value rule and the ground-truth
locator on hand-made traces, localisation parsing, the correction loop on a scripted model (exact traces, prompts and
token counts), the loop mechanics on a tiny random Llama, and the spec's bad inputs."""
import math

import pytest
import torch

import kimi_papers.decoding.thought_ics as ti
from kimi_papers.core.models import tiny_causal_lm
from kimi_papers.core.rl.rollout import Policy
import kimi_papers.decoding.thought_ics_experiment as tx
from kimi_papers.core.rl.tasks import last_integer as core_last_integer
from kimi_papers.decoding.thought_ics import (
    DELIMITER, ChainProblem, ICSResult, Round, TokenLedger, continue_thoughts, correction_lift, final_value,
    full_resample_batch, generate_thoughts, is_correct, last_integer, localize, parse_step_index,
    self_refine_batch, split_sentences, stated_value, thought_ics, thought_ics_batch, true_first_error)
from kimi_papers.decoding.thought_ics_experiment import make_chain_problems, thought_marks

P0 = ChainProblem("Start with 6. Add 7. Multiply by 2. Subtract 5.", 6, (("add", 7), ("mul", 2), ("sub", 5)), (6, 13, 26, 21))

HAND_CASES = [  # trace, explicit-rule first error, literal-rule first error
    (["6 + 7 = 13", "13 * 2 = 26", "26 - 5 = 21", "Final answer: 21"], None, None),
    (["6 + 7 = 13", "13 * 2 = 24", "24 - 5 = 19", "Final answer: 19"], 2, 2),
    (["Start with 6", "6 + 7 = 13", "Multiply 13 by 2", "26 - 5 = 21", "Final answer: 21"], None, 1),
    (["6 + 7 = 13", "So we have 13.", "13 * 2 = 26", "Final answer: 21"], None, 2),
    (["6 + 7 = 13", "13 * 2 = 26 and 26 - 5 = 21", "Final answer: 20"], 3, 3),
    (["6 + 7 = 13", "13 * 2 = 26"], 2, 2),
    (["Add 7", "Multiply by 2", "Final answer: 21"], None, 1),
    (["6 + 7 = 13", "Final answer: the number"], 2, 2),
    (["6 + 7 = 14", "Final answer: 21"], 1, 1),
    ([], 1, 1),
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    from kimi_papers.core.models import SMOLLM2_CACHE, cache_is_valid, load_smollm2, model_cache_dir
    folder = model_cache_dir() / SMOLLM2_CACHE
    return AutoTokenizer.from_pretrained(folder) if cache_is_valid(folder) else load_smollm2("cpu")[1]


@pytest.fixture(scope="module")
def tiny(tok):
    return tiny_causal_lm(len(tok), d_model=32, n_layers=1, n_heads=2, max_len=2048, seed=0)


def test_problems_have_consistent_gold_values():
    ps = make_chain_problems(40, n_ops=(3, 5), max_operand=12, seed=7)
    assert len({p.question for p in ps}) == 40
    for p in ps:
        v = p.start
        for (kind, k), want in zip(p.ops, p.values[1:]):
            v = {"add": v + k, "sub": v - k, "mul": v * k}[kind]
            assert v == want and v >= 0 and 1 <= k <= 12
        assert p.answer == p.values[-1] and p.values[0] == p.start
    assert [p.question for p in make_chain_problems(4, seed=1)] != [p.question for p in make_chain_problems(4, seed=2)]
    for kw, msg in [(dict(n=0), "n"), (dict(n=2, n_ops=(5, 3)), "n_ops"), (dict(n=2, max_operand=1), "max_operand"),
                    (dict(n=2, n_ops="3"), "n_ops"), (dict(n=2, seed=-1), "seed")]:
        with pytest.raises((ValueError, TypeError), match=msg):
            make_chain_problems(**kw)


def test_stated_value_never_reads_operands():
    assert stated_value("Multiply 13 by 2") is None and last_integer("Multiply 13 by 2") == 2
    assert stated_value("13 * 2 = 26") == 26 and stated_value("Multiply 13 by 2 to get 26.") == 26
    assert stated_value("So we have 13.") == 13 and stated_value("The result is 1,026") == 1026
    assert stated_value("13 is the value; multiply by 2") is None
    assert stated_value("Step 2: 13 - 20 = -7") == -7
    assert final_value("Final answer: 4 * 3 = 12") == 12 and final_value("The final answer is 21.") == 21
    assert final_value("Final answer: unknown") is None and final_value("13 * 2 = 26") is None


@pytest.mark.parametrize("trace,explicit,literal", HAND_CASES)
def test_true_first_error_on_hand_made_traces(trace, explicit, literal):
    assert true_first_error(trace, P0) == explicit
    assert true_first_error(trace, P0, rule="literal") == literal
    assert is_correct(trace, P0) == (final_value(trace[-1]) == 21 if trace else False)


def test_localisation_parsing_and_fallbacks():
    assert parse_step_index(" 2", 4) == (2, False)
    assert parse_step_index("Step 3 is wrong", 4) == (3, False)
    assert parse_step_index("none of them", 4) == (4, True)
    assert parse_step_index("9", 4) == (4, True) and parse_step_index("0", 4) == (4, True)
    assert parse_step_index("-1", 3) == (3, True)
    with pytest.raises(ValueError, match="K"):
        parse_step_index("1", 0)


def test_sentences_and_marks():
    assert split_sentences("6 + 7 = 13. Then 13 * 2 = 26.\nFinal answer: 26") == [
        "6 + 7 = 13.", "Then 13 * 2 = 26.", "Final answer: 26"]
    assert split_sentences("  ") == []
    assert thought_marks(["6 + 7 = 13", "Add 2", "13 * 2 = 24", "x = 1", "Final answer: 1"], P0) == [
        "ok", "no value", "wrong", "after", "after"]
    assert thought_marks(["6 + 7 = 13", "13 * 2 = 26", "Final answer: 21"], P0)[-1] == "final ok"


class ScriptedGenerate:
    """Stands in for core.rl.rollout.generate: replies by rule from the decoded prompt, records every call."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def reply(self, text: str) -> str:
        if "first incorrect" in text:
            return " 2"
        if "Is this solution correct" in text:
            return " no"
        step = text.rsplit("Step ", 1)[-1].split(":")[0]
        if "Do not repeat" in text:
            return " 13 * 2 = 26\n"
        if step == "1":
            return " 6 + 7 = 13\n"
        if step == "2":
            return " 13 * 2 = 24\n"
        if step == "3":
            return " 24 - 5 = 19\n" if "= 24" in text else " 26 - 5 = 21\n"
        return " Final answer: 19\n" if "= 19" in text else " Final answer: 21\n"

    def __call__(self, policy, prompts, *, max_new_tokens, stop=(), greedy=False, **kw):
        texts = [self.reply(self.tok.decode(p)) for p in prompts]
        self.calls.append({"prompts": [self.tok.decode(p) for p in prompts], "stop": tuple(stop), "greedy": greedy,
                           "n_prompt": [len(p) for p in prompts], "texts": texts})
        n = [len(self.tok.encode(t, add_special_tokens=False)) for t in texts]
        T = max(n)
        resp = torch.tensor([[1] * k + [0] * (T - k) for k in n])
        return None, None, resp, [t.split(DELIMITER)[0] if DELIMITER in stop else t for t in texts]


def test_correction_loop_on_a_scripted_model(tok, tiny, monkeypatch):
    fake = ScriptedGenerate(tok)
    monkeypatch.setattr(ti, "generate", fake)
    pol = Policy(tiny, tok, chat=True)
    ledger = TokenLedger(1)
    init = continue_thoughts(pol, [P0.question], [[]], max_thoughts=6, tokens=ledger)[0]
    assert init == ["6 + 7 = 13", "13 * 2 = 24", "24 - 5 = 19", "Final answer: 19"]
    assert all(c["stop"] == (DELIMITER,) and c["greedy"] for c in fake.calls)
    assert ledger.prompt[0] == sum(c["n_prompt"][0] for c in fake.calls)
    assert true_first_error(init, P0) == 2
    fake.calls.clear()
    r = thought_ics_batch(pol, [P0], [init], rounds=3, localizer="self", seed=0)[0]
    # one round: localise (j = 2), keep step 1, regenerate step 2 told not to repeat it, then continue to the answer
    assert len(r.rounds) == 1 and r.rounds[0].j == 2 and r.rounds[0].true_j == 2 and r.final_correct
    assert r.final == ["6 + 7 = 13", "13 * 2 = 26", "26 - 5 = 21", "Final answer: 21"]
    notes = [p for c in fake.calls for p in c["prompts"] if "Do not repeat" in p]
    assert len(notes) == 1 and '"13 * 2 = 24"' in notes[0] and "step 2 was wrong" in notes[0]
    # the localisation call (prompt + output) is part of the cost
    assert r.prompt_tokens == sum(n for c in fake.calls for n in c["n_prompt"])
    assert r.generated_tokens == sum(len(tok.encode(t, add_special_tokens=False)) for c in fake.calls for t in c["texts"])
    assert any("first incorrect" in p for c in fake.calls for p in c["prompts"])
    assert correction_lift([r]) == 1.0
    # full resample regenerates the same wrong trace from scratch: no lift, and no localisation call
    fake.calls.clear()
    b = full_resample_batch(pol, [P0], [init], rounds=2, seed=0)[0]
    assert len(b.rounds) == 2 and not b.final_correct and correction_lift([b]) == 0.0
    assert not any("first incorrect" in p for c in fake.calls for p in c["prompts"])
    # oracle localisation picks the true first error without a model call
    fake.calls.clear()
    d = thought_ics_batch(pol, [P0], [init], rounds=1, localizer="oracle", seed=0)[0]
    assert d.rounds[0].j == 2 and d.final_correct and not any("first incorrect" in p for c in fake.calls for p in c["prompts"])
    # the autonomous verifier's "no" sends an already correct trace into a round as well
    fake.calls.clear()
    a = thought_ics_batch(pol, [P0], [r.final], verifier="self", rounds=1, localizer="self", seed=0)[0]
    assert a.initial_correct and len(a.rounds) == 1
    # an initially correct trace under the oracle verifier is left alone
    assert thought_ics_batch(pol, [P0], [r.final], rounds=3, seed=0)[0].rounds == []


def test_self_refine_on_a_scripted_model(tok, tiny, monkeypatch):
    fake = ScriptedGenerate(tok)
    monkeypatch.setattr(ti, "generate", lambda pol, prompts, **kw: fake(pol, prompts, **kw))
    pol = Policy(tiny, tok, chat=True)
    e = self_refine_batch(pol, [P0], ["6 + 7 = 13. 13 * 2 = 24. Final answer: 19"], rounds=1, seed=0)[0]
    assert e.initial == ["6 + 7 = 13.", "13 * 2 = 24.", "Final answer: 19"] and not e.initial_correct
    assert len(e.rounds) == 1 and any("Your answer is wrong" in p for c in fake.calls for p in c["prompts"])


def test_loop_mechanics_on_a_tiny_random_llama(tok, tiny):
    pol = Policy(tiny, tok, chat=True)
    ps = make_chain_problems(2, n_ops=3, seed=0)
    init = [["1 + 1 = 2", "2 * 2 = 5", "Final answer: 5"], ["Final answer: 99"]]
    for loc in ("self", "random", "oracle"):
        rs = thought_ics_batch(pol, ps, init, rounds=2, localizer=loc, max_thoughts=3, max_tokens=4, seed=3)
        for r in rs:
            old = r.initial
            for rd in r.rounds:
                assert 1 <= rd.j <= max(len(old), 1) and rd.thoughts[: rd.j - 1] == old[: rd.j - 1]
                assert len(rd.thoughts) <= 3 and all(DELIMITER not in t for t in rd.thoughts)
                old = rd.thoughts
            assert r.prompt_tokens > 0 and r.generated_tokens > 0
    again = thought_ics_batch(pol, ps, init, rounds=2, localizer="random", max_thoughts=3, max_tokens=4, seed=3)
    first = thought_ics_batch(pol, ps, init, rounds=2, localizer="random", max_thoughts=3, max_tokens=4, seed=3)
    assert [r.final for r in again] == [r.final for r in first]


def test_bad_inputs(tok, tiny):
    pol = Policy(tiny, tok, chat=True)
    init = [["Final answer: 0"]]
    for kw, msg in [(dict(rounds=-1), "rounds"), (dict(max_thoughts=0), "max_thoughts"), (dict(localizer="best"), "localizer"),
                    (dict(verifier="human"), "verifier"), (dict(temperature=0), "temperature")]:
        with pytest.raises(ValueError, match=msg):
            thought_ics_batch(pol, [P0], init, **kw)
    with pytest.raises(ValueError, match="question"):
        generate_thoughts(tiny, tok, "")
    with pytest.raises(ValueError, match="question"):
        localize(tiny, tok, "  ", ["1 + 1 = 2"])
    with pytest.raises(ValueError, match="max_thoughts"):
        generate_thoughts(tiny, tok, "Start with 1. Add 1.", max_thoughts=0)
    with pytest.raises(ValueError, match="rule"):
        true_first_error(["1"], P0, rule="last")
    with pytest.raises(ValueError, match="arms"):
        tx.RunConfig(arms=("Z_unknown",))
    with pytest.warns(RuntimeWarning, match="undefined"):
        assert math.isnan(correction_lift([ICSResult(P0, "x", ["Final answer: 21"], True)]))
    assert correction_lift([ICSResult(P0, "x", [], False, [Round(1, 1, False, [], True)]),
                            ICSResult(P0, "x", [], False)]) == 0.5


@pytest.mark.gpu
def test_loop_runs_on_cuda(tok, tiny):
    pol = Policy(tiny.to("cuda"), tok, chat=True)
    rs = thought_ics_batch(pol, [P0], [["Final answer: 0"]], rounds=1, localizer="self", max_thoughts=2, max_tokens=4)
    assert rs[0].rounds and rs[0].prompt_tokens > 0


def test_last_integer_is_the_core_parser():
    assert last_integer is core_last_integer
    assert last_integer("12 * 3 = 36, so 1,200") == 1200 and last_integer("none") is None
    assert last_integer("Multiply 13 by 2") == 2 and last_integer("-4 - 3 = -7") == -7


def test_moved_harness_names_resolve_with_a_warning():
    with pytest.warns(DeprecationWarning, match="thought_ics_experiment"):
        assert ti.run_arms is tx.run_arms
    with pytest.warns(DeprecationWarning):
        assert ti.make_chain_problems is make_chain_problems
    with pytest.raises(AttributeError):
        ti.no_such_name


def test_own_model_backtracks_to_self_localised_step(tiny, tok):
    """The own-data example: a user's wrong trace, self-localisation, the prefix before j kept verbatim."""
    p = ChainProblem("Start with 4. Multiply by 3. Subtract 5.", 4, (("mul", 3), ("sub", 5)), (4, 12, 7))
    trace = ["4 * 3 = 12", "12 - 5 = 8", "Final answer: 8"]
    res = thought_ics(tiny, tok, p, initial=trace, localizer="self", rounds=2, max_thoughts=4, max_tokens=8)
    assert not res.initial_correct and len(res.rounds) >= 1 and res.rounds[0].true_j == 2
    for rd, old in zip(res.rounds, [trace] + [r.thoughts for r in res.rounds]):
        assert 1 <= rd.j <= len(old) and rd.thoughts[:rd.j - 1] == old[:rd.j - 1]
