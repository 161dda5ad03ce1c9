"""kimi_papers.agents.agent_expt as a library: representations and the leakage rule, the InfoNCE kernel against a
float64 reference, retrieval ties, the adapter, interaction-chain features by hand (where computed and where applied),
the metrics by hand, the LLM reranker's parser and fallback, SciWorld's cues and time split, and a leaking build that
the audit must catch. A hashed bag-of-words embedder stands in for MiniLM except in the Embedder test."""
import copy
import re
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kimi_papers.agents.agent_expt import (
    ChainReranker, Context, ContrastiveAdapter, LLMReranker, Resource, ResourceRetriever, UsageStats, aggregate,
    build_resource_text, chain_features, hitrate_at_k, infonce_loss, interaction_chains, knn_usage, parse_ranking,
    recall_at_k, retrieve, select_contexts)
from kimi_papers.agents.agent_expt_experiment import (
    ADAPTED, DOMAINS, KINDS, OBJECTIVES, SciWorld, audit_leakage, representations, run_seed, summary)


def bag(texts, dim=64):
    """A deterministic stand-in embedder: hashed bag of words, unit length [n, dim]."""
    out = torch.zeros(len(texts), dim)
    for i, t in enumerate(texts):
        for w in re.findall(r"[a-z]+", t.lower()):
            out[i, sum(map(ord, w)) * 31 % dim] += 1.0
    return F.normalize(out + 1e-4, dim=-1)


class ToyWorld:
    def __init__(self):
        self.baselines = [Resource(0, "baseline", "B0", "a graph model"), Resource(1, "baseline", "B1", "an image model")]
        self.datasets = [Resource(0, "dataset", "D0", "a corpus of graphs"), Resource(1, "dataset", "D1", "a corpus of photos")]
        self.resources = {"baseline": self.baselines, "dataset": self.datasets}
        self.papers = [NS(id=0, year=1, datasets=(0,), baselines=(0,)), NS(id=1, year=2, datasets=(0, 1), baselines=(0, 1)),
                       NS(id=2, year=3, datasets=(0,), baselines=(0,)), NS(id=3, year=4, datasets=(1,), baselines=(1,))]
        self._ctx = {k: [[] for _ in v] for k, v in self.resources.items()}
        for p in self.papers:
            for k in KINDS:
                for r in getattr(p, k + "s"):
                    self._ctx[k][r].append(Context(p.id, p.year, f"paper {p.id} uses {k} {r}."))

    def contexts(self, r, before_year=None):
        return [c for c in self._ctx[r.kind][r.id] if before_year is None or c.year < before_year]


SMALL = dict(n_tasks=20, n_papers=500, n_datasets=100, n_baselines=120)


@pytest.fixture(scope="module")
def small():
    return SciWorld(seed=3, **SMALL)


# ---- representations and the leakage rule ---------------------------------------------------------------------
def test_resource_text_most_recent_before_the_query_year():
    toy = ToyWorld()
    d0 = toy.datasets[0]
    assert build_resource_text(d0, toy, "concat", m=2, before=4) == "a corpus of graphs paper 2 uses dataset 0. paper 1 uses dataset 0."
    assert build_resource_text(d0, toy, "ctx", m=8, before=2) == "paper 0 uses dataset 0."
    assert build_resource_text(toy.datasets[1], toy, "ctx", before=2) == "a corpus of photos"     # cold start
    with pytest.raises(AssertionError, match="leakage"):
        select_contexts(toy.contexts(d0), 8, before=2)                  # year-2 and year-3 contexts at query year 2
    with pytest.raises(ValueError, match="mode"):
        build_resource_text(d0, toy, "all")


def test_aggregate_by_hand():
    es, ec = torch.tensor([3.0, 0.0]), [torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])]
    v, cold = aggregate(es, ec, "concat")
    assert torch.allclose(v, torch.tensor([3.0, 2.0]) / 13 ** 0.5) and not cold
    assert torch.allclose(aggregate(es, ec, "self")[0], torch.tensor([1.0, 0.0]))
    v2, _ = aggregate(es, ec, "concat", alpha=0.5)                       # mix of the unit self and unit context vectors
    assert torch.allclose(v2, torch.tensor([1.0, 1.0]) / 2 ** 0.5)
    vc, cc = aggregate(es, [], "ctx")
    assert cc and torch.allclose(vc, torch.tensor([1.0, 0.0]))


