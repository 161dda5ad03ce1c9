"""kimi_papers.integrations.trl: PMD-mean, OTB and the Entropy-Discrepancy schedule inside TRL's GRPOTrainer.

The pure helpers are tested always; the trainer tests need the optional extra (pip install 'kimi_papers[trl]')
and are skipped, with that reason, without it. Each trainer runs two real GRPOTrainer steps on a tiny random
Llama offline, and on one fixed batch its loss equals the paper module's own loss (and differs from the same loss
with TRL's GRPO advantage)."""
import importlib.util
import math
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import kimi_papers.integrations.trl as kt  # noqa: E402  (must import without TRL)
from kimi_papers.core.models import CharTokenizer, tiny_causal_lm  # noqa: E402
from kimi_papers.core.rl import aggregate, ppo_clip_loss  # noqa: E402
from kimi_papers.rl.optimal_token_baseline import (otb_advantages, otb_advantages_reference,  # noqa: E402
                                                   outcome_token_rewards, sum_pi_squared)
from kimi_papers.rl.pmd_mean import pmd_advantages, pmd_loss, pmd_seq_terms  # noqa: E402

HAVE_TRL = importlib.util.find_spec("trl") is not None
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="TRL is an optional extra: pip install 'kimi_papers[trl]'")
ALPHABET = "0123456789+="
CTOK = CharTokenizer(ALPHABET)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs a CUDA GPU")])]


# ---- without TRL -----------------------------------------------------------------------------------------------
def test_missing_trl_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # what `import trl` sees when it is not installed
    monkeypatch.setattr(kt, "_TRAINERS", {})
    with pytest.raises(ImportError, match=r"pip install 'kimi_papers\[trl\]'"):
        kt.PMDGRPOTrainer
    with pytest.raises(ImportError, match=r"kimi_papers\[trl\]"):
        kt.trainer_classes()
    with pytest.raises(AttributeError):
        kt.NoSuchTrainer


def test_group_layout_and_rewards():
    r = torch.tensor([1.0, math.nan, 0.0, 2.0])
    assert kt.trl_group_uids(r, 2).tolist() == [0, -2, 1, 1]
    with pytest.raises(ValueError, match="num_generations"):
        kt.trl_group_uids(r, 3)
    table = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [0.5, 2.0]])
    got = kt.trl_rewards(table, torch.tensor([2.0, 1.0]))
    assert got[0] == 2.0 and math.isnan(got[1]) and got[2] == 3.0
    with pytest.raises(ValueError, match="weights"):
        kt.trl_rewards(table, torch.tensor([1.0]))


