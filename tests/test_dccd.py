"""Tests of kimi_papers.decoding.dccd: the token-mask engine on SmolLM2's real tokenizer, the masked-renorm kernel,
constrained decoding with a tiny random model, scoring and the bad inputs of the spec."""
import json
import re

import numpy as np
import pytest
import regex
import torch

from kimi_papers.core.models import CharTokenizer, tiny_causal_lm
from kimi_papers.core.rl.rollout import HiddenStates, Policy, sequence_stats
from kimi_papers.decoding.dccd import (
    ConstraintDeadEnd, TokenDFAMasker, constrained_batch, dccd_batch, json_schema_regex, masked_renorm,
    masked_renorm_reference, projection_tax, stage2_prompt, _policy, EXTRACT_SYSTEM)
from kimi_papers.decoding.dccd_experiment import (
    SCHEMA, WordProblem, answer_correct, make_problems, parse_json_answer, schema_regex, strict_correct)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    from kimi_papers.core.models import SMOLLM2_CACHE, cache_is_valid, load_smollm2, model_cache_dir
    folder = model_cache_dir() / SMOLLM2_CACHE
    if cache_is_valid(folder):
        return AutoTokenizer.from_pretrained(folder)
    return load_smollm2("cpu")[1]


@pytest.fixture(scope="module")
def masker(tok):
    return TokenDFAMasker(tok, schema_regex())


def reference_mask(m: TokenDFAMasker, prefix: str) -> torch.Tensor:
    """Independent check with the `regex` package: token allowed iff prefix + token can still be completed."""
    pat = regex.compile(m.regex)
    out = torch.tensor([s is not None and i != m.eos_id and pat.fullmatch(prefix + s, partial=True) is not None
                        for i, s in enumerate(m.strings)])
    out[m.eos_id] = pat.fullmatch(prefix) is not None
    return out


def test_schema_regex_accepts_json_only():
    rx = re.compile(schema_regex())
    assert rx.fullmatch('{"steps": ["7 + 5 = 12"], "answer": "12"}')
    assert rx.fullmatch('{"steps": ["a", "b", "c"], "answer": "-3"}')
    assert not rx.fullmatch('{"steps": ["a", "b", "c", "d"], "answer": "1"}')   # at most 3 steps
    assert not rx.fullmatch('{"steps": ["a\nb"], "answer": "1"}')              # raw control character (review fix)
    assert not rx.fullmatch('{"steps": ["' + "x" * 61 + '"], "answer": "1"}')
    assert re.compile(schema_regex(1, 5)).fullmatch('{"steps": ["abcde"], "answer": "1"}')
    with pytest.raises(ValueError, match="max_steps"):
        schema_regex(0)
    with pytest.raises(ValueError, match="max_chars"):
        schema_regex(2, -1)


def test_start_mask_is_prefixes_of_the_opening(masker):
    start = masker.allowed(masker.start_state())
    got = {masker.strings[i] for i in start.nonzero().flatten().tolist()}
    want = {s for s in masker.strings if s and '{"steps": ["'.startswith(s)}
    assert got == want and "{" in got and masker.eos_id not in start.nonzero().flatten().tolist()
    assert torch.equal(start, reference_mask(masker, ""))


@pytest.mark.parametrize("prefix", ['{"st', '{"steps": ["a", "b"], "answer": "1', '{"steps": ["a"], "answer": "12"}',
                                    '{"steps": ["' + "x" * 60])
def test_masks_match_regex_partial_matching(masker, prefix):
    s = masker.walk(prefix)
    assert s is not None
    assert torch.equal(masker.allowed(s), reference_mask(masker, prefix))
    assert masker.is_final(s) == prefix.endswith("}")


def test_random_logit_walks_give_schema_valid_json(masker):
    import jsonschema
    g = torch.Generator().manual_seed(0)
    for walk in range(2):
        s, text = masker.start_state(), ""
        for _ in range(400):
            logits = torch.randn(1, masker.vocab_size, generator=g) * 3
            logq, logZ = masked_renorm(logits, masker.allowed(s)[None], compiled=False)
            t = int(logq.argmax())
            if t == masker.eos_id:
                break
            text += masker.strings[t]
            s = masker.advance(s, t)
        assert masker.is_final(s), text
        jsonschema.validate(json.loads(text), SCHEMA)
        assert re.fullmatch(schema_regex(), text)


