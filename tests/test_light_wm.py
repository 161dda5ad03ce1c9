"""kimi_papers.agents.light_wm as a library: the MiniALF grammar and step limit by hand, the oracle on every family,
the update rules on hand-written observations, schema induction, the memory's effective set and budget, the candidate
scorer against a full-sequence reference, the noisy actor's reading model, the baselines' budgets and bad input."""
import numpy as np
import pytest
import torch

from kimi_papers.agents.light_wm import (
    FAMILIES, MAX_STEPS, OBJECTS, SPLITS, ActionScorer, ExpertPlanner, HierMemory, LightWMAgent, MiniALFEnv,
    OracleAgent, ReActAgent, Schema, SummaryMemoryAgent, abstract_action,
    apply_rules, candidate_logp, candidate_logp_eager, count_tokens, evaluate, induce_schema, lines_to_slots, new_slots,
    parse_goal, run_episode, see_list, slots_to_lines)
from kimi_papers.agents.light_wm_experiment import (
    NoisyScriptedPolicy, RandomPolicy, build_schemas, noisy_arms, per_seed, receptacle_prior, run_grid)
from kimi_papers.core.models import CharTokenizer, tiny_causal_lm


@pytest.fixture(scope="module")
def schemas():
    return build_schemas(5)


def test_grammar_and_admissible():
    env = MiniALFEnv("pick_two", 0, "unseen")
    txt, info = env.reset()
    assert txt.startswith("You are in the middle of a room.") and info["goal"] == "put two vase in cabinet 1."
    assert parse_goal(info["goal"]) == {"family": "pick_two", "target": "vase", "dest": "cabinet 1"}
    assert see_list([]) == "nothing" and see_list(["a 1", "b 2"]) == "a a 1, and a b 2"
    assert env.act("open cabinet 1").text == "Nothing happens." and env.score() == {"success": False, "steps": 1, "invalid": 1}
    o = env.act("go to cabinet 1")
    assert o.text == "You arrive at cabinet 1. The cabinet 1 is closed." and "open cabinet 1" in o.admissible
    assert "take vase 1 from cabinet 1" not in o.admissible  # closed: nothing to take
    assert env.act("open cabinet 1").text.endswith("In it, you see nothing.")
    assert list(env.observe().admissible) == sorted(env.observe().admissible)


def test_step_limit_is_a_failure():
    env = MiniALFEnv("heat", 3, "unseen", max_steps=4)
    n = 0
    while not env.done:
        env.act("look")
        n += 1
    assert n == 4 and env.score() == {"success": False, "steps": 4, "invalid": 0}
    with pytest.raises(RuntimeError, match="over"):
        env.act("look")


def test_oracle_solves_every_family_and_split():
    for f in FAMILIES:
        for sp in SPLITS:
            for s in range(4):
                env = MiniALFEnv(f, s, sp)
                trace = ExpertPlanner(env).trace()
                assert env.score()["success"] and len(trace) <= 12, (f, sp, s)
    assert not set(OBJECTS["seen"]) & set(OBJECTS["unseen"])
    assert MiniALFEnv("clean", 4).truth.loc == MiniALFEnv("clean", 4).truth.loc


def test_rules_by_hand():
    s = new_slots()
    assert apply_rules(s, "You arrive at cabinet 3. The cabinet 3 is closed.") == 2 and s["closed"] == {"cabinet 3": True}
    apply_rules(s, "You open the cabinet 3. The cabinet 3 is open. In it, you see a mug 1, a apple 2, and a desklamp 1.")
    assert s["seen"] == {"mug 1": "cabinet 3", "apple 2": "cabinet 3"} and s["lamp_at"] == "cabinet 3"
    apply_rules(s, "You pick up the mug 1 from the cabinet 3.")
    assert s["holding"] == "mug 1" and "mug 1" not in s["seen"]
    apply_rules(s, "You cool the mug 1 using the fridge 1.")
    apply_rules(s, "You put the mug 1 in/on the shelf 1.", dest="shelf 1")
    assert s["state"] == {"mug 1": ["cool"]} and s["placed"] == ["mug 1"] and s["holding"] is None
    apply_rules(s, "You put the mug 1 in/on the shelf 1.", dest="shelf 1")
    assert s["placed"] == ["mug 1"]  # placing the same object twice counts once
    assert apply_rules(s, "Nothing happens.") == 0
    apply_rules(s, "You arrive at cabinet 3. The cabinet 3 is open. In it, you see nothing.")
    assert "apple 2" not in s["seen"]
    assert lines_to_slots("\n".join(slots_to_lines(s))) == s
    assert count_tokens("go to cabinet 12.") == 6


