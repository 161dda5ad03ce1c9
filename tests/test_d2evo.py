"""Unit tests of kimi_papers.rl.d2evo: the plateau reward, anchors, parsing, voting, the buffer, a tiny run, the sampler."""
import random
import re

import numpy as np
import pytest
import torch

from kimi_papers.core.kernels import compiled_ran
from kimi_papers.core.rl import scripted_policy
from kimi_papers.core.token_stats import sample_next_compiled, gumbel_noise, sample_next
from kimi_papers.rl import d2evo as D
from kimi_papers.rl import d2evo_experiment as DE


def test_plateau_reward_values_edges_and_kinds():
    x = np.array([0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0])
    assert D.plateau_reward(x, 0.4, 0.8, 2.0).tolist() == pytest.approx([0, 0.25, 1, 1, 1, 0.25, 0])
    for edge in (0.4, 0.8):
        lo, hi = D.plateau_reward(np.array([edge - 1e-9, edge + 1e-9]), 0.4, 0.8)
        assert abs(lo - 1) < 1e-7 and abs(hi - 1) < 1e-7
    t = D.plateau_reward(torch.tensor([0.2, 0.5]), 0.4, 0.8, 3.0)
    assert isinstance(t, torch.Tensor) and t.tolist() == pytest.approx([0.125, 1.0])
    assert D.plateau_reward(np.array([0.95]), 0.4, 1.0).tolist() == [1.0]  # tau_u = 1: no upper branch


@pytest.mark.parametrize("kw,msg", [(dict(tau_l=0.8, tau_u=0.4), "tau_l < tau_u"), (dict(tau_l=0.0), "tau_l > 0"),
                                    (dict(tau_u=1.5), "tau_u"), (dict(a=0.9), "a="), (dict(tau_l=float("nan")), "tau_l")])