def test_pmd_advantages_hand_case():
    a = kt.pmd_trl_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, math.nan, 1.0, 2.0]), 4, tau=0.01)
    # group 2 without its unscorable row: 3 - 1.5, 1 - 2.5, 2 - 2
    assert torch.allclose(a, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, 0.0, -1.5, 0.0]), atol=1e-6), a
    with pytest.raises(ValueError, match="tau"):
        kt.pmd_trl_advantages(torch.tensor([1.0, 0.0]), 2, tau=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_otb_advantages_match_loop_reference(device):
    g = torch.Generator().manual_seed(3)
    rows, T, V = 12, 10, 13
    lengths = torch.randint(1, T + 1, (rows,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    logits = torch.randn(rows, T, V, generator=g, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (rows, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0] * mask
    s2 = sum_pi_squared(logits)
    rew = torch.randint(0, 2, (rows,), generator=g).double()
    got = kt.otb_trl_advantages(*(x.to(device) for x in (rew, mask, lp, s2.log())), 4)
    ref, _ = otb_advantages_reference(outcome_token_rewards(rew, mask), mask, (torch.arange(rows) // 4).tolist(), lp, s2)
    assert got.device.type == device and (got.cpu().double() - ref).abs().max() < 1e-6


# ---- with TRL -------------------------------------------------------------------------------------------------
def digit_share(completions, **_):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def make_trainer(name, device="cpu", **kw):
    """A trainer (class name or class) on a tiny random Llama, 8 rows = 2 prompts x G = 4 per step."""
    from datasets import Dataset
    from trl import GRPOConfig
    cfg = dict(output_dir="/tmp/kimi_papers_test_trl", use_cpu=device == "cpu", report_to=[], save_strategy="no",
               beta=0.0, bf16=False, max_steps=2, per_device_train_batch_size=8, num_generations=4,
               max_completion_length=8, learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True,
               log_level="warning")
    cfg.update(kw.pop("args", {}))
    model = tiny_causal_lm(CTOK.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=64, seed=0, tokenizer=CTOK)
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]]})
    cls = getattr(kt, name) if isinstance(name, str) else name
    return cls(model=model.to(device), reward_funcs=digit_share, args=GRPOConfig(**cfg),
                             train_dataset=data, processing_class=kt.hf_char_tokenizer(ALPHABET), **kw)


def plain_token_stats(model, batch):
    """Sampled-token log-prob and Σπ² from the model's ordinary forward (full logits), [rows, T] float64."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    P, T = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits[:, P - 1:P - 1 + T].double()
    lp = torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    return lp * batch["completion_mask"], sum_pi_squared(logits)


@needs_trl
def test_char_tokenizer_matches_core_ids():
    tok = kt.hf_char_tokenizer(ALPHABET)
    assert tok("12+3=").input_ids == CTOK.encode("12+3=") and tok.decode(CTOK.encode("9=1")) == "9=1"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)


@needs_trl
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["PMDGRPOTrainer", "OTBGRPOTrainer"])
def test_two_steps_train_on_the_paper_advantage(name, device):
    """Two GRPOTrainer steps; after each generation batch the advantages TRL trains on equal an independent recomputation."""
    gaps, last = [], []
    base = getattr(kt, name)

    class Checked(base):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            r = kt.trl_rewards(self._kp_rewards_per_func, self.reward_weights).double()
            uid = torch.arange(len(r), device=r.device) // self.num_generations
            if name == "PMDGRPOTrainer":
                ref = pmd_advantages(r, uid, self.pmd_tau)
            else:
                lp, s2 = plain_token_stats(self.model, out)
                m = out["completion_mask"].double()
                ref, _ = otb_advantages(outcome_token_rewards(r, m), m, uid, lp, s2)
            gaps.append(float((out["advantages"].double() - ref).abs().max()))
            a, m = out["advantages"].double(), out["completion_mask"].double()
            last[:] = [a if a.ndim == 1 else (a * m).sum(-1) / m.sum(-1).clamp(min=1)]
            return out

    tr = make_trainer(Checked, device)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert tr.state.global_step == 2 and len(losses) == 2 and all(map(math.isfinite, losses))
    assert len(gaps) == 2 and max(gaps) < 1e-5, gaps
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters())), "no parameter moved"
    logged = torch.tensor(list(tr._logs["advantages"]), dtype=torch.float64)  # TRL's completion log: the last batch
    assert torch.allclose(logged, last[0].cpu(), atol=1e-6), (logged, last[0])


def fixed_batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    B, P, T = 8, 4, 7
    prompt_ids = torch.randint(3, CTOK.vocab_size, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[::3, 0], prompt_ids[::3, 0] = 0, 0
    cmask = (torch.arange(T)[None] < torch.tensor([7, 3, 5, 2, 6, 6, 1, 4])[:, None]).long()
    cids = torch.randint(3, CTOK.vocab_size, (B, T), generator=g) * cmask
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=cids, completion_mask=cmask,
                 num_items_in_batch=cmask.sum())
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0], [1.0], [1.0], [0.0], [0.5]])
    return {k: v.to(device) for k, v in batch.items()}, rewards.to(device)


def grpo_advantage(r, G=4):
    g = r.view(-1, G)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).flatten()


@needs_trl
@pytest.mark.parametrize("name,kw", [("PMDGRPOTrainer", dict(tau=0.01)), ("PMDGRPOTrainer", dict(tau=0.3)),
                                     ("OTBGRPOTrainer", {}), ("OTBGRPOTrainer", dict(zero_tail=False))])
def test_same_batch_same_loss_as_the_paper(name, kw):
    tr = make_trainer(name, **kw)
    tr.model.eval()  # no gradient-accumulation scaling
    batch, rpf = fixed_batch()
    lp, s2 = plain_token_stats(tr.model, batch)
    m = batch["completion_mask"].double()
    noise = 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    old = (lp + noise).clamp(max=0) * m  # stale old log-probs: Δ != 0 and TRL's clip is active
    inputs = tr.apply_paper_advantages(dict(batch, old_per_token_logps=old.float()), rpf)
    loss = tr.compute_loss(tr.model, inputs).item()
    r, uid = rpf[:, 0].double(), torch.arange(8) // 4
    if name == "PMDGRPOTrainer":
        paper = lambda a: pmd_loss(lp, old, a, m, kw["tau"])[0].item()
        want, with_grpo = paper(pmd_advantages(r, uid, kw["tau"])), paper(grpo_advantage(r))
    else:
        paper = lambda a: aggregate(ppo_clip_loss(lp, old, a, m, clip_eps=0.2).per_token, m, "token-mean").item()
        adv, _ = otb_advantages(outcome_token_rewards(r, m), m, uid, lp, s2, zero_tail=kw.get("zero_tail", True))
        want, with_grpo = paper(adv), paper(grpo_advantage(r)[:, None] * m)
    assert abs(loss - want) <= 1e-6 * abs(want) + 1e-7, (loss, want)  # float32 (TRL) against float64 (reference)
    assert abs(with_grpo - want) > 1e-2 * abs(want), (with_grpo, want)  # the check can tell the advantages apart


@needs_trl
def test_pmd_gradient_matches_the_paper_loss():
    tr = make_trainer("PMDGRPOTrainer", tau=0.1)
    tr.model.eval()
    batch, rpf = fixed_batch()
    lp, _ = plain_token_stats(tr.model, batch)
    old = (lp - 0.2) * batch["completion_mask"]
    inputs = tr.apply_paper_advantages(dict(batch, old_per_token_logps=old.float()), rpf)
    params = [p for p in tr.model.parameters() if p.requires_grad]
    g_sub = torch.autograd.grad(tr.compute_loss(tr.model, inputs), params)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logits = tr.model(input_ids=ids, attention_mask=att).logits[:, 3:-1]
    lp_g = torch.log_softmax(logits.float(), -1).gather(-1, batch["completion_ids"][..., None])[..., 0]
    ref = pmd_loss(lp_g, old.float(), pmd_advantages(rpf[:, 0].double(), torch.arange(8) // 4, 0.1).float(),
                   batch["completion_mask"], 0.1)[0]
    g_ref = torch.autograd.grad(ref, params)
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(g_sub, g_ref)) ** 0.5
    den = sum(float(b.pow(2).sum()) for b in g_ref) ** 0.5
    assert den > 0 and num / den < 1e-4, num / den


@needs_trl
def test_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="pmd_mode"):
        make_trainer("PMDGRPOTrainer", pmd_mode="logz")
    with pytest.raises(ValueError, match="pmd_agg"):
        make_trainer("PMDGRPOTrainer", pmd_agg="token-mean")
    with pytest.raises(ValueError, match="tau"):
        make_trainer("PMDGRPOTrainer", tau=-1.0)
    for bad in (dict(beta=0.04), dict(entropy_coef=0.01), dict(top_entropy_quantile=0.2),
                dict(off_policy_mask_threshold=0.5)):
        with pytest.raises(ValueError, match=list(bad)[0]):
            make_trainer("PMDGRPOTrainer", args=bad)


@needs_trl
def test_seq_mean_token_sum_norm_divides_by_max_completion_length():
    tr = make_trainer("PMDGRPOTrainer", tau=0.1, pmd_agg="seq-mean-token-sum-norm", args=dict(max_completion_length=20))
    tr.model.eval()
    batch, rpf = fixed_batch()
    lp, _ = plain_token_stats(tr.model, batch)
    old = (lp - 0.1) * batch["completion_mask"]
    inputs = tr.apply_paper_advantages(dict(batch, old_per_token_logps=old.float()), rpf)
    loss = tr.compute_loss(tr.model, inputs).item()
    m = batch["completion_mask"].double()
    per_seq, _, _ = pmd_seq_terms(
        lp, old, pmd_advantages(rpf[:, 0].double(), torch.arange(8) // 4, 0.1), m, 0.1)
    want = float((per_seq / 20).mean())  # L_max = max_completion_length = 20, not the batch width 7
    assert abs(loss - want) <= 1e-6 * abs(want), (loss, want)


@needs_trl
def test_pmd_with_reused_rollouts_sees_the_log_ratio():
    """steps_per_generation=2: the second step reuses the rollout batch, so TRL supplies old log-probs and Δ != 0."""
    tr = make_trainer("PMDGRPOTrainer", tau=0.1, args=dict(per_device_train_batch_size=4, steps_per_generation=2,
                                                           learning_rate=1e-2))
    tr.train()
    ratios = [h["pmd/log_ratio"] for h in tr.state.log_history if "pmd/log_ratio" in h]
    assert len(ratios) == 2 and ratios[0] == 0.0 and abs(ratios[1]) > 1e-6, ratios


# ---- Entropy Discrepancy: TRL's loss with the scheduled entropy coefficient ----------------------------------------
def completion_entropy(model, batch):
    """Token entropy [rows, T] float64 of the completion tokens from the model's ordinary forward (full logits)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    P, T = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, attention_mask=att).logits[:, P - 1:P - 1 + T].double(), -1)
    return -(lp.exp() * lp).sum(-1) * batch["completion_mask"]


@needs_trl
@pytest.mark.parametrize("device", DEVICES)
def test_ed_two_steps_follow_the_schedule(device):
    """Two GRPOTrainer steps: the ED used equals one recomputed from full logits; TRL logs the scheduled coefficient."""
    from kimi_papers.rl.entropy_discrepancy import EDScheduler, entropy_discrepancy
    gaps = []

    class Checked(kt.EDGRPOTrainer):
        def apply_ed_schedule(self, out, rpf):
            alpha = super().apply_ed_schedule(out, rpf)
            r = kt.trl_rewards(rpf, self.reward_weights).double()
            lp, _ = plain_token_stats(self.model, out)
            ed = entropy_discrepancy(lp, None, out["completion_mask"], r,
                                     torch.arange(len(r), device=r.device) // self.num_generations)
            gaps.append(abs(ed - self.ed_trace[-1]["ed"]))
            return alpha

    tr = make_trainer(Checked, device, ed_schedule="switch", alpha_max=0.3, delta=0.0)
    tr.train()
    logged = [h["entropy_coef"] for h in tr.state.log_history if "entropy_coef" in h]
    want = EDScheduler("switch", 0.3, delta=0.0)
    assert tr.state.global_step == 2 and len(gaps) == 2 and max(gaps) < 1e-5, gaps
    assert [want.update(t["ed"]) for t in tr.ed_trace] == [t["alpha_applied"] for t in tr.ed_trace]
    assert logged == pytest.approx([t["alpha_applied"] for t in tr.ed_trace]) and all(abs(a) == 0.3 for a in logged)
    assert all(math.isfinite(h["loss"]) for h in tr.state.log_history if "loss" in h)


@needs_trl
@pytest.mark.parametrize("kind", ["surprisal", "entropy"])
def test_ed_same_batch_same_loss_as_the_core(kind):
    """On a fixed batch TRL's loss (dapo = token-mean PPO-clip, plus its entropy term) equals the core's loss parts."""
    from kimi_papers.rl.entropy_discrepancy import EDScheduler, entropy_bonus_loss, entropy_discrepancy
    tr = make_trainer("EDGRPOTrainer", alpha_max=0.5, ed_kind=kind)
    tr.model.eval()
    batch, rpf = fixed_batch()
    lp, _ = plain_token_stats(tr.model, batch)
    H, m = completion_entropy(tr.model, batch), batch["completion_mask"].double()
    old = (lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)).clamp(max=0) * m
    alpha = tr.apply_ed_schedule(batch, rpf)
    ed = entropy_discrepancy(lp, H, m, rpf[:, 0].double(), torch.arange(8) // 4, kind=kind)
    assert alpha == pytest.approx(EDScheduler("linear", 0.5).update(ed), abs=1e-6) and alpha != 0  # float32 stats in TRL
    adv = grpo_advantage(rpf[:, 0])
    loss = tr.compute_loss(tr.model, dict(batch, old_per_token_logps=old.float(), advantages=adv)).item()
    pg = aggregate(ppo_clip_loss(lp, old, adv.double()[:, None] * m, m, clip_eps=0.2).per_token, m, "token-mean")
    core = float(pg + entropy_bonus_loss(H, m, alpha))
    assert abs(loss - core) <= 1e-6 * abs(core) + 1e-7, (loss, core)
    assert abs(float(pg) - core) > 1e-3 * abs(core)  # the entropy term is visible at this tolerance


@needs_trl
def test_ed_bad_settings_raise():
    for args in (dict(entropy_coef=0.01), dict(use_adaptive_entropy=True)):
        with pytest.raises(ValueError, match="entropy_coef=0.0"):
            make_trainer("EDGRPOTrainer", args=args)
    with pytest.raises(ValueError, match="alpha_max"):
        make_trainer("EDGRPOTrainer", alpha_max=-1.0)
    with pytest.raises(ValueError, match="ed_kind"):
        make_trainer("EDGRPOTrainer", ed_kind="kl")


# ---- RLRR: rank rewards with the sign-preserving clip ------------------------------------------------------------
def rlrr_trainer(cls=None, weights=(1.0, 0.0), **kw):
    """RLRRGRPOTrainer (or a subclass) on the tiny model with the RLRR rank reward and the exact verifier."""
    from datasets import Dataset
    from trl import GRPOConfig
    import kimi_papers.rl.rlrr as R
    from kimi_papers.core.rl import ArithmeticTask, Problem
    task, G = ArithmeticTask(digits=2), 4
    rank = R.rlrr_trl_reward(R.arith_judge(seed=0), task, G, "supplement", 0.1)

    def verifier(prompts, completions, answer, **_):
        return [float(task.verify(Problem(p, a, a), c)) for p, c, a in zip(prompts, completions, answer)]

    pairs = [(1, 2), (3, 4), (5, 1), (2, 2)]
    data = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})
    cfg = GRPOConfig(output_dir="/tmp/kimi_papers_test_trl_rlrr", use_cpu=True, report_to=[], save_strategy="no", beta=0.0,
                     bf16=False, max_steps=2, per_device_train_batch_size=8, num_generations=G, max_completion_length=4,
                     learning_rate=1e-3, logging_steps=1, seed=0, disable_tqdm=True, log_level="warning",
                     reward_weights=list(weights))
    model = tiny_causal_lm(CTOK.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=64, seed=0, tokenizer=CTOK)
    return (cls or kt.RLRRGRPOTrainer)(model=model, reward_funcs=[rank, verifier], args=cfg, train_dataset=data,
                                        processing_class=kt.hf_char_tokenizer(ALPHABET), **kw)


@needs_trl
def test_rlrr_two_steps_train_on_the_clipped_rank_advantage():
    import kimi_papers.rl.rlrr as R
    seen = []

    class Checked(kt.RLRRGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append((self._kp_rewards_per_func.detach().clone(), out["advantages"].detach().clone()))
            return out

    tr = rlrr_trainer(Checked, rule_func=1)
    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr.state.global_step == 2 and len(seen) == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters())), "no parameter moved"
    for rpf, adv in seen:
        s, rule = rpf[:, 0].double(), rpf[:, 1]
        uid = torch.arange(len(s)) // 4
        want = torch.tensor(R.rlrr_advantages_reference(s.tolist(), rule.tolist(), uid.tolist()), dtype=torch.float64)
        assert (adv.double() - want).abs().max() < 1e-6, (adv, want)   # the plain-Python reference, with the clip
        assert R.sign_violation_rate(adv.double(), rule) == 0.0