def test_induced_schemas(schemas):
    verbs = {f: [sg.terminal.split()[0] for sg in schemas[f].subgoals] for f in FAMILIES}
    assert verbs == {"pick_and_place": ["take", "put"], "pick_two": ["take", "put", "take", "put"],
                     "clean": ["take", "clean", "put"], "heat": ["take", "heat", "put"], "cool": ["take", "cool", "put"],
                     "look_at_obj_in_light": ["take", "use"]}
    assert "go to {appliance}" in schemas["heat"].subgoals[1].templates and "apply" in schemas["heat"].rules
    assert Schema.from_json(schemas["clean"].to_json()) == schemas["clean"]
    assert abstract_action("take mug 2 from cabinet 1", {"dest": "shelf 1", "target_kind": "mug"}) == "take {target} from {r}"
    with pytest.raises(ValueError, match="traces"):
        induce_schema([], "clean")


def test_memory_effective_set_and_regress(schemas):
    m = HierMemory(schemas["pick_and_place"], "put a mug in shelf 1.")
    m.update("You arrive at drawer 2. On the drawer 2, you see a mug 1.")
    adm = ("go to cabinet 1", "go to shelf 1", "inventory", "look", "take mug 1 from drawer 2")
    assert m.effective_actions(adm) == ["take mug 1 from drawer 2"]
    m.update("You pick up the mug 1 from the drawer 2.")
    assert m.active == 1 and m.effective_actions(adm) == ["go to shelf 1"]
    m.update("You put the mug 1 in/on the cabinet 1.")
    assert m.active == 0 and m.effective_actions(("go to cabinet 1", "look")) == ["go to cabinet 1"]
    assert m.effective_actions(("look",)) == ["look"] and m.fallbacks == 1
    m2 = HierMemory(schemas["pick_two"], "put two mug in shelf 1.")
    for o in ("You pick up the mug 1 from the drawer 2.", "You put the mug 1 in/on the shelf 1."):
        m2.update(o)
    assert m2.active == 2  # one of two placed: the second take is active
    with pytest.raises(ValueError, match="schema"):
        HierMemory(schemas["clean"], "put a mug in shelf 1.")


def test_prompt_budget_drops_oldest_facts(schemas):
    m = HierMemory(schemas["pick_and_place"], "put a mug in shelf 1.")
    for i in range(8):
        m.update(f"You arrive at cabinet {i + 2}. On the cabinet {i + 2}, you see a apple {i + 1}.")
    n = count_tokens(m.render_prompt(10**6))
    p = m.render_prompt(n - 1)
    assert count_tokens(p) <= n - 1 and "apple 1@" not in p and "apple 8@" in p and "Subgoal:" in p


def test_kernel_matches_reference():
    g = torch.Generator().manual_seed(0)
    h, W = torch.randn(7, 5, 16, generator=g), torch.randn(300, 16, generator=g)
    t = torch.randint(0, 300, (7, 5), generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([[1], [2], [3], [4], [5], [5], [2]])).float()
    ref = torch.stack([torch.log_softmax(h[c].double() @ W.double().T, -1)[torch.arange(5), t[c]][: int(mask[c].sum())].mean()
                       for c in range(7)])
    for out in (candidate_logp(h, W, t, mask, compiled=False), candidate_logp_eager(h, W, t, mask)):
        assert torch.allclose(out.double(), ref, atol=1e-5)
    with pytest.raises(ValueError, match="h/targets/mask"):
        candidate_logp(h, W, t[:, :2], mask)