def test_plateau_reward_bad_input(kw, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        D.plateau_reward(np.array([0.5]), **{**dict(tau_l=0.4, tau_u=0.8, a=2.0), **kw})


def test_select_anchors_edges_and_widening():
    rates = np.array([c / 8 for c in range(9)])
    assert D.select_anchors(rates, 0.375, 0.75).tolist() == [3, 4, 5, 6]     # both edges inside
    assert D.select_anchors([0.4 * 1.0000000001, 0.8], 0.4, 0.8).tolist() == [0, 1]
    idx, band = D.widen_band([0.0, 0.25, 1.0], 0.4, 0.8)
    assert idx.tolist() == [1] and band == pytest.approx((0.2, 0.95))
    idx, band = D.widen_band([0.0, 1.0], 0.4, 0.8)
    assert idx.size == 0 and band == pytest.approx((0.1, 0.95))
    with pytest.raises(ValueError, match="low < high"):
        D.select_anchors(rates, 0.5, 0.5)
    with pytest.raises(ValueError, match="band outside"):
        D.select_anchors(rates, -0.1, 0.5)


def test_parse_question_and_majority_label():
    assert D.parse_question("3 * (4+5)") == "3*(4+5)"
    for bad in ["", "7", "3+", "2**8", "__import__('os')", "999*9999", "8/2", None, "1+1+1+" * 20]:
        assert D.parse_question(bad) is None
    assert D.majority_label(["12", "12", "13", "?"]) == ("12", 0.5)
    assert D.majority_label(["1", "2", "2", "1"]) == (None, 0.5)
    assert D.majority_label(["x"]) == (None, 0.0)
    with pytest.raises(ValueError, match="answers"):
        D.majority_label([])


def test_questioner_prompt_and_bad_difficulty():
    assert D.questioner_prompt("4*5=", "20", 30) == "Write a new problem like 4*5 = 20 with difficulty 30: "
    assert D.questioner_prompt(None, None, 0).startswith("Write a new problem with difficulty 0")
    with pytest.raises(ValueError, match="difficulty"):
        D.questioner_prompt("1+1", "2", -1)
    with pytest.raises(ValueError, match="rate="):
        D.difficulty_of(1.5)


def test_arithgen_truth_split_and_bad_input():
    g = D.ArithGen(seed=4)
    items = g.sample(300)
    assert all(p.answer == str(eval(p.prompt[:-1])) for p in items)
    assert not any(g.is_heldout(p) for p in items)
    hard = DE.hard_split(30, g)
    assert all(max(map(len, re.findall(r"\d+", p.prompt))) == 3 or len(re.findall(r"\d+", p.prompt)) == 3 for p in hard)
    with pytest.raises(ValueError, match="ops"):
        D.ArithGen(ops="^")
    with pytest.raises(ValueError, match="n_operands"):
        D.ArithGen(n_operands=0)


def test_judge_and_buffer_with_a_scripted_solver():
    """A Solver that always answers 7: the label is 7, x = 1 (out of band), so nothing is kept unless the band includes 1."""
    pol = scripted_policy(D.ALPHABET, {"=": "7", ":": "3", " ": "3", "3": "+", "+": "4"}, strength=50.0)
    g = torch.Generator().manual_seed(0)
    j = D.judge_questions(pol, ["3+4", "9", "2+5", "3+4"], n_v=4, generator=g, banned={"2+5="})
    assert j.valid.tolist() == [True, False, False, True] and j.label.tolist()[0] == "7" and j.x.iloc[0] == 1.0
    anchors = [D._problem("3+3", "6")]
    items, cand = D.build_hybrid_buffer(pol, anchors, 3, (0.4, 0.8), verify=False, rates=[0.5], n_v=4, generator=g)
    assert len(cand) == 3 and not items and set(cand.reason) <= {"out of band", "invalid/duplicate", "duplicate"}
    items, cand = D.build_hybrid_buffer(pol, anchors, 3, (0.4, 1.0), verify=True, rates=[0.5], n_v=4, generator=g)
    kept = cand[cand.kept]
    assert len(items) == len(kept) <= 1 and all(p.answer == D.meta_of(p)["truth"] for p in items)
    with pytest.raises(ValueError, match="rates"):
        D.build_hybrid_buffer(pol, anchors, 2, rates=[], generator=g)


def test_config_validation():
    with pytest.raises(ValueError, match="arm="):
        DE.D2EvoConfig(arm="nope")
    with pytest.raises(ValueError, match="a="):
        DE.D2EvoConfig(a=0.5)
    with pytest.raises(ValueError, match="s_steps"):
        DE.D2EvoConfig(s_steps=0)
    with pytest.raises(ValueError, match="alpha"):
        DE.D2EvoConfig(alpha=1.5)
    with pytest.raises(ValueError, match="arm 'x'"):
        DE.arm_config("x", DE.D2EvoConfig(), 0)


def test_solver_reward():
    p = D._problem("2+2", "4")
    assert D.solver_reward(0.9)([p, p, p], ["4", "5", "four"]) == pytest.approx([1.0, 0.1, 0.0])


def test_fixture_loads_and_tiny_run_is_deterministic():
    policy, info = DE.d2evo_policy()
    assert info["source"] == DE.fixture_file().name
    cfg = DE.D2EvoConfig(arm="d2evo", iterations=1, pool=16, n_difficulty=4, n_v=4, q_steps=1, s_steps=1, q_prompts=2,
                        q_group=2, s_prompts=2, s_group=2, max_anchors=2, m_per_anchor=2, band=(0.25, 1.0))
    test = D.ArithGen().heldout(20)
    a, st = DE.run_d2evo(cfg, policy, test=test, eval_samples=1, return_state=True)
    b = DE.run_d2evo(cfg, policy, test=test, eval_samples=1)
    assert a.drop(columns="wall_s").equals(b.drop(columns="wall_s"))
    assert a.solver_steps.iloc[-1] == 1 and a.leaks.sum() == 0
    assert all(p.prompt not in {t.prompt for t in test} for p in st.buffer)
    rates = a.anchor_rates.iloc[0] if "anchor_rates" in a else []
    assert all(a.band_low.iloc[0] - 1e-9 <= r <= a.band_high.iloc[0] + 1e-9 for r in rates)


def test_sampler_compiled_matches_eager_and_softmax():
    gk = torch.Generator().manual_seed(1)
    V = len(D.ALPHABET) + 3
    logits = torch.randn(256, V, generator=gk) * 2
    noise = gumbel_noise((256, V), gk)
    for tp in (1.0, 0.7):
        assert torch.equal(sample_next(logits, 0.8, tp, noise), sample_next(logits, 0.8, tp, noise, compiled=False))
        assert compiled_ran(sample_next_compiled)
    n = 100_000
    draws = sample_next(logits[:1].expand(n, V).contiguous(), 1.0, 1.0, gumbel_noise((n, V), gk))
    freq = np.bincount(draws.numpy(), minlength=V) / n
    p = torch.softmax(logits[0], -1).numpy()
    assert np.abs(freq - p).max() < 5 * np.sqrt(p.max() / n) + 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_safe_on_cuda():
    x = torch.tensor([0.1, 0.5, 0.95], device="cuda")
    r = D.plateau_reward(x, 0.4, 0.8)
    assert r.device.type == "cuda" and r.cpu().tolist() == pytest.approx(D.plateau_reward(x.cpu(), 0.4, 0.8).tolist())
    pol = scripted_policy(D.ALPHABET, {"=": "7"}, strength=50.0)
    pol.model.to("cuda")
    rates = D.pass_rates(pol, ["3+4", "2+2"], ["7", "4"], 4, seed=0)
    assert rates.tolist() == [1.0, 0.0]
