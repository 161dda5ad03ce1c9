"""Worker for tests/test_rl_ddp.py: run under `torchrun --standalone --nproc_per_node 2` (gloo, CPU).

Each rank builds the same tiny policy and the same fixed rollout batch, then
1. computes the one-process loss and gradient on the whole batch (`Trainer(distributed=False)`), and
2. computes the data-parallel loss and gradient from its own rows only, with the rows of every group
   split across the two ranks (so group statistics are wrong unless rewards are gathered first),
for every aggregation and for the PPO-clip, REINFORCE and PMD losses. Rank 0 writes the largest
differences as JSON to the path given as the first argument. A naive per-rank token mean is also
measured, to show that the comparison can fail.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from kimi_papers.core.models import CharTokenizer, tiny_causal_lm
from kimi_papers.core.rl import (AGGREGATIONS, ArithmeticTask, Policy, RolloutBatch, Trainer, aggregate, generate,
                                 get_loss, sequence_stats)


def fixed_batch(policy: Policy, task: ArithmeticTask, n_prompts: int = 4, G: int = 4) -> RolloutBatch:
    """Sampled responses cut to uneven lengths, with hand-set rewards (mixed groups, one all-equal group)."""
    problems = task.sample(n_prompts, 3)
    prompts = [policy.encode_prompt(p.prompt) for p in problems for _ in range(G)]
    ids, attn, resp, texts = generate(policy, prompts, max_new_tokens=6, generator=torch.Generator().manual_seed(1))
    keep = torch.tensor([1, 5, 2, 6, 1, 4, 3, 6, 2, 5, 1, 6, 3, 4, 1, 5])[: n_prompts * G]   # uneven per rank
    resp = resp * (resp.cumsum(-1) <= keep[:, None]).long()
    reward = torch.tensor([1., 0., 0., 1., 1., 1., 1., 0., 0., 0., 0., 0., 0.5, 1., 0., 0.25])[: n_prompts * G]
    uid = torch.arange(n_prompts).repeat_interleave(G)
    return RolloutBatch(input_ids=ids, attn_mask=attn, resp_mask=resp, reward=reward, uid=uid, text=texts)


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def run_case(trainer: Trainer, batch: RolloutBatch) -> tuple[float, torch.Tensor]:
    """Loss (global value) and flattened gradient of one minibatch step, without the optimizer step."""
    trainer.score_old(batch)
    batch.adv, _ = trainer.advantages(batch)
    trainer.policy.model.zero_grad(set_to_none=True)
    loss, _ = trainer.minibatch_loss(batch)
    loss.backward()
    value = loss.detach().clone() / trainer.world
    if trainer.world > 1:
        dist.all_reduce(value)
    return float(value), grads(trainer.policy.model)


def main(out_path: str) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    task = ArithmeticTask(digits=2)
    tok = CharTokenizer(task.alphabet)
    model = tiny_causal_lm(tok.vocab_size, d_model=32, n_layers=1, n_heads=2, max_len=32, seed=0, tokenizer=tok)
    ref_model = copy.deepcopy(model)
    batch = fixed_batch(Policy(model, tok, add_bos=True), task)
    mine = torch.arange(rank, batch.rows, world)          # interleaved rows: every group straddles the ranks
    kw = dict(group_size=4, prompts_per_step=4 * world, max_new_tokens=6, progress=False, beta_kl=0.0)
    one = Trainer(Policy(ref_model, tok, add_bos=True), task, distributed=False, **kw)
    ddp = Trainer(Policy(model, tok, add_bos=True), task, distributed=True, **kw)
    result = {"world_size": world, "rows_per_rank": int(len(mine)), "cases": {}}
    for loss in ("ppo_clip", "reinforce", "pmd_regression"):
        for agg in AGGREGATIONS:
            for t in (one, ddp):
                t.loss_fn, t.agg, t.loss_cfg = get_loss(loss), agg, ({"tau": 0.5} if loss == "pmd_regression" else {})
            l1, g1 = run_case(one, copy.deepcopy(batch))
            l2, g2 = run_case(ddp, batch.select(mine))
            result["cases"][f"{loss}/{agg}"] = {"loss_1p": l1, "loss_2p": l2, "loss_err": abs(l1 - l2),
                                                 "grad_err": float((g1 - g2).abs().max()),
                                                 "grad_scale": float(g1.abs().max())}
    # a per-rank token mean (the common mistake) must differ: it proves the comparison can fail
    for t in (one, ddp):
        t.loss_fn, t.agg, t.loss_cfg = get_loss("ppo_clip"), "token-mean", {}
    _, g1 = run_case(one, copy.deepcopy(batch))
    local = batch.select(mine)
    ddp.score_old(local)
    local.adv, _ = ddp.advantages(local)
    model.zero_grad(set_to_none=True)
    st = sequence_stats(ddp.fwd, ddp.policy.head(), local.input_ids, local.attn_mask, local.resp_mask)
    terms = get_loss("ppo_clip")(logp=st["logp"], old_logp=local.old_logp, adv=local.adv, mask=local.resp_mask.bool())
    aggregate(terms.per_token, local.resp_mask, "token-mean").backward()    # DDP then averages the rank means
    result["naive_grad_err"] = float((g1 - grads(model)).abs().max())
    # parameters stay in sync across ranks through a real optimizer step of fit()
    ddp.fit(1)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, 0)
    result["param_sync_err"] = float((flat - other).abs().max())
    result["fit_rows"] = int(ddp.last_batch.rows)
    del ddp.fwd, ddp
    dist.barrier()
    if rank == 0:
        tmp = out_path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(tmp, out_path)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
