"""kimi_papers.core.rl on CUDA: rollouts, advantages, losses, group rewards, episodes and one trainer step.
Skipped (visibly) without a GPU."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def policy():
    from kimi_papers.core.models import CharTokenizer, tiny_causal_lm
    from kimi_papers.core.rl import ArithmeticTask, Policy
    tok = CharTokenizer(ArithmeticTask(digits=2).alphabet)
    model = tiny_causal_lm(tok.vocab_size, d_model=32, n_layers=2, n_heads=2, max_len=96, seed=0, tokenizer=tok)
    return Policy(model.cuda(), tok, add_bos=True)


def test_objectives_keep_the_device():
    from kimi_papers.core.rl import ADVANTAGES, LOSSES, RolloutBatch, aggregate, effective_group_ratio, kl_penalty
    dev = torch.device("cuda")
    m = torch.ones(4, 3, dtype=torch.long, device=dev)
    b = RolloutBatch(m, m, m, reward=torch.tensor([1., 0., 1., 1.], device=dev), uid=torch.tensor([0, 0, 1, 1], device=dev))
    for name in ("grpo", "grpo_trl", "dr_grpo", "rloo"):
        assert ADVANTAGES[name](b).device.type == "cuda", name
    lp = torch.randn(4, 3, device=dev, dtype=torch.bfloat16)
    for name in ("ppo_clip", "reinforce"):
        t = LOSSES[name](lp, lp.detach(), ADVANTAGES["grpo"](b), m)
        assert t.per_token.device.type == "cuda" and t.per_token.dtype == torch.float32
        assert aggregate(t.per_token, m).device.type == "cuda"
    assert kl_penalty(lp, lp, m, "k3", "seq-mean").device.type == "cuda"
    assert effective_group_ratio(b.reward, b.uid) == 0.5


def test_rollouts_episodes_and_a_trainer_step(policy):
    from kimi_papers.core.rl import (ArithmeticTask, EnvRunner, HiddenStates, Trainer, generate, generate_pairs,
                                     group_rewards, sequence_stats)
    task = ArithmeticTask(digits=2)
    prompts = [policy.encode_prompt(p.prompt) for p in task.sample(4, 0)]
    ids, attn, resp, _ = generate(policy, prompts, max_new_tokens=4, seed=0)
    assert ids.device.type == "cuda"
    st = sequence_stats(HiddenStates(policy.model), policy.head(), ids, attn, resp)
    assert st["logp"].device.type == "cuda"
    pb = generate_pairs(policy, task.sample(2, 1), lambda p: p, 2, max_new_tokens=3, seed=0)
    assert pb.uid.device.type == "cuda" and pb.pair_id.device.type == "cuda"
    r = group_rewards(lambda p, t, u: [float(len(x)) for x in t], pb.problems, pb.text, pb.uid, pb.pair_id)
    assert r.device.type == "cuda"

    class Env:
        def reset(self):
            return "1="
        def step(self, action):
            return "2=", 1.0, False
    eb = EnvRunner(policy, max_turns=2, max_new_tokens=3).run([Env(), Env()], seed=0)
    assert eb.step_index.device.type == "cuda" and eb.reward.tolist() == [2.0, 2.0]
    tr = Trainer(policy, task, group_size=2, prompts_per_step=2, max_new_tokens=3, progress=False, beta_kl=0.01,
                 reward_fn=lambda p, t: [float(len(x)) for x in t])
    row = tr.step()
    assert tr.last_batch.adv.device.type == "cuda" and row["opt_steps"] == 1