def test_sciworld_time_split_cues_and_determinism(small):
    assert all(c.year < 5 for r in small.baselines for c in small.contexts(r, 5))
    assert any(c.year == 4 for r in small.baselines for c in small.contexts(r, 5))
    tr, te = small.split((7, 8))
    assert max(p.year for p in tr) == 6 and {p.year for p in te} == {7, 8}

    def names(text, t):
        d, o = small.tasks[t]
        w = set(re.findall(r"[a-z]+", text.lower()))
        return bool(w & set(DOMAINS[d])) and bool(w & set(OBJECTIVES[o]))
    share = np.mean([names(c.text, r.task) for r in small.baselines + small.datasets for c in small.contexts(r)])
    assert abs(share - (0.35 + 0.65 / 20)) < 0.03
    hi = SciWorld(seed=3, q_cue=0.9, **SMALL)
    assert hi.papers == small.papers                                   # the cue knob changes only the cues
    assert SciWorld(seed=3, **SMALL).papers == small.papers and SciWorld(seed=4, **SMALL).papers != small.papers
    for p in small.papers:
        assert all(small.truth["baseline"][b] == p.task for b in p.baselines)


def test_leaking_build_is_caught(small):
    tr, te = small.split((7, 8))
    reps, cold, prov = representations(small, bag, "concat", 8, range(1, 8))
    assert audit_leakage(small, prov, {p.id for p in te}, [(p.id, p.year) for p in tr]) == 0

    class Leaky(SciWorld):
        def contexts(self, r, before_year=None):
            return SciWorld.contexts(self, r, None if before_year is None else before_year + 1)   # off by one year
    leaky = copy.copy(small)
    leaky.__class__ = Leaky
    with pytest.raises(AssertionError, match="leakage"):
        representations(leaky, bag, "concat", 8, range(1, 8))
    bad = dict(prov)
    bad[("baseline", 7)] = prov[("baseline", 7)] | {te[-1].id}
    assert audit_leakage(small, bad, {p.id for p in te}, []) == 2      # a test paper, and one from after the version year


# ---- the InfoNCE kernel, retrieval and the adapter ------------------------------------------------------------
def infonce_reference(A, q, R, pos, mask, tau):
    """float64, written out: for each query, -log exp(s_pos) / sum over non-masked resources of exp(s)."""
    A, q, R = A.double(), q.double(), R.double()
    qa = q @ A
    qa = qa / qa.norm(dim=-1, keepdim=True)
    ra = R @ A
    ra = ra / ra.norm(dim=-1, keepdim=True)
    out = []
    for b in range(q.shape[0]):
        s = qa[b] @ ra.T / tau
        keep = [j for j in range(R.shape[0]) if not mask[b, j]]
        out.append(-(s[pos[b]] - torch.log(torch.exp(s[keep]).sum())))
    return torch.stack(out).mean()


def test_infonce_matches_reference_loss_and_gradient():
    g = torch.Generator().manual_seed(0)
    A = (torch.eye(8) + 0.1 * torch.randn(8, 8, generator=g)).requires_grad_(True)
    q, R = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g)
    pos = torch.tensor([0, 3, 3, 7, 11])
    mask = torch.zeros(5, 12, dtype=torch.bool)
    mask[0, 1] = mask[1, 4] = mask[3, 0] = True                       # other gold resources: out of the denominator
    loss = infonce_loss(A, q, R, pos, mask, 0.05)
    loss.backward()
    A64 = A.detach().double().requires_grad_(True)
    ref = infonce_reference(A64, q, R, pos, mask, 0.05)
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-4 * max(1.0, abs(float(ref)))
    assert torch.allclose(A.grad.double(), A64.grad, atol=1e-4, rtol=1e-3)


def test_infonce_by_hand_and_masking():
    A, q, R = torch.eye(2), torch.tensor([[1.0, 0.0]]), torch.eye(2)
    no = torch.zeros(1, 2, dtype=torch.bool)
    assert abs(float(infonce_loss(A, q, R, torch.tensor([0]), no, 1.0)) - np.log(1 + np.exp(-1))) < 1e-6
    assert abs(float(infonce_loss(A, q, R, torch.tensor([1]), torch.tensor([[True, False]]), 1.0))) < 1e-7