def test_advance_rejects_disallowed_token(masker, tok):
    bad = tok.encode(" {", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match="not allowed"):
        masker.advance(masker.start_state(), bad)
    with pytest.raises(ValueError, match="state"):
        masker.allowed(10_000)


def test_masked_renorm_kernel_matches_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=g) * 4
    mask = torch.rand(5, 300, generator=g) < 0.3
    mask[0] = False
    mask[0, 17] = True  # a single allowed token
    for T in (1.0, 0.7):
        want_q, want_z = masked_renorm_reference(logits, mask, T)
        for compiled in (False, True):
            q, z = masked_renorm(logits, mask, T, compiled=compiled)
            torch.testing.assert_close(z, want_z, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(q[mask], want_q[mask], atol=1e-5, rtol=1e-5)
            assert torch.isinf(q[~mask]).all()
    p = torch.softmax(logits.double(), -1)
    torch.testing.assert_close(masked_renorm(logits, mask, compiled=False)[1].double(), (p * mask).sum(-1).log(),
                               atol=1e-5, rtol=1e-5)
    assert abs(float(masked_renorm(logits, mask)[1][0]) - float(p[0, 17].log())) < 1e-4


def test_masked_renorm_bad_inputs():
    logits = torch.randn(2, 8)
    with pytest.raises(ConstraintDeadEnd, match="allow no token"):
        masked_renorm(logits, torch.zeros(2, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        masked_renorm(logits, torch.ones(2, 8, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match="mask"):
        masked_renorm(logits, torch.ones(2, 8))


def test_regex_errors():
    tk = CharTokenizer("ab")
    with pytest.raises(ValueError, match="empty string"):
        TokenDFAMasker(tk, "a*")
    with pytest.raises(ValueError, match="no reachable accepting state"):
        TokenDFAMasker(tk, "[a-b]&&[c]") if False else TokenDFAMasker(tk, "a[^\\s\\S]")
    with pytest.raises(ValueError, match="regex"):
        TokenDFAMasker(tk, "")


def test_dead_end_vocabulary_raises():
    class TwoCharTokens(CharTokenizer):
        """Vocabulary: pad/bos/eos, then only the two-letter token 'ab'."""
        def __init__(self):
            super().__init__("x")
        def __len__(self):
            return 4
        def decode(self, ids, skip_special=True):
            return {3: "ab"}.get(list(ids)[0], "")
    m = TokenDFAMasker(TwoCharTokens(), "abc")
    s = m.advance(m.start_state(), 3)
    with pytest.raises(ConstraintDeadEnd, match="no token"):
        m.allowed(s)


def test_projection_tax_and_scoring():
    assert projection_tax([-0.5, -1.5, 0.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="logZ"):
        projection_tax([0.3])
    with pytest.raises(ValueError, match="logZ"):
        projection_tax([float("nan")])
    good = '{"steps": ["7 + 5 = 12"], "answer": "12"}'
    assert strict_correct(good, 12) and not strict_correct(good, 13)
    assert not strict_correct(good[:-1], 12) and not strict_correct('{"steps": [], "answer": "12"}', 12)
    assert parse_json_answer("Sure! " + good + " Done.")["answer"] == "12"
    assert parse_json_answer('{"steps": ["a"], "answer": 12}') is None   # the schema wants a string
    assert answer_correct("so 7 + 5 = 12 pens", 12) and not answer_correct("no number", 12)


def test_make_problems_disjoint_and_checked():
    a, b = make_problems(20, 0), make_problems(20, 1)
    assert not {p.question for p in a} & {p.question for p in b}
    assert a == make_problems(20, 0)
    p = next(p for p in a if p.kind == "add")
    nums = [int(x) for x in re.findall(r"\d+", p.question)]
    assert p.answer == sum(nums)
    with pytest.raises(ValueError, match="n="):
        make_problems(0)
    with pytest.raises(ValueError, match="seed"):
        make_problems(5, -1)


@pytest.fixture(scope="module")
def tiny(tok):
    return tiny_causal_lm(len(tok), d_model=32, n_layers=1, n_heads=2, max_len=512, seed=0)


def test_constrained_batch_tax_identity_and_truncation(tiny, tok, masker):
    pol = Policy(tiny, tok, chat=True, system="s")
    prompts = [pol.encode_prompt("Ann has 3 pens."), pol.encode_prompt("Ben has 12 cards and buys 4.")]
    outs = constrained_batch(pol, prompts, masker, 200)
    for o in outs:
        assert o.finished and re.fullmatch(schema_regex(), o.text) and strict_correct(o.text, int(json.loads(o.text)["answer"]))
    # log q(y) − log p(y) = −Σ log Z, with log p from an independent teacher-forced pass (core.rl.sequence_stats)
    o, p = outs[1], prompts[1]
    ids = torch.tensor([p + o.tokens])
    resp = torch.zeros_like(ids); resp[0, len(p):] = 1
    with torch.no_grad():
        lp = sequence_stats(HiddenStates(tiny), pol.head(), ids, torch.ones_like(ids), resp)["logp"][0, len(p):]
    torch.testing.assert_close(torch.tensor(o.logq) - lp, -torch.tensor(o.logZ), atol=1e-4, rtol=0)
    assert o.tax == pytest.approx(float(lp.sum()) * -1 + sum(o.logq), abs=1e-3)
    short = constrained_batch(pol, prompts[:1], masker, 3)[0]
    assert not short.finished and len(short.tokens) == 3 and not strict_correct(short.text, 1)
    with pytest.raises(ValueError, match="temperature"):
        constrained_batch(pol, prompts, masker, 5, temperature=-1)
    sampled = constrained_batch(pol, prompts, masker, 200, temperature=1.0, seed=3)
    assert all(s.finished for s in sampled)
    assert [s.tokens for s in sampled] == [s.tokens for s in constrained_batch(pol, prompts, masker, 200, temperature=1.0, seed=3)]


def test_dccd_bad_inputs_and_left_truncation(tiny, tok, masker):
    with pytest.raises(ValueError, match="k="):
        dccd_batch(tiny, tok, ["q"], masker, k=0)
    with pytest.raises(ValueError, match="select"):
        dccd_batch(tiny, tok, ["q"], masker, select="best")
    with pytest.raises(ValueError, match="temperature"):
        dccd_batch(tiny, tok, ["q"], masker, temperature=-0.5)
    pol = _policy(tiny, tok, EXTRACT_SYSTEM)
    long_draft = " ".join(f"w{i}" for i in range(400)) + " final answer 7"
    ids = stage2_prompt(pol, "How many?", [long_draft], max_prompt_tokens=200)
    assert len(ids) <= 200 and "final answer 7" in tok.decode(ids) and "w0 " not in tok.decode(ids)
    r = dccd_batch(tiny, tok, ["Ann has 2 pens."], masker, drafts=[[""]], json_tokens=200)[0]   # empty draft is allowed
    assert r.drafts == [""] and r.output.finished


REVIEW_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "stars"],
                 "properties": {"city": {"type": "string", "maxLength": 12}, "stars": {"enum": [1, 2, 3, 4, 5]},
                                "tags": {"type": "array", "items": {"enum": ["clean", "quiet"]}, "maxItems": 2}}}


def _outlines_index(m: TokenDFAMasker):
    """outlines-core's Index of the masker's regex over the same token strings (excluded tokens left out)."""
    import outlines_core
    vocab = {}
    for i, s in enumerate(m.strings):
        if s is not None and i != m.eos_id:
            vocab.setdefault(s, []).append(i)
    return outlines_core.Index(m.regex, outlines_core.Vocabulary(m.eos_id, vocab))


def _outlines_walk(m: TokenDFAMasker, index, seed: int, steps: int = 30) -> int:
    """Random walk of allowed tokens; at every state outlines-core's Index allows exactly our tokens. -> states checked."""
    rng, s_ours, s_oc, n = np.random.default_rng(seed), m.start_state(), index.get_initial_state(), 0
    for n in range(1, steps + 1):
        ours = set(m.allowed(s_ours).nonzero().flatten().tolist())
        assert ours == set(index.get_allowed_tokens(s_oc)), (seed, n, s_ours)
        assert m.is_final(s_ours) == index.is_final_state(s_oc)
        t = int(rng.choice(sorted(ours)))
        if t == m.eos_id:
            break
        s_ours, s_oc = m.advance(s_ours, t), index.get_next_state(s_oc, t)
    return n


def test_token_masks_agree_with_outlines_core_on_smollm2(tok, masker):
    """Same regex, same SmolLM2 token strings: our interegular engine and outlines-core's Index allow the same tokens."""
    schema_masker = TokenDFAMasker.from_json_schema(tok, REVIEW_SCHEMA)
    assert schema_masker.regex == json_schema_regex(json.dumps(REVIEW_SCHEMA))
    checked = 0
    for m in (masker, schema_masker):
        index = _outlines_index(m)
        checked += sum(_outlines_walk(m, index, seed) for seed in range(2))
    assert checked >= 40
    # the start state of the schema allows only tokens that begin the object (`{`, `{"`, ...)
    start = {schema_masker.strings[i] for i in schema_masker.allowed(schema_masker.start_state()).nonzero().flatten().tolist()}
    assert "{" in start and '{"' in start and all(s.startswith("{") for s in start)


def test_json_schema_regex_and_errors():
    rx = re.compile(json_schema_regex(REVIEW_SCHEMA))
    assert rx.fullmatch('{"city": "Lyon", "stars": 4}') and rx.fullmatch('{"city":"Lyon","stars":4,"tags":["quiet"]}')
    assert not rx.fullmatch('{"city": "Lyon", "stars": 6}') and not rx.fullmatch('{"city": "' + "x" * 13 + '", "stars": 1}')
    assert re.compile(json_schema_regex(REVIEW_SCHEMA, whitespace="")).fullmatch('{"city":"Lyon","stars":4}')
    assert not re.compile(json_schema_regex(REVIEW_SCHEMA, whitespace="")).fullmatch('{"city": "Lyon","stars":4}')
    with pytest.raises(ValueError, match="schema"):
        json_schema_regex(["not", "a", "schema"])
    with pytest.raises(ValueError, match="schema"):
        json_schema_regex("{not json")


def test_dccd_on_own_json_schema(tiny, tok):
    import jsonschema
    m = TokenDFAMasker.from_json_schema(tok, REVIEW_SCHEMA)
    r = dccd_batch(tiny, tok, ["Where, and how many stars?"], m, drafts=[["Lyon, 4 stars."]], json_tokens=64,
                   system="Convert the review into JSON.")[0]
    assert r.output.finished
    jsonschema.validate(json.loads(r.output.text), REVIEW_SCHEMA)


def test_moved_harness_names_resolve_with_a_warning():
    from kimi_papers.decoding import dccd, dccd_experiment
    with pytest.warns(DeprecationWarning, match="dccd_experiment"):
        assert dccd.run_arms is dccd_experiment.run_arms
    with pytest.raises(AttributeError):
        dccd.no_such_name


def test_constrained_generate_single_prompt(tiny, tok, masker):
    from kimi_papers.decoding.dccd import constrained_generate
    text, logZ = constrained_generate(tiny, tok, "Ann has 3 pens.", masker, 160, system="s")
    assert re.fullmatch(schema_regex(), text) and len(logZ) >= 10 and all(z <= 1e-6 for z in logZ)
    with pytest.raises(TypeError, match="prompt"):
        constrained_generate(tiny, tok, ["not", "a", "str"], masker, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_and_kernel_on_cuda(tok):
    m = TokenDFAMasker(tok, schema_regex(), device="cuda")
    mask = m.allowed(m.start_state())
    assert mask.device.type == "cuda"
    logits = torch.randn(2, m.vocab_size, device="cuda")
    q, z = masked_renorm(logits, torch.stack([mask, mask]))
    qr, zr = masked_renorm_reference(logits.cpu(), torch.stack([mask, mask]).cpu())
    torch.testing.assert_close(z.cpu(), zr, atol=1e-4, rtol=1e-4)