def test_scorer_equals_full_sequence_reference():
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz0123456789 ./:;>\n")
    lm = tiny_causal_lm(tok.vocab_size, 32, 1, 2, 1024, tokenizer=tok, seed=1)
    sc = ActionScorer(lm, tok, max_cand_tokens=16)
    prompt, cands = "task: go to shelf 1\nnext:", ["go to shelf 1", "look", "go to shelf 1"]
    a, lp = sc.score(prompt, cands)
    ref = []
    with torch.no_grad():
        for c in cands:
            ids = torch.tensor([tok.encode(prompt) + tok.encode(c)])
            lps = torch.log_softmax(lm(ids).logits[0, :-1].float(), -1)
            n = len(tok.encode(c))
            ref.append(lps[-n:].gather(-1, ids[0, -n:, None]).mean().item())
    assert torch.allclose(lp, torch.tensor(ref), atol=1e-5) and a == cands[int(np.argmax(ref))]
    assert lp[0] == lp[2]
    with pytest.raises(ValueError, match="candidates"):
        sc.score(prompt, [])


def test_noisy_actor_reading_model():
    ctx = ("Task: put a mug in shelf 1.\n> go to drawer 2\nYou arrive at drawer 2. On the drawer 2, you see a mug 1.\n"
           "> go to cabinet 1\nYou arrive at cabinet 1. On the cabinet 1, you see nothing.\n"
           "Observation: You arrive at shelf 1. On the shelf 1, you see nothing.")
    c = ["go to cabinet 1", "go to drawer 2", "look"]
    assert NoisyScriptedPolicy(0.0).choose(ctx, c) == "go to drawer 2"
    assert NoisyScriptedPolicy(1.0).choose(ctx, c) == "go to cabinet 1"
    assert NoisyScriptedPolicy(1.0).choose(ctx + "\nMemory: seen=mug 1@drawer 2", c) == "go to drawer 2"
    with pytest.raises(ValueError, match="p_forget"):
        NoisyScriptedPolicy(-0.1)
    with pytest.raises(ValueError, match="candidates"):
        RandomPolicy().choose("x", [])


def test_agents_end_to_end(schemas):
    env = MiniALFEnv("clean", 2, "unseen")
    assert run_episode(env, OracleAgent())["success"]
    r = run_episode(env, LightWMAgent(NoisyScriptedPolicy(0.0), schemas))
    assert r["success"] and r["steps"] <= MAX_STEPS and 0 < r["single_share"] <= 1
    ag = ReActAgent(RandomPolicy(0), 200)
    r = run_episode(MiniALFEnv("pick_and_place", 1), ag)
    assert r["steps"] == MAX_STEPS and not r["success"] and max(ag.tokens) <= 200
    sm = SummaryMemoryAgent(NoisyScriptedPolicy(0.0), lambda goal, pairs: f"{len(pairs)} steps", chunk=3)
    run_episode(MiniALFEnv("heat", 1), sm)
    assert sm.summaries and all(s == "3 steps" for s in sm.summaries)
    with pytest.raises(KeyError, match="available"):
        LightWMAgent(RandomPolicy(), {"clean": schemas["clean"]}).reset(MiniALFEnv("heat", 0).observe())
    with pytest.raises(ValueError, match="family"):
        MiniALFEnv("juggle", 0)
    with pytest.raises(ValueError, match="split"):
        MiniALFEnv("clean", 0, "valid")


def test_grid_is_deterministic(schemas):
    prior = receptacle_prior(5)
    arms = {k: v for k, v in noisy_arms(0.3, schemas, prior).items() if k in ("lightwm", "react")}
    a, b = (run_grid(arms, [0, 1], 6, schemas=schemas) for _ in range(2))
    assert a.equals(b) and set(a.arm) == {"lightwm", "react"} and len(per_seed(a, "lightwm")) == 2
    df = evaluate(OracleAgent, n=6, schemas=schemas)
    assert df.success.all() and (df.subgoal_rate == 1.0).all()
