"""kimi_papers.evaluation.wiki_profile as a library: alias matching, the per-fact rule on a scripted model with every
category planted, the summaries by hand, the sequence log-prob kernel against float64, known-wrong variants that the
checks must catch, bad input, and the experiment's world and tokenizer."""
import re

import numpy as np
import pandas as pd
import pytest
import torch

import kimi_papers.evaluation.wiki_profile as wp
from kimi_papers.evaluation.wiki_profile import (
    CATEGORIES, Fact, ProfileRule, categorize, check_reverse_unique, contains_alias, mc_options, normalize,
    plain_format, profile_facts, run_probes, sequence_logprob, sequence_logprob_eager, summarize)
from kimi_papers.evaluation.wiki_profile_experiment import (
    RECITAL, REAL_FACTS, chance_rates, make_synthetic_world, recital_cue_rate)

# ---- a scripted model with planted knowledge ----------------------------------------------------------------------
PLAN = {  # fact: (encoding hits, direct hits, thinking hits); None = unparseable answer
    0: ([0, 0], [0, 0, 0], [0, 0, 0]),
    1: ([1, 0], [1, 1, 0], [0, 0, 0]),
    2: ([1, 1], [1, 0, 0], [1, 1, 0]),
    3: ([0, 1], [0, 0, 0], [1, 0, 0]),
    4: ([1, 1], [1, None], [1, 1]),
    5: ([1, 1], [0, 0, 0], [0, None, 1]),
}
EXPECTED = ["empty-shelf", "direct", "thinking-only", "not-recalled", "thinking-only", "not-recalled"]
FACTS = [Fact(f"P{i}", "city", f"C{i}", (f"C{i}",), "head" if i % 2 else "tail", (f"P{i} lives in", f"The home of P{i} is"),
              (f"Where is P{i}?", f"Home of P{i}?", f"City of P{i}?")[: len(PLAN[i][1])]) for i in PLAN]


def scripted(prompts, n_tokens):
    out = []
    for p in prompts:
        i = int(re.search(r"P(\d)", p).group(1))
        f = FACTS[i]
        if p in f.contexts:
            out.append(f" C{i}." if PLAN[i][0][f.contexts.index(p)] else " Nowhere.")
            continue
        j, think = next(j for j, q in enumerate(f.direct_qs) if q in p), p.endswith("<think>")
        hit = PLAN[i][2 if think else 1][j]
        ans = "" if hit is None else (f" C{i}" if hit else " Nowhere")
        out.append((f" P{i} lives somewhere. </think> A:{ans}" if think else ans) + "\nQ: next")
    return out


def planted_profile():
    return profile_facts(run_probes(None, None, FACTS, thinking=True, mc=False, generate=scripted), facts=FACTS)


def test_profile_recovers_planted_categories():
    assert list(planted_profile().category) == EXPECTED


def test_no_thinking_profile_has_no_thinking_only():
    prof = profile_facts(run_probes(None, None, FACTS, thinking=False, mc=False, generate=scripted))
    assert "thinking-only" not in set(prof.category)
    assert list(prof.category) == ["empty-shelf", "direct", "not-recalled", "not-recalled", "not-recalled", "not-recalled"]


def test_summaries_by_hand():
    s = summarize(planted_profile(), min_bin=1)
    # wrong without thinking: 0, 2, 3, 4, 5; encoded among them: 2, 3, 4, 5
    assert s["direct_lost_key_share"] == pytest.approx(4 / 5)
    assert s["direct_recall_given_encoded"] == pytest.approx(1 / 5)
    assert s["direct_recovered_by_thinking"] == pytest.approx(2 / 4)
    assert s["direct_share_empty-shelf"] == pytest.approx(1 / 6)
    assert sum(s[f"direct_share_{c}"] for c in CATEGORIES) == pytest.approx(1.0)
    # popularity: odd facts are head: encoded 1, 3, 5 -> direct 1; even (tail) encoded 2, 4 -> none direct
    assert s["direct_recall_given_encoded_head"] == pytest.approx(1 / 3)
    assert s["direct_recall_given_encoded_tail"] == 0.0


# ---- known-wrong variants must be caught -------------------------------------------------------------------------
def test_wrong_any_paraphrase_rule_is_caught(monkeypatch):
    """WRONG: 'recalled if any paraphrase is right' instead of a strict majority."""
    def any_rule(n_enc, d, t, rule=ProfileRule()):
        return "empty-shelf" if n_enc < 1 else "direct" if d > 0 else "thinking-only" if t > 0 else "not-recalled"
    monkeypatch.setattr(wp, "categorize", any_rule)
    assert list(planted_profile().category) != EXPECTED