def test_retrieve_ties_clamp_and_bad_k():
    idx, sc = retrieve(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]), 2)
    assert idx.tolist() == [[0, 2]]
    with pytest.warns(RuntimeWarning, match="clamped"):
        assert retrieve(torch.eye(2), torch.eye(2), 9)[0].shape == (2, 2)
    for k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k: expected a positive int"):
            retrieve(torch.eye(2), torch.eye(2), k)


def test_adapter_learns_to_ignore_nuisance_dimensions():
    g = torch.Generator().manual_seed(0)
    sig = F.normalize(torch.randn(50, 6, generator=g), dim=-1)
    R = torch.cat([sig, torch.randn(50, 10, generator=g)], 1)
    qi = torch.arange(50).repeat(4)
    q = torch.cat([sig[qi] + 0.05 * torch.randn(200, 6, generator=g), torch.randn(200, 10, generator=g)], 1)
    ad = ContrastiveAdapter(dim=16, lr=3e-2, batch=64, seed=0, compiled=False).fit(q, [[int(i)] for i in qi], R, 300, 0.05)
    r1 = lambda a, b: float((retrieve(F.normalize(a, dim=-1), F.normalize(b, dim=-1), 1)[0][:, 0] == qi).float().mean())
    assert r1(ad.transform(q), ad.transform(R)) > r1(q, R) + 0.3
    again = ContrastiveAdapter(dim=16, lr=3e-2, batch=64, seed=0, compiled=False).fit(q, [[int(i)] for i in qi], R, 300, 0.05)
    assert torch.equal(again.A, ad.A)                                  # deterministic for a seed


# ---- interaction chains ------------------------------------------------------------------------------------------
def test_usage_stats_and_chain_features_by_hand():
    st = UsageStats.from_world(ToyWorld(), before=3)
    assert st.cooc.tolist() == [[2, 1], [1, 1]] and st.pop["dataset"].tolist() == [2, 1]
    f = chain_features(torch.tensor([[0.3, 0.2]]), torch.tensor([[1, 0]]), "dataset", torch.tensor([[0]]),
                       torch.tensor([[0.1, 0.7]]), st)
    # datasets D1, D0 against the top baseline B0: co-usage 1 and 2, k-NN shares 0.7 and 0.1, popularity 1 and 2
    want = torch.tensor([[0.3, np.log(2), 0.7, np.log(2)], [0.2, np.log(3), 0.1, np.log(3)]], dtype=torch.float32)
    assert torch.allclose(f[0], want)
    ch = interaction_chains(None, [1], "dataset", ["D0", "D1"], ["B0", "B1"], [0, 1], torch.tensor([0.1, 0.7]), st, 10)
    assert ch[0].co_usage == 2 and "used by 7 of the 10" in ch[0].text


def test_co_usage_is_read_per_kind_on_an_asymmetric_network():
    # baselines x datasets co-usage: B0-D0 3 papers, B1-D0 1 paper, B1-D1 2 papers (B0-D1 never)
    st = UsageStats(before=9, pop={"baseline": np.array([3.0, 3.0]), "dataset": np.array([4.0, 2.0])},
                    cooc=np.array([[3.0, 0.0], [1.0, 2.0]]), papers=[])
    fd = chain_features(torch.zeros(1, 2), torch.tensor([[0, 1]]), "dataset", torch.tensor([[1]]), torch.zeros(1, 2), st)
    assert torch.allclose(fd[0, :, 1], torch.log1p(torch.tensor([1.0, 2.0])))      # D0 and D1 with the top baseline B1
    fb = chain_features(torch.zeros(1, 2), torch.tensor([[0, 1]]), "baseline", torch.tensor([[1]]), torch.zeros(1, 2), st)
    assert torch.allclose(fb[0, :, 1], torch.log1p(torch.tensor([0.0, 2.0])))      # B0 and B1 with the top dataset D1
    ch = interaction_chains(None, [0], "dataset", ["D0", "D1"], ["B0", "B1"], [0, 1], torch.zeros(2), st, 10)
    assert ch[0].co_usage == 4 and "B0 in 3 papers" in ch[0].text


def test_knn_usage_and_reranker_applied():
    pe, U = torch.eye(4)[:3], torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 1.0, 1.0]])
    assert knn_usage(torch.tensor([[0.0, 0.6, 0.8, 0.0]]), pe, U, 2).tolist() == [[0.0, 1.0, 0.5]]
    g = torch.Generator().manual_seed(2)
    X = torch.randn(100, 6, 4, generator=g)
    rk = ChainReranker().fit(X, X[..., 3] > 0.5)
    cand = torch.arange(6)[None].repeat(100, 1) + 10
    ranked = rk.rank(X, cand)
    assert (ranked[:, 0] - 10 == X[..., 3].argmax(1)).float().mean() > 0.9


