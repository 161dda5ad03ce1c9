"""Tests of kimi_papers.decoding.jisi: the task parser, the question bank's checks, step 1 / step 2 against hand-computed
cases, the switch (spec and code variants), aggregator selection, the batched kernels against the per-query loop
(ties, k > N), JiSi's decisions on a toy pool, the specialists' loss and fixtures, the generation cache."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

from kimi_papers.core.io import cached_json
from kimi_papers.core.models import CharTokenizer, quantize_int8, tiny_causal_lm
from kimi_papers.core.rl.rollout import Policy
from kimi_papers.decoding.jisi import (
    agg_acc_fn, FAMILIES, finish_answer, is_correct, jisi_decide, JiSiConfig, length_score, mixed_profile_scores,
    mixed_profile_scores_compiled, mixed_profile_scores_loop, mixed_route, neighbour_mask, parse_answer,
    profile_scores, profile_scores_loop, query_route, Question, QuestionBank, ResponseTable, select_aggregator,
    subset_size, switch, weighted_profile)
from kimi_papers.decoding.jisi_experiment import (
    answer_loss, arith_view, best_expert_table, CharSpecialist, confounded_families, decide_arms, LEVELS, make_pool,
    make_question, Member, pending_aggregations, score_arms, specialist_fixture, split_pool, word_view)


def toy_bank(N=6, M=3, d=5, seed=0, dup=False):
    g = torch.Generator().manual_seed(seed)
    e = F.normalize(torch.randn(N, d, generator=g), dim=-1)
    if dup:
        e = torch.cat([e[: N // 2], e[: N - N // 2]])
    return QuestionBank([f"q{i}" for i in range(N)], (torch.rand(N, M, generator=g) > 0.5).float(),
                        [[f"r{i}{m}" for m in range(M)] for i in range(N)],
                        torch.randint(1, 9, (N, M), generator=g).float(), e,
                        F.normalize(torch.randn(N, M, d, generator=g), dim=-1))


def toy_table(Q=12, M=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs = make_pool(Q, seed, families=("arith",))
    texts = [[q.answer if (i + m) % 2 else "0" for m in range(M)] for i, q in enumerate(qs)]
    correct = torch.tensor([[float(is_correct(q, t)) for t in row] for q, row in zip(qs, texts)])
    return ResponseTable(qs, [f"m{m}" for m in range(M)], texts, correct, torch.full((Q, M), 10), torch.full((Q, M), 2),
                         F.normalize(torch.randn(Q, d, generator=g), dim=-1),
                         F.normalize(torch.randn(Q, M, d, generator=g), dim=-1), capable=[0, 1])


def test_parser_and_pool():
    q = Question("What is 3 + 5?", "8", "arith", 1)
    assert is_correct(q, "3 + 5 = 8") and not is_correct(q, "3 + 5 = 9") and is_correct(q, "7? Answer: 8")
    assert not is_correct(q, "The answer is 7, not 8")
    assert parse_answer("compare", "Yes, it is.") == "yes" and parse_answer("sort", "1, 2 and 3") == "1, 2, 3"
    pool = make_pool(60, 3)
    assert {(p.family, p.level) for p in pool} == {(f, lv) for f in FAMILIES for lv in LEVELS}
    assert all(is_correct(p, p.answer) for p in pool) and make_pool(60, 3) == pool
    rng = random.Random(0)
    assert all(len(make_question("arith", 3, rng).text.split()[2]) == 3 for _ in range(20))   # 3-digit operands
    with pytest.raises(ValueError, match="family"):
        parse_answer("poetry", "x")


def test_bank_rejects_bad_input():
    b = toy_bank()
    with pytest.raises(ValueError, match="empty"):
        QuestionBank([], torch.zeros(0, 3), [], torch.zeros(0, 3), torch.zeros(0, 5), torch.zeros(0, 3, 5))
    with pytest.raises(ValueError, match="NaN"):
        QuestionBank(b.queries, torch.full_like(b.records, float("nan")), b.responses, b.lengths, b.emb, b.resp_emb)
    with pytest.raises(ValueError, match="missing"):
        QuestionBank(b.queries, b.records, [r[:1] for r in b.responses], b.lengths, b.emb, b.resp_emb)
    with pytest.raises(ValueError, match="resp_emb"):
        QuestionBank(b.queries, b.records, b.responses, b.lengths, b.emb, b.resp_emb[:, :2])
    with pytest.raises(ValueError, match="k=0"):
        query_route(b, b.emb[0], k=0)
    with pytest.raises(ValueError, match="NaN"):
        query_route(b, torch.full((5,), float("nan")))


def test_neighbours_profile_and_length_by_hand():
    s = torch.tensor([90.0, 80.0, 80.0, 50.0, -10.0])
    assert neighbour_mask(s, 2, 0.9).tolist() == [True, True, True, False, False]       # both tied 80s
    assert neighbour_mask(s, 2, 0.6).tolist() == [True, True, True, True, False]        # 50 > 0.6 x 80
    assert neighbour_mask(s, 9, 0.9).all()                                              # k > N
    torch.testing.assert_close(weighted_profile(torch.tensor([0.9, 0.5]), torch.tensor([[1.0, 0.0], [0.0, 1.0]])),
                               torch.tensor([0.9 / 1.4, 0.5 / 1.4]))
    assert weighted_profile(torch.tensor([-1.0, 0.0]), torch.eye(2)).tolist() == [0.0, 0.0]
    torch.testing.assert_close(length_score(torch.tensor([[5.0, 2.0], [7.0, 2.0], [9.0, 2.0]]), torch.tensor([5.0, 2.0])),
                               torch.tensor([1.0, 0.75, 0.5]))                           # model 2 all equal -> 1
    assert subset_size(21, 0.5) == 11 and subset_size(21, 0.5, "floor") == 10


def test_mixed_route_reduces_to_query_route():
    b = toy_bank(N=8)
    q = F.normalize(torch.randn(5, generator=torch.Generator().manual_seed(1)), dim=0)
    idx, sims, p1 = query_route(b, q, k=8, thres=0.9)
    p2, keep, score = mixed_route(b, q, b.resp_emb[0, :2], torch.tensor([3.0, 4.0]), [0, 1], alpha_q=1.0, subset_p=1.0,
                                  k=8, thres=0.9)
    torch.testing.assert_close(p2, p1)               # alpha_q = 1 and p = 1: the same weights on the same neighbours
    # alpha_q = 0, alpha_l = 0: ranking by response similarity alone, by hand
    _, keep0, sc0 = mixed_route(b, q, b.resp_emb[0, :2], torch.tensor([3.0, 4.0]), [0, 1], alpha_q=0.0, alpha_l=0.0,
                                subset_p=0.5, k=8, thres=0.9)
    rho = (b.resp_emb[:, :2] * b.resp_emb[0, :2]).sum(-1).mean(-1)
    assert keep0.tolist() == torch.sort(rho, descending=True, stable=True).indices[:4].tolist()
    torch.testing.assert_close(sc0, rho[keep0])


def test_switch_and_aggregator():
    assert switch([0.9, 0.2, 0.1], [5, 5, 5]) == 1 and switch([0.9, 0.88, 0.1], [5, 5, 5]) == 2
    assert switch([0.0, 0.0], [1, 1]) == 1
    assert switch([0.5, 0.5, 0.5, 0.5], [9, 9, 9], cut_length=20, n_refs=3) == 2
    assert switch([0.5, 0.5, 0.5, 0.5], [9, 9, 9], cut_length=20, n_refs=3, variant="code") == 3
    with pytest.raises(ValueError, match="variant"):
        switch([1.0], [1], variant="paper")
    p2, aa = torch.tensor([0.8, 0.6, 0.1]), torch.tensor([0.2, 0.9, 0.5])
    assert select_aggregator(p2, aa, 1.0) == 1 and select_aggregator(p2, aa, 0.0) == 0
    assert select_aggregator(p2, aa, 0.5) == 1                                  # 0.75 vs 0.5
    with pytest.raises(ValueError, match="beta"):
        select_aggregator(p2, aa, 1.5)


@pytest.mark.parametrize("k", [1, 3, 50])
@pytest.mark.parametrize("dup", [False, True])
def test_batched_kernels_equal_loop(k, dup):
    b = toy_bank(N=10, M=4, d=6, seed=2, dup=dup)
    g = torch.Generator().manual_seed(3)
    q = F.normalize(torch.randn(6, 6, generator=g), dim=-1)
    U = torch.stack([torch.randperm(4, generator=g)[:3] for _ in range(6)])
    pe = F.normalize(torch.randn(6, 3, 6, generator=g), dim=-1)
    pl = torch.randint(1, 9, (6, 3), generator=g).float()
    torch.testing.assert_close(profile_scores(q, b.emb, b.records, k), profile_scores_loop(q, b, k), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mixed_profile_scores(q, b.emb, b.records, b.resp_emb, b.lengths, U, pe, pl, k),
                               mixed_profile_scores_loop(q, b, U, pe, pl, k), atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_compiled_kernel_equals_loop():
    b = toy_bank(N=10, M=4, d=6, seed=2)
    g = torch.Generator().manual_seed(3)
    q = F.normalize(torch.randn(6, 6, generator=g), dim=-1)
    U = torch.stack([torch.randperm(4, generator=g)[:3] for _ in range(6)])
    pe, pl = F.normalize(torch.randn(6, 3, 6, generator=g), dim=-1), torch.randint(1, 9, (6, 3), generator=g).float()
    out = mixed_profile_scores_compiled(q, b.emb, b.records, b.resp_emb, b.lengths, U, pe, pl, 20, 0.9, 0.5, 0.2, 0.5)
    torch.testing.assert_close(out, mixed_profile_scores_loop(q, b, U, pe, pl, 20), atol=1e-6, rtol=1e-5)


def test_jisi_decisions_on_a_toy_pool():
    t = toy_table()
    bank = t.bank(range(8))
    r = jisi_decide(10, t, bank, JiSiConfig(k=3, force_n=1))
    assert r.mode == "route" and r.cost == 36 and len(r.probed) == 3
    r3 = jisi_decide(10, t, bank, JiSiConfig(k=3, force_n=3))
    assert r3.mode == "aggregate" and r3.model in (0, 1)
    done = finish_answer(r3, t, lambda a, q, refs: (t.questions[q].answer, 5))
    assert done.correct == 1.0 and done.cost == r3.cost + 5
    assert jisi_decide(10, t, bank, JiSiConfig(k=3, step2=False, force_n=1)).cost == 12     # no probes paid
    empty = ResponseTable(t.questions, t.names, [["", "", ""]] * 12, t.correct, t.prompt_tokens, t.gen_tokens, t.q_emb,
                          t.resp_emb, t.capable)
    assert jisi_decide(10, empty, bank, JiSiConfig(k=3)).mode == "route"                   # fallback to the global best


def test_arms_and_accounting():
    t = toy_table()
    b_idx, t_idx = split_pool(12, 8, 0)
    dec = decide_arms(t, b_idx, t_idx, {"JiSi": JiSiConfig(k=3)}, {}, static_aggregator=0, seed=0)
    rows = score_arms(dec, t, lambda a, q, refs: ("0", 5))
    static = [r for r in rows if r["arm"] == "static aggregation"]
    assert len(static) == len(t_idx) and all(r["cost"] == 3 * 12 + 5 for r in static)
    oracle = [r for r in rows if r["arm"] == "oracle"]
    assert all(r["correct"] == float(t.correct[r["qid"]].max()) for r in oracle)
    assert pending_aggregations(dec, {}) == sorted(set(pending_aggregations(dec, {})))
    aa = agg_acc_fn(b_idx, {(0, b_idx[0]): 1.0, (0, b_idx[1]): 0.0}, 3)
    assert aa(torch.tensor([1])).tolist() == [0.0, 0.0, 0.0] and aa(torch.tensor([2]))[0] == 0.5
    with pytest.raises(ValueError, match="n_bank"):
        split_pool(5, 5, 0)


def test_best_expert_and_confounded():
    t = toy_table()
    best = best_expert_table(t)
    assert list(best.columns[-1:]) == ["best"] and len(best) == 4
    assert confounded_families(best, t.names) in ([], ["arith"])


def test_answer_loss_by_hand_and_views():
    sp = CharSpecialist(d_model=32, n_layers=1, n_heads=2, seed=0, reverse_digits=True, view=arith_view)
    q = Question("What is 12 + 30?", "42", "arith", 2)
    ids = sp.encode_example(q)
    assert sp.tok.decode(ids) == "12+30=24" and sp.finish("24") == "42"
    b = torch.tensor([ids])
    loss, _ = answer_loss(sp, b)
    with torch.no_grad():
        lg = sp(b[:, :-1])[0]
    L = len(ids)
    hand = torch.stack([F.cross_entropy(lg[p], b[0, p + 1]) for p in (L - 4, L - 3, L - 2)]).mean()
    torch.testing.assert_close(loss, hand)
    assert word_view("Reverse the letters of abcde.") == "abcde" and arith_view("Is 4 larger than 70?") == "470"


def test_members_and_int8():
    tok = CharTokenizer("ab =")
    pol = Policy(tiny_causal_lm(tok.vocab_size, 16, 1, 2, tokenizer=tok), tok, add_bos=True, template="{prompt}=")
    m = Member("c", pol, "char", 3, view=lambda t: t[:1])
    assert m.prompt("ab") == [tok.bos_id] + tok.encode("a=")
    with pytest.raises(ValueError, match="style"):
        Member("c", pol, "verse", 3)
    llama = tiny_causal_lm(40, 16, 1, 2, seed=0)
    q8 = quantize_int8(llama)
    x = torch.randint(0, 40, (2, 5))
    assert q8(input_ids=x).logits.shape == (2, 5, 40)
    assert isinstance(llama.model.layers[0].mlp.up_proj, torch.nn.Linear)          # the original is untouched


@pytest.mark.gpu
def test_int8_refuses_cuda():
    llama = tiny_causal_lm(40, 16, 1, 2, seed=0).cuda()
    with pytest.raises(ValueError, match="CPU"):
        quantize_int8(llama)


@pytest.mark.gpu
def test_kernels_on_cuda():
    b = toy_bank(N=10, M=4, d=6, seed=2)
    q = F.normalize(torch.randn(6, 6), dim=-1)
    out = profile_scores(q.cuda(), b.emb.cuda(), b.records.cuda(), 3)
    torch.testing.assert_close(out.cpu(), profile_scores_loop(q, b, 3), atol=1e-5, rtol=1e-4)


def test_cache_is_atomic_and_keyed(tmp_path):
    p = tmp_path / "g.json"
    assert cached_json(p, {"v": 1}, lambda: {"a": 1}) == {"a": 1}
    assert cached_json(p, {"v": 1}, lambda: pytest.fail("recomputed")) == {"a": 1}
    assert cached_json(p, {"v": 2}, lambda: [2]) == [2]

    def boom():
        raise RuntimeError("interrupted")
    with pytest.raises(RuntimeError):
        cached_json(tmp_path / "h.json", {"v": 1}, boom)
    assert not list(tmp_path.glob("h.json*"))                                        # nothing half-written


def test_specialist_fixtures_know_their_domain():
    from kimi_papers.core.config import project_root
    from kimi_papers.decoding.jisi_experiment import run_member
    folder = project_root() / "tests" / "fixtures" / "jisi"
    if not (folder / "arith_2digit_s0.pt").is_file():
        pytest.skip("specialist fixtures not built yet")
    spec, info = specialist_fixture("arith_2digit", 1500, 0, folder)
    assert info["source"] == "arith_2digit_s0.pt"
    rng = random.Random(11)
    qs = [make_question("arith", 2, rng) for _ in range(30)]
    g = run_member(Member("A", spec.policy, "char", 6, finish=spec.finish, view=spec.view), [q.text for q in qs], batch=30)
    assert sum(is_correct(q, t) for q, t in zip(qs, g.texts)) / len(qs) >= 0.3


def test_moved_harness_names_still_resolve():
    """Names that lived in the method module before the split resolve from the experiment module, with a warning."""
    import kimi_papers.decoding.jisi as method
    import kimi_papers.decoding.jisi_experiment as experiment
    with pytest.warns(DeprecationWarning, match="jisi_experiment"):
        assert method.make_pool is experiment.make_pool
    with pytest.raises(AttributeError, match="no_such_name"):
        method.no_such_name
