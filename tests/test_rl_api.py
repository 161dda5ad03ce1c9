"""kimi_papers.core.rl as a user's training code sees it: explicit sampling seeds, registries a user can override,
GRPO's two epsilons, the package's public names and module sizes."""
from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch

import kimi_papers.core.rl as rl
from kimi_papers.core.rl import (ADVANTAGES, LOSSES, RolloutBatch, generate, register_advantage, register_loss,
                                 scripted_policy)

LEGACY = ['KL_ESTIMATORS', 'ADVANTAGES', 'LOSSES', 'AGGREGATIONS', 'ARITH_WARMSTART', 'Problem', 'Task', 'ArithmeticTask',
          'eval_expression', 'CountdownTask', 'HiddenStates', 'Policy', 'as_policy', 'position_ids', 'sequence_stats',
          'RolloutBatch', 'generate', 'kl_estimate', 'kl_penalty', 'freeze_reference', 'register_advantage',
          'register_loss', 'get_advantage', 'get_loss', 'check_rewards', 'group_index', 'group_mean', 'group_std',
          'effective_group_ratio', 'grpo_advantage', 'dr_grpo_advantage', 'rloo_advantage', 'LossTerms', 'agg_parts',
          'aggregate', 'ppo_clip_loss', 'grpo_loss', 'reinforce_loss', 'pmd_regression_loss', 'pass_at_k',
          'gather_batch', 'local_rows', 'Trainer', 'evaluate', 'sft_batch', 'sft_warmstart', 'fixture_path',
          'tiny_policy', 'warm_arith_policy']


def test_every_name_of_the_single_module_is_still_importable():
    assert [n for n in LEGACY if not hasattr(rl, n)] == []
    assert set(LEGACY) <= set(rl.__all__)
    ns: dict = {}
    exec("from kimi_papers.core.rl import *", ns)
    assert set(rl.__all__) <= set(ns)


def test_modules_stay_readable_in_one_sitting():
    pkg = Path(rl.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in pkg.glob("*.py")}
    assert len(sizes) >= 7 and max(sizes.values()) <= 450, sizes


def _policy():
    from kimi_papers.core.models import CharTokenizer, tiny_causal_lm
    from kimi_papers.core.rl import ArithmeticTask, Policy
    task = ArithmeticTask(digits=2)
    tok = CharTokenizer(task.alphabet)
    model = tiny_causal_lm(tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=32, seed=0, tokenizer=tok)
    policy = Policy(model, tok, add_bos=True)
    return policy, [policy.encode_prompt(p.prompt) for p in task.sample(4, 0)]


def test_generate_takes_its_noise_explicitly():
    policy, prompts = _policy()
    gen = torch.Generator().manual_seed(11)
    a, b = (generate(policy, prompts, max_new_tokens=6, generator=gen)[0] for _ in range(2))
    assert not torch.equal(a, b)                                  # one generator: a second call draws new samples
    s1, s2 = (generate(policy, prompts, max_new_tokens=6, seed=11)[0] for _ in range(2))
    assert torch.equal(s1, s2) and torch.equal(s1, a)            # a seed fixes the call, as a fresh generator would
    with pytest.raises(ValueError, match="generator=None, seed=None"):
        generate(policy, prompts, max_new_tokens=6)
    with pytest.raises(TypeError, match="seed"):
        generate(policy, prompts, max_new_tokens=6, seed=1.5)
    g1 = generate(policy, prompts, max_new_tokens=6, greedy=True)[0]
    assert torch.equal(g1, generate(policy, prompts, max_new_tokens=6, greedy=True)[0])


@pytest.fixture
def restore_registries():
    adv, loss = dict(ADVANTAGES), dict(LOSSES)
    yield
    ADVANTAGES.clear(); ADVANTAGES.update(adv)
    LOSSES.clear(); LOSSES.update(loss)


def _user_function(name: str, body) -> types.FunctionType:
    """A function defined in a user's own module (not __main__, not the library)."""
    mod = types.ModuleType("my_training_code")
    exec(f"def {name}(*a, **k):\n    return BODY(*a, **k)", {"BODY": body, "__name__": mod.__name__}, mod.__dict__)
    return mod.__dict__[name]


def test_a_user_can_override_a_library_registration(restore_registries):
    import kimi_papers.rl.pmd_mean  # noqa: F401  registers "pmd_mean" on import, as a user's session would
    assert "pmd_mean" in LOSSES
    mine = _user_function("pmd_mean_loss", lambda **kw: None)
    with pytest.raises(ValueError, match=r"already registered by kimi_papers\.rl\.pmd_mean.*override=True"):
        register_loss("pmd_mean")(mine)
    assert LOSSES["pmd_mean"] is not mine
    assert register_loss("pmd_mean", override=True)(mine) is mine and LOSSES["pmd_mean"] is mine
    # the same qualname from another module is not "the same definition": it needs override too
    other = _user_function("grpo_advantage", lambda batch, **kw: batch.resp_mask.float())
    with pytest.raises(ValueError, match="override=True"):
        register_advantage("grpo")(other)
    register_advantage("grpo", override=True)(other)
    assert ADVANTAGES["grpo"] is other


def test_grpo_epsilon_verl_and_trl_on_a_near_tie():
    ones = torch.ones(2, 3, dtype=torch.long)
    batch = RolloutBatch(ones, ones, ones, reward=torch.tensor([0.0, 1e-6], dtype=torch.float64), uid=torch.zeros(2))
    sd = 1e-6 / math.sqrt(2)                                     # unbiased std of (0, 1e-6)
    a6, a4 = ADVANTAGES["grpo"](batch)[1, 0].item(), ADVANTAGES["grpo_trl"](batch)[1, 0].item()
    assert a6 == pytest.approx(5e-7 / (sd + 1e-6), rel=1e-6) and a4 == pytest.approx(5e-7 / (sd + 1e-4), rel=1e-6)
    assert 50 < a6 / a4 < 70
    assert rl.TRL_GRPO_EPS == 1e-4 and rl.GRPO_EPS == 1e-6


def test_scripted_policy_answers_as_scripted():
    sp = scripted_policy("0123456789=", {"=": "4", "4": "2"})
    assert generate(sp, [sp.encode_prompt("67=")], max_new_tokens=5, greedy=True)[3] == ["42"]