def test_wrong_tie_rule_is_caught(monkeypatch):
    """WRONG: a 1-1 split counted as recalled (>= half instead of > half)."""
    def tie_rule(n_enc, d, t, rule=ProfileRule()):
        return "empty-shelf" if n_enc < 1 else "direct" if d >= 0.5 else "thinking-only" if t >= 0.5 else "not-recalled"
    monkeypatch.setattr(wp, "categorize", tie_rule)
    assert list(planted_profile().category) != EXPECTED


def test_wrong_both_probes_encoding_is_caught():
    """The stricter reading (both encoding probes) is a different rule: facts 1 and 3 become empty shelves."""
    prof = profile_facts(run_probes(None, None, FACTS, mc=False, generate=scripted), ProfileRule(min_encoded=2))
    assert list(prof.category) != EXPECTED and list(prof.category)[1] == "empty-shelf"


def test_wrong_substring_alias_match_is_caught(monkeypatch):
    """WRONG: substring matching gives 'Parisian' credit for 'Paris'."""
    monkeypatch.setattr(wp, "contains_alias", lambda t, al: t is not None and any(a.lower() in t.lower() for a in al))
    assert wp.contains_alias("Parisian", ["Paris"])
    assert not contains_alias("Parisian", ["Paris"])


def test_wrong_parse_last_marker_is_caught():
    """The answer after thinking is the first answer line, not a later one the model rambles on to."""
    assert plain_format().parse(" X was born in Rome. </think> A: Rome\nA: Oslo", "think") == "Rome"


def test_lost_key_denominator_is_wrong_answers_not_all_facts():
    prof = planted_profile()
    s = summarize(prof, min_bin=1)
    all_facts_share = float(prof.encoded.mean())          # a WRONG denominator: every fact
    assert s["direct_lost_key_share"] != pytest.approx(all_facts_share)


# ---- alias matching and parsing -----------------------------------------------------------------------------------
def test_alias_matching():
    assert normalize("Chișinău!") == "chisinau"
    assert contains_alias("The capital is Ulan-Bator.", ["Ulan Bator"])
    assert not contains_alias("Ulan", ["Ulan Bator"]) and not contains_alias(None, ["x"])
    assert contains_alias("o", ["O"]) and not contains_alias("oxygen", ["O"])


def test_parse_edge_cases():
    fmt = plain_format()
    assert fmt.parse(" X was born in Rome.", "think") is None      # no answer line: wrong
    assert fmt.parse("\n\n", "direct") is None
    assert fmt.parse(" Rome\nA: Oslo", "direct") == "Rome"


# ---- kernel -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 7, 300), (2, 1, 50), (3, 5, 4099)])
def test_sequence_logprob_matches_float64(shape):
    g = torch.Generator().manual_seed(1)
    B, T, V = shape
    lg = torch.randn(B, T, V, generator=g) * 4
    tg = torch.randint(V, (B, T), generator=g)
    mk = (torch.rand(B, T, generator=g) > 0.4).float()
    mk[-1] = 0
    ref = (torch.log_softmax(lg.double(), -1).gather(-1, tg[..., None]).squeeze(-1) * mk.double()).sum(-1)
    for fn in (sequence_logprob, sequence_logprob_eager):
        out = fn(lg, tg, mk).double()
        assert torch.allclose(out, ref, atol=1e-3, rtol=1e-5)
        assert out[-1].item() == 0.0
    # WRONG: ignoring the mask gives a different answer
    unmasked = torch.log_softmax(lg.double(), -1).gather(-1, tg[..., None]).squeeze(-1).sum(-1)
    assert not torch.allclose(unmasked, ref, atol=1e-3)


def test_sequence_logprob_hand_case_and_bad_input():
    assert sequence_logprob(torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)).item() == pytest.approx(2 * np.log(1 / 8))
    with pytest.raises(ValueError, match="logits"):
        sequence_logprob(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), torch.ones(2))
    with pytest.raises(ValueError, match="targets, mask"):
        sequence_logprob(torch.zeros(1, 2, 8), torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 2))