@needs_trl
def test_rlrr_same_batch_same_loss_as_the_core():
    import kimi_papers.rl.rlrr as R
    tr = rlrr_trainer(rule_func=1)
    tr.model.eval()
    batch, _ = fixed_batch()
    rule = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])     # group 1 all correct: lower-ranked correct rows get A < 0 before the clip
    ranks = torch.tensor([[3, 1, 2, 4], [1, 2, 3, 4]])
    s = R.rank_to_reward(ranks, rule.view(2, 4), "supplement", 0.1).flatten().float()
    rpf = torch.stack([s, rule], 1)
    lp, _ = plain_token_stats(tr.model, batch)
    m = batch["completion_mask"].double()
    noise = 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    old = (lp + noise).clamp(max=0) * m
    inputs = tr.apply_paper_advantages(dict(batch, old_per_token_logps=old.float()), rpf)
    loss = tr.compute_loss(tr.model, inputs).item()
    uid = torch.arange(8) // 4
    paper = lambda a: aggregate(ppo_clip_loss(lp, old, a[:, None] * m, m, clip_eps=0.2).per_token, m, "token-mean").item()
    clipped, unclipped = R.rlrr_advantages(s.double(), rule, uid), R.rlrr_advantages(s.double(), None, uid)
    assert (clipped != unclipped).any()                  # the clip acts on this batch
    want = paper(clipped)
    assert abs(loss - want) <= 1e-6 * abs(want) + 1e-7, (loss, want)
    assert abs(paper(unclipped) - want) > 1e-3 * abs(want), "the check cannot tell the clip apart"


@needs_trl
def test_rlrr_bad_settings_raise():
    with pytest.raises(ValueError, match="rlrr_norm"):
        rlrr_trainer(rlrr_norm="mad")
    with pytest.raises(ValueError, match="xi_neg"):
        rlrr_trainer(xi_neg=float("nan"))
    with pytest.raises(ValueError, match="rule_func=2: expected an index < 2"):
        rlrr_trainer(rule_func=2)
    with pytest.raises(ValueError, match=r"reward_weights\[1\] = 1"):
        rlrr_trainer(rule_func=1, weights=(1.0, 1.0))