# ---- metrics, parser, user-facing retriever ------------------------------------------------------------------------
def test_metrics_by_hand():
    ranked = torch.tensor([[4, 0, 2, 9], [1, 2, 3, 5]])
    gold = [[0, 9], [7]]
    assert recall_at_k(ranked, gold, 2).tolist() == [0.5, 0.0] and recall_at_k(ranked, gold, 4).tolist() == [1.0, 0.0]
    assert hitrate_at_k(ranked, gold, 1).tolist() == [0.0, 0.0] and hitrate_at_k(ranked, gold, 2).tolist() == [1.0, 0.0]
    with pytest.warns(RuntimeWarning, match="empty gold"):
        assert recall_at_k(ranked, [[], [5]], 4).tolist() == [1.0]
    with pytest.raises(ValueError, match="k"):
        hitrate_at_k(ranked, gold, 0)


def test_parse_ranking_and_llm_fallback():
    assert parse_ranking("2, 3, 1 - because it is standard.", 3) == ([1, 2, 0], "because it is standard.", True)
    assert parse_ranking("7, 1, 1", 3) == ([0, 1, 2], "", True)
    assert parse_ranking("none of these", 3) == ([0, 1, 2], "none of these", False)

    class Tok:
        pad_token_id, eos_token_id = 0, 0
        def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
            return msgs[0]["content"]
        def __call__(self, text, return_tensors="pt"):
            class Enc(dict):
                def to(self, device):
                    return self
            return Enc(input_ids=torch.zeros(1, 3, dtype=torch.long))
        def decode(self, ids, skip_special_tokens=True):
            return "I cannot rank these."

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
        def generate(self, input_ids, **kw):
            return torch.zeros(1, 8, dtype=torch.long)

    st = UsageStats.from_world(ToyWorld(), before=3)
    ch = interaction_chains(None, [1, 0], "baseline", ["B0", "B1"], ["D0", "D1"], [0], torch.tensor([0.5, 0.2]), st, 10)
    order, just, ok = LLMReranker(LM(), Tok()).rank("a graph idea", [1, 0], ch)
    assert order == [1, 0] and not ok                                   # malformed: the retriever order is kept
    with pytest.raises(ValueError, match="query"):
        LLMReranker(LM(), Tok()).rank("  ", [1, 0], ch)


def test_resource_retriever_on_own_resources():
    rr = ResourceRetriever(bag).index([("A", "a generic corpus", ["graph retrieval benchmark", "graph retrieval data"]),
                                       ("B", "a generic corpus", ["speech recognition benchmark"]), ("A", "a generic corpus", [])])
    assert rr.search("a new graph retrieval method", k=1)[0][0] == "A" and rr.names == ["A", "B", "A#2"]
    with pytest.raises(ValueError, match="resources"):
        ResourceRetriever(bag).index([])


# ---- the pipeline on a small world (bag-of-words embedder) ----------------------------------------------------------
def test_run_seed_identities_and_no_leakage(small):
    P = dict(n_train=200, n_fit=60, n_test=80, m=8, steps=20, batch=64, tau=0.05, n_cand=100, k_nn=10, m_sweep=(8,),
             alphas=(0.0, 1.0))
    res, info = run_seed(small, bag, P, {a: 3e-3 for a in ADAPTED}, 3)
    assert info["leaks"] == 0
    S = {m: summary(res, m) for m in ("R@20", "HR@10")}
    assert S["R@20"]["oracle"] == 1.0 and S["HR@10"]["oracle"] == 1.0
    assert abs(S["R@20"]["alpha=1 frozen"] - S["R@20"]["self frozen"]) < 2e-3
    assert S["HR@10"]["concat+adapter+oracle-rerank"] >= S["HR@10"]["concat+adapter"]
    # popularity: every query gets the same list, the most-cited training-years resource first
    st = UsageStats.from_world(small, 7)
    top_d = int(np.argmax(st.pop["dataset"]))
    hit = [top_d in p.datasets for p in info["split"].test]
    assert res["popularity"]["dataset"]["HR@10"].mean() >= np.mean(hit) > 0
