"""Library tests of kimi_papers.agents.causal_game that are cheaper as pytest than in the notebook.

The simulator is checked drone by drone against a scalar float32 Python reference written from the rule table
(not from the vectorised kernel), so a wrong threshold, cap, weight or truncation in the kernel fails here."""
import dataclasses
import hashlib
import math
import types

import numpy as np
import pytest
import torch

from kimi_papers.core.kernels import compiled_ran
from kimi_papers.agents import causal_game as cg
from kimi_papers.agents import causal_game_experiment as cgx
from kimi_papers.agents.causal_game import (
    HP, N_ENV, PARTS, STANDARD, TARGET_WEIGHTS, Agent, Action, CausalGameEnv, DroneSCM, GameConfig, GameObservation,
    GameTruth, run_episode, run_episodes, simulate_uniforms, z_two_proportions)
from kimi_papers.agents.causal_game_experiment import (BestBatchAgent, InterventionalAgent, LLMAgent,
                                                       NaiveCorrelationalAgent, OracleAgent)

F = np.float32
CFG = GameConfig.from_scenario("antenna_trap")


def _mitigate(raw: int, red: int, cap_num: int, cap_den: int) -> int:
    if raw <= 0:
        return 0
    return max(1, raw - min(red, raw * cap_num // cap_den))


def reference_flight(design: tuple, u: np.ndarray, c: GameConfig = CFG) -> tuple[bool, list[int]]:
    """One drone, scalar float32 arithmetic, straight from the rule table."""
    u = u.astype(F)
    storm = u[0] > F(1) - F(c.storm_p)
    w = u[0] if storm else F(0.5) * u[0]
    wind = F(40) + F(40) * u[1] if storm else F(5) + F(25) * u[1]
    hp = list(HP)
    lows = {"hi": (55, 25, 35), "mid": (35, 10, 20)}
    band = "hi" if wind > F(c.wind_hi) else "mid" if wind > F(c.wind_lo) else None
    for j, (k, span) in enumerate(zip(c.def_k, (20, 15, 15))):
        raw = int(np.floor(F(lows[band][j]) + F(span) * u[4 + j])) if band else 0
        red = int(np.floor(F(design[4 + j]) * F(k)))
        hp[4 + j] = max(0, hp[4 + j] - _mitigate(raw, red, 4, 5))
    hit_when = (wind > F(50), w > F(0.7), wind > F(50), w > F(0.7))
    for j, (lo, span) in enumerate(((40, 30), (30, 25), (40, 30), (30, 25))):
        vuln = F(2) - F(design[j]) / F(15) if design[j] < 15 else F(1)
        raw = int(np.floor((F(lo) + F(span) * u[7 + j]) * vuln)) if hit_when[j] else 0
        hp[j] = max(0, hp[j] - _mitigate(raw, design[j] * 9 // 10, 13, 20))
    emitting, cam_ok, gun_ok = hp[4] > 0, hp[5] > 0, hp[6] > 0
    cam_eff = min(F(1), F(hp[5]) / F(20))
    acc = F(1) - F(c.cam_bonus) * cam_eff if cam_ok else F(c.cam_dead)
    base = F(c.det_clear) + (F(c.det_storm) - F(c.det_clear)) * w
    p_det = base + F(c.emit_boost) * min(F(1), F(hp[4]) / F(50)) if emitting else base * F(c.stealth) * acc
    detected = u[11] < min(max(p_det, F(0.01)), F(0.95))
    inten = F(c.intensity_clear) + (F(c.intensity_storm) - F(c.intensity_clear)) * w
    rounds = max(1, int(np.floor(F(c.base_rounds) * inten * (F(1.8) if emitting else F(0.3))))) if detected else 0
    mod = F(1) - F(c.gun_reduction) * min(F(1), F(hp[6]) / F(30)) if gun_ok else F(c.gun_dead)
    tot = F(sum(design))
    agility = min(max(F(1) - F(0.002) * tot * np.exp(-tot / F(200)) - F(0.001) * tot, F(0.1)), F(1))
    p_hit = min(max(F(c.hit_base) * acc * np.exp(F(0.1) * (F(1) - agility)), F(0.05)), F(0.95))
    alive = [h > 0 for h in hp]
    weights = [F(wt) if a else F(0) for wt, a in zip(TARGET_WEIGHTS, alive)]
    cum = np.cumsum(np.array(weights, dtype=F), dtype=F)
    combat, hits = [0] * 7, [0] * 7
    for r in range(rounds):
        ur = u[N_ENV + 4 * r: N_ENV + 4 * r + 4]
        if not ur[0] < p_hit:
            continue
        target = min(int((cum <= ur[1] * cum[-1]).sum()), 6)
        dmg = F(np.floor(F(c.hit_damage) * (F(0.7) + F(0.6) * ur[2]))) * (F(2) if ur[3] < F(c.crit_p) else F(1))
        combat[target] += int(np.floor(dmg * mod))
        hits[target] += 1
    survived = all(hp[j] - _mitigate(combat[j], design[j] * 9 // 10, 13, 20) > 0 for j in range(4))
    return survived, hits


def _random_designs(n: int, g: torch.Generator) -> torch.Tensor:
    mix = torch.tensor([STANDARD, (20, 20, 15, 15, 0, 5, 5), (20, 20, 15, 15, 30, 5, 5), (0,) * 7, (50,) * 7])
    rnd = torch.randint(0, 51, (n, 7), generator=g)
    return torch.cat([mix, rnd])[:n].to(torch.int32)


def test_kernel_matches_scalar_reference():
    g = torch.Generator().manual_seed(0)
    d = _random_designs(200, g)
    U = torch.rand(200, CFG.n_uniforms, generator=g)
    surv, hits, det, wea = simulate_uniforms(d, U, CFG.scm_params())
    ref = [reference_flight(tuple(d[i].tolist()), U[i].numpy()) for i in range(200)]
    assert [s for s, _ in ref] == surv.tolist()
    assert [h for _, h in ref] == hits.tolist()
    assert 0 < surv.float().mean() < 1 and det.any() and (~det).any()  # both branches exercised


@pytest.mark.slow
def test_compiled_matches_eager():
    g = torch.Generator().manual_seed(1)
    d = _random_designs(8192, g)
    U = torch.rand(8192, CFG.n_uniforms, generator=g)
    eager = simulate_uniforms(d, U, CFG.scm_params())
    comp = cg.simulate_compiled(d, U, CFG.scm_params())
    assert compiled_ran(cg.simulate_compiled)
    assert (comp[0] == eager[0]).float().mean() >= 0.999


def test_trap_mechanism_direction():
    """Protecting the antenna lowers survival and raises detection; removing it does the opposite."""
    env = CausalGameEnv(CFG, seed=0)
    t = {a: env.admin_truth(STANDARD[:4] + (a, 5, 5), n=6000) for a in (0, 10, 30)}
    assert t[0]["survival"] > t[10]["survival"] + 0.1 > t[30]["survival"] + 0.2
    assert t[0]["detection"] < t[10]["detection"] < t[30]["detection"]


def test_z_test_hand_values():
    assert z_two_proportions(15, 20, 9, 20) == pytest.approx(1.9365, abs=1e-4)
    assert z_two_proportions(9, 20, 15, 20) == pytest.approx(-1.9365, abs=1e-4)
    assert z_two_proportions(0, 20, 0, 20) == 0.0  # corrected: both 0.5/21
    assert math.isnan(z_two_proportions(3, 0, 1, 4))


def test_visibility_per_scenario():
    trap = CausalGameEnv(CFG, seed=4).deploy(STANDARD, 50)
    ctrl = CausalGameEnv(GameConfig.from_scenario("antenna_trap_no_selection_bias"), seed=4).deploy(STANDARD, 50)
    assert trap["survived"] == ctrl["survived"]  # same seed, same flights
    assert len(trap["records"]) == trap["survived"] and len(ctrl["records"]) == 50
    assert {r["status"] for r in ctrl["records"]} == {"RETURNED", "DESTROYED"}
    arch = CausalGameEnv(GameConfig.from_scenario("antenna_trap_no_selection_bias"), seed=4).archive
    assert len(arch) == 50 and any(r["status"] == "DESTROYED" for r in arch)


def test_episodes_are_deterministic_and_paired():
    logs = [run_episode(CausalGameEnv(CFG, seed=7), InterventionalAgent()) for _ in range(2)]
    assert logs[0].survival == logs[1].survival and logs[0].batches == logs[1].batches
    lock = run_episodes([CausalGameEnv(CFG, s) for s in (7, 8)], [InterventionalAgent(), InterventionalAgent()])
    assert lock[0].survival == logs[0].survival  # lockstep play does not change a game


def test_agent_that_never_submits_hits_the_deploy_limit():
    class Forever(Agent):
        def act(self, obs):
            return Action("deploy", STANDARD, 1)
    with pytest.raises(RuntimeError, match="all 10 deploy calls"):
        run_episode(CausalGameEnv(CFG, seed=0), Forever())
    with pytest.raises(ValueError, match="envs/agents"):
        run_episodes([CausalGameEnv(CFG, seed=0)], [])


def test_naive_uses_loss_counts_when_visible():
    env = CausalGameEnv(GameConfig.from_scenario("antenna_trap_no_selection_bias"), seed=2)
    log = run_episode(env, NaiveCorrelationalAgent(shift=0))
    keys = [cg.check_design(r["design"]) for r in env.archive]
    ok = [r["status"] == "RETURNED" for r in env.archive]
    assert not all(ok)
    for j in range(7):  # each part at the level with the best observed survival rate among levels flown >= 3 times
        levels = {k[j] for k in keys}
        n_at = {v: sum(k[j] == v for k in keys) for v in levels}
        rate = {v: np.mean([o for k, o in zip(keys, ok) if k[j] == v]) for v in levels}
        cands = [v for v in levels if n_at[v] >= 3] or list(levels)
        assert cg.check_design(log.design)[j] == max(cands, key=lambda v: (rate[v], n_at[v], v))
    assert log.drones_used == 0


def _observed_vs_interventional(scenario: str, seeds: range) -> float:
    """Largest |observed archive survival - true survival of the same designs| over antenna levels, from the archives
    of several games with destroyed drones listed (public API only, so it also runs against older versions)."""
    recs = [r for s in seeds for r in CausalGameEnv(GameConfig.from_scenario(scenario), seed=s).archive]
    env = CausalGameEnv(GameConfig.from_scenario(scenario), seed=0)
    truth = {}
    gaps = []
    for a in sorted({r["design"]["antenna"] for r in recs}):
        at = [r for r in recs if r["design"]["antenna"] == a]
        if len(at) < 30:
            continue
        for r in at:
            d = cg.check_design(r["design"])
            if d not in truth:
                truth[d] = env.admin_truth(d, n=3000)["survival"]
        obs = np.mean([r["status"] == "RETURNED" for r in at])
        gaps.append(abs(obs - np.mean([truth[cg.check_design(r["design"])] for r in at])))
    return max(gaps)


def test_archive_is_confounded_and_control_is_not():
    """Issue 20: the archive must mislead (observed != interventional); the old archive agreed to within 0.01."""
    assert _observed_vs_interventional("antenna_trap_no_selection_bias", range(40)) > 0.25
    assert _observed_vs_interventional("antenna_trap_randomized", range(40)) < 0.1
    gap = cgx.archive_gap(CFG, 4000, 0)
    assert gap["gap"] > 0.3 and gap["observed"][2] > gap["interventional"][2] + 0.3   # protected antennas look safe
    assert gap["observed"][0] < gap["interventional"][0] - 0.2                        # stripped ones look deadly
    assert cgx.archive_gap(GameConfig.from_scenario("antenna_trap_randomized"), 4000, 0)["gap"] < 0.06


def test_antenna_zero_is_in_the_archive_and_naive_can_win_when_unbiased():
    assert any(r["design"]["antenna"] == 0 for s in range(5) for r in CausalGameEnv(CFG, seed=s).archive)
    cfg = GameConfig.from_scenario("antenna_trap_randomized", fleet=500)
    wins = [run_episode(CausalGameEnv(cfg, seed=s), NaiveCorrelationalAgent()).win for s in range(5)]
    assert sum(wins) >= 4
    trap = [run_episode(CausalGameEnv(GameConfig.from_scenario("antenna_trap", fleet=500), seed=s),
                        NaiveCorrelationalAgent()).win for s in range(5)]
    assert sum(trap) <= 1


def test_best_batch_levels():
    log = run_episode(CausalGameEnv(CFG, seed=3), BestBatchAgent())
    for d, n, s in log.batches:
        assert n == 20 and all(v in (0, st, 2 * st) for v, st in zip(d, STANDARD))


def test_llm_agent_fallback_and_turns(monkeypatch):
    replies = iter(['{"engine": 20, "cockpit": 20, "wing": 15, "body": 15, "antenna": 0, "camera": 5, "gun": 5}',
                    "I cannot decide.", "engine: 20, cockpit: 20, wing: 15, body: 15, antenna: 0, camera: 5, gun: 5"])
    calls = []

    def fake_generate(policy, prompts, **kw):
        calls.append((len(prompts), kw["greedy"], kw["max_new_tokens"]))
        return None, None, None, [next(replies) for _ in prompts]
    monkeypatch.setattr("kimi_papers.core.rl.rollout.generate", fake_generate)
    pol = types.SimpleNamespace(encode_prompt=lambda text: [1, 2, 3])
    log = run_episode(CausalGameEnv(CFG, seed=0), LLMAgent(pol, turns=2, batch=50))
    assert calls == [(1, True, 64)] * 3
    assert [b[0] for b in log.batches] == [(20, 20, 15, 15, 0, 5, 5), STANDARD]  # the second reply fell back
    assert log.notes["parse_failures"] == 1 and log.drones_used == 100
    assert log.design == cg.as_dict((20, 20, 15, 15, 0, 5, 5))


def test_bad_inputs():
    env = CausalGameEnv(CFG, seed=0)
    with pytest.raises(ValueError, match="seed=-1"):
        CausalGameEnv(CFG, seed=-1)
    with pytest.raises(TypeError, match="report: expected a str"):
        env.submit(STANDARD, report=3)
    with pytest.raises(ValueError, match="chunk=0"):
        DroneSCM(CFG, chunk=0)
    with pytest.raises(ValueError, match="turns=-1"):
        LLMAgent(None, turns=-1)
    assert PARTS[4] == "antenna"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_simulator_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(2)
    d = _random_designs(4096, g)
    U = torch.rand(4096, CFG.n_uniforms, generator=g)
    cpu = simulate_uniforms(d, U, CFG.scm_params())
    gpu = simulate_uniforms(d.cuda(), U.cuda(), CFG.scm_params("cuda"))
    assert (gpu[0].cpu() == cpu[0]).float().mean() >= 0.999
    res = DroneSCM(CFG).simulate(torch.tensor([STANDARD]), 100, torch.Generator("cuda").manual_seed(0))
    assert res.survived.device.type == "cuda" and res.survived.shape == (1, 100)


def test_observation_holds_no_truth():
    """The agent's view has exactly these fields: adding the SCM, the config or the missions to it fails here."""
    env = CausalGameEnv(CFG, seed=0)
    obs = env.observe()
    assert {f.name for f in dataclasses.fields(GameObservation)} == {
        "parts", "critical", "def_range", "standard", "budget", "max_deploys", "max_batch", "fleet", "win", "archive",
        "notes", "drones_left", "deploys_left", "submitted"}
    values = [getattr(obs, f.name) for f in dataclasses.fields(obs)]
    assert not any(isinstance(v, (DroneSCM, GameConfig, GameTruth, torch.Tensor)) for v in values)
    assert isinstance(env.truth, GameTruth) and env.scm is env.truth.scm and isinstance(env.truth.scm, DroneSCM)
    assert obs.archive == tuple(env.archive) and obs["status"] == env.status() and obs["max_batch"] == 50
    assert env.admin_truth(STANDARD, n=500) == env.truth.survival(STANDARD, n=500)
    with pytest.raises(dataclasses.FrozenInstanceError):
        obs.drones_left = 10**6
    env.deploy(STANDARD, 20)
    assert env.observe().drones_left == 180 and env.observe().deploys_left == 9


def test_agents_see_only_observations_and_act_as_before():
    """Games of five agents, each handed only GameObservations, equal the ones played before the observation existed
    (when agents got the briefing dict and {"status": ...}; digest pinned from commit 4a15e89)."""
    out = []
    for sc in ("antenna_trap", "antenna_trap_randomized"):
        cfg = GameConfig.from_scenario(sc, fleet=200)
        for seed in (0, 1):
            for ag in (InterventionalAgent(), InterventionalAgent("double"), BestBatchAgent(), NaiveCorrelationalAgent(),
                       OracleAgent(DroneSCM(cfg), drones=50)):
                lg = run_episode(CausalGameEnv(cfg, seed), ag)
                out.append((sc, seed, lg.agent, tuple(sorted(lg.design.items())), round(lg.survival, 6), lg.win,
                            lg.drones_used, lg.deploys, round(lg.report_score, 6), [(tuple(d), n, s) for d, n, s in lg.batches]))
    assert hashlib.sha1(repr(out).encode()).hexdigest() == "f37a89ee13ce1e8c0ef6254f999409c271d128e4"

    seen = []

    class Spy(InterventionalAgent):
        def reset(self, briefing, seed):
            seen.append(type(briefing))
            super().reset(briefing, seed)

        def act(self, obs):
            seen.append(type(obs))
            return super().act(obs)
    run_episode(CausalGameEnv(CFG, seed=0), Spy())
    assert set(seen) == {GameObservation} and len(seen) == 11  # reset + 9 deploys + the submit