def test_mc_verify_on_a_model_that_prefers_the_gold():
    """A tiny LM trained to answer one question picks the gold among 4 options; options keep the gold's index."""
    from kimi_papers.core.models import tiny_causal_lm
    from kimi_papers.evaluation.wiki_profile_experiment import SubsetTokenizer, _pad_masked_loss, encode_lines
    from kimi_papers.core.config import model_cache_dir
    from transformers import AutoTokenizer
    base = AutoTokenizer.from_pretrained(model_cache_dir() / "smollm2-135m-instruct")
    f = Fact("Ana", "city", "Rome", ("Rome",), "head", ("Ana lives in",), ("Where is Ana?",), distractors=("Oslo", "Lima", "Kiev"))
    opts, gold = mc_options(f, "direct", seed=3)
    assert opts[gold] == "Rome" and sorted(opts) == sorted(["Rome", "Oslo", "Lima", "Kiev"])
    tok = SubsetTokenizer(base, ["Q: Where is Ana?\nA: Rome Oslo Lima Kiev\n"])
    model = tiny_causal_lm(tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=32, arch="gpt2", seed=0).train()
    x = encode_lines(tok, ["Q: Where is Ana?\nA: Rome"], 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss, _ = _pad_masked_loss(model, x)
        loss.backward(); opt.step(); opt.zero_grad()
    model.eval()
    assert wp.mc_verify(model, tok, f, opts) == gold
    with pytest.raises(ValueError, match="4 options"):
        wp.mc_verify(model, tok, f, opts[:3])


# ---- bad input ----------------------------------------------------------------------------------------------------
def test_bad_facts_raise():
    with pytest.raises(ValueError, match="aliases"):
        Fact("A", "r", "B", (), "head", ("A r",), ("Q?",))
    with pytest.raises(ValueError, match="leaks"):
        Fact("A", "r", "B", ("B",), "head", ("A r B and",), ("Q?",))
    with pytest.raises(ValueError, match="obj"):
        Fact("A", "r", "", ("B",), "head", ("A r",), ("Q?",))
    with pytest.raises(ValueError, match="3 distractors"):
        Fact("A", "r", "B", ("B",), "head", ("A r",), ("Q?",), reverse_distractors=("x", "y"))
    f1 = Fact("A", "r", "B", ("B",), "head", ("A r",), ("Q?",), ("Who r B?",), ("B is r of",))
    f2 = Fact("C", "r", "B", ("B",), "head", ("C r",), ("Q?",), ("Who r B?",), ("B is r of",))
    with pytest.raises(ValueError, match="not unique"):
        check_reverse_unique([f1, f2])
    with pytest.raises(ValueError, match="not unique"):
        run_probes(None, None, [f1, f2], generate=scripted)
    with pytest.raises(ValueError, match="columns"):
        profile_facts(pd.DataFrame({"fact": [0]}))
    with pytest.raises(ValueError, match="category"):
        summarize(pd.DataFrame({"fact": [0]}))


# ---- the experiment's world ---------------------------------------------------------------------------------------
def test_world_ground_truth():
    corpus, qa, facts = make_synthetic_world(24, 5, seed=4)
    text, qa_text = "\n".join(corpus + qa), "\n".join(qa)
    tags = pd.Series([f.tag for f in facts]).value_counts().to_dict()
    assert tags == {"practised": 24, "heldout": 24, "control": 10}
    for f in facts:
        if f.tag == "control":
            assert f.subject not in text
        if f.tag == "heldout":
            assert f.subject not in qa_text
        recital_prefix = RECITAL[(f.relation, "direct")].split(" {o}")[0].format(s=f.subject)
        assert recital_prefix not in f.contexts                     # correction 1: recital template held out
    cities = [f.obj for f in facts if f.relation == "city"]
    assert len(set(cities)) == len(cities)                          # reverse gold is unique
    check_reverse_unique(facts)
    assert chance_rates(facts)["city"] == pytest.approx(1 / 29)


def test_real_facts_valid():
    assert len(REAL_FACTS) == 70 and sum(bool(f.reverse_qs) for f in REAL_FACTS) == 40
    check_reverse_unique(REAL_FACTS)
    assert {f.popularity for f in REAL_FACTS} == {"head", "tail"}
    assert all(len(f.direct_qs) == 3 and len(f.contexts) == 2 and len(f.distractors) == 3 for f in REAL_FACTS)


def test_recital_cue_rate():
    facts = [Fact("Ana Bel", "city", "Rome", ("Rome",), "head", ("Ana Bel lives in",), ("Where?",), tag="heldout")]
    tab = pd.DataFrame(dict(fact=[0, 0], kind=["think", "think"], direction=["direct", "direct"],
                            output=[" Ana Bel was born in Oslo.", " Bo Ka was born in Rome."]))
    assert recital_cue_rate(tab, facts) == 0.5


def test_batched_left_padded_generation_matches_one_by_one():
    """hf_generate pads on the left; greedy continuations must equal those of each prompt alone (GPT-2 and Llama)."""
    from kimi_papers.core.models import tiny_causal_lm
    from kimi_papers.evaluation.wiki_profile import hf_generate
    from kimi_papers.evaluation.wiki_profile_experiment import SubsetTokenizer
    from kimi_papers.core.config import model_cache_dir
    from transformers import AutoTokenizer
    base = AutoTokenizer.from_pretrained(model_cache_dir() / "smollm2-135m-instruct")
    prompts = ["Q: Where was Ana born?\nA:", "Q: Who?\nA:", "Ana Bel was born in the city of Rome and", "Q:"]
    tok = SubsetTokenizer(base, prompts)
    for arch in ("gpt2", "llama"):
        model = tiny_causal_lm(tok.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=64, arch=arch, seed=1)
        batched = hf_generate(model, tok, prompts, 6, batch_size=4)
        alone = [hf_generate(model, tok, [p], 6)[0] for p in prompts]
        assert batched == alone, (arch, batched, alone)
