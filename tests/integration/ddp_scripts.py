"""Scripts ``test_ddp.py`` runs in subprocesses (Lightning's DDP re-runs the script per rank).

``fit OUT``: a 2-process DDP ``fit`` on CPU (gloo) where rank 1's groups are all filtered out;
each rank writes ``OUT.<rank>.json``.
``grads RANK INIT OUT``: one of 2 gloo processes (``file://INIT`` rendezvous) that drives
``PolicyUpdate.accumulate`` under a real ``DistributedDataParallel`` wrapper the way Lightning's
manual optimisation does (backward inside the DDP forward, ``prepare_for_backward`` before each
backward) and compares its gradients with one process on the union batch; rank 0 writes
``OUT``. Both scripts end every rank with ``os._exit`` after a barrier (see the end of
``grads``).
"""

from __future__ import annotations

import copy
import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from rlvr_lightning.testing import grouped

FILTERED_RANK = 1


def rank_reward(completions: list[str], **_: object) -> list[float]:
    """All wrong on ``FILTERED_RANK`` (every group uninformative), alternating elsewhere."""
    if dist.get_rank() == FILTERED_RANK:
        return [0.0] * len(completions)
    return [float(i % 2) for i in range(len(completions))]


def fit(out: str) -> None:
    import lightning.pytorch as pl

    from rlvr_lightning import RLVRDataModule, RLVRModule, Sampling

    pl.seed_everything(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[rank_reward],
            filter_zero_variance=True,
            sampling=Sampling(max_new_tokens=8, group_size=4),
            micro_batch_size=2,
            minibatches_per_rollout=2,
            lr=1e-3,
        ),
    )
    data = RLVRDataModule(source="addition", train_size=32, val_size=4, prompts_per_step=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=data)
    params = torch.cat([p.detach().flatten() for p in module.policy.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(2)]
    dist.all_gather(gathered, params)
    result = {
        "global_step": trainer.global_step,
        "rollout_step": module._rollout_step,
        "trained_rows": int(module.last_step.trained.sum()) * 4,
        "rank_param_diff": float((gathered[0] - gathered[1]).abs().max()),
    }
    with open(f"{out}.{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)
    # As in ``grads``: leave without tearing down. Destroying the gloo group at interpreter
    # exit aborted a rank once ("terminate called without an active exception", rc -6).
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


class _Step(nn.Module):
    """What Lightning wraps in DDP under manual optimisation: a forward (``training_step``)
    that runs the backward passes itself."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.policy = policy

    def forward(self, run):
        return run(self.policy)


def _manual_step(ddp, run):
    """``ddp(run)`` as Lightning's ``_DDPForwardRedirection`` calls it: sync turned off after
    the inner forward, so DDP does not prepare a backward of its own for the output."""

    def inner(policy: nn.Module):
        out = run(policy)
        ddp.require_backward_grad_sync = False
        return out

    try:
        return ddp(inner)
    finally:
        ddp.require_backward_grad_sync = True


def _update(mode: str):
    from rlvr_lightning.algorithms.losses import ppo_clip_loss
    from rlvr_lightning.stages.update import PolicyUpdate

    return PolicyUpdate(
        loss_fn=ppo_clip_loss,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode=mode,
        norm_len=8,
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        micro_batch_size=2,
    )


def _rollouts():
    """2 prompts x 3 samples from a tiny policy; rows 1 and 4 shortened, so ranks hold unequal
    token counts."""
    import dataclasses

    from rlvr_lightning.rollout.hf import HFEngine
    from rlvr_lightning.testing import tiny_policy
    from rlvr_lightning.types import Sampling

    model, tok = tiny_policy(seed=0)
    tok.padding_side = "left"
    enc = tok(["ab", "hello there"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    r = HFEngine(model, tok).generate(
        enc.input_ids, enc.attention_mask, Sampling(max_new_tokens=8, group_size=3)
    )
    mask = r.completion_mask.clone()  # [6, T]
    mask[1, 2:] = 0
    mask[4, 1:] = 0
    return model, dataclasses.replace(r, completion_mask=mask)


def grads(rank: int, init: str, out: str) -> None:
    from lightning.pytorch.overrides.distributed import prepare_for_backward
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    model, rollouts = _rollouts()
    alone = copy.deepcopy(model)  # one process: kept out of DDP's reducer
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])  # [6]
    ddp = DistributedDataParallel(_Step(model))

    def mean_over_ranks(value: float) -> float:
        t = torch.tensor(float(value), dtype=torch.float64)
        dist.all_reduce(t)
        return float(t) / 2

    def backward(loss: torch.Tensor) -> None:  # LightningModule.manual_backward under DDP
        prepare_for_backward(ddp, loss)
        loss.backward()

    def ranked(mode: str, mine: list[int], mean: bool) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        rows = torch.tensor(mine, dtype=torch.long)
        loss, _ = _manual_step(
            ddp,
            lambda policy: _update(mode).accumulate(
                policy,
                rollouts,
                adv,
                rows,
                lambda f: None,
                backward,
                mean_over_ranks=mean_over_ranks if mean else None,
                no_sync=ddp.no_sync,
            ),
        )
        return loss, torch.cat([p.grad.flatten() for p in model.parameters()])

    def single(mode: str) -> tuple[float, torch.Tensor]:  # one process, the union batch
        alone.zero_grad(set_to_none=True)
        loss, _ = _update(mode).accumulate(
            alone, rollouts, adv, torch.arange(6), lambda f: None, lambda x: x.backward()
        )
        return loss, torch.cat([p.grad.flatten() for p in alone.parameters()])

    # rank 0: 4 rows of both prompts (the two shortened), 2 micro-batches; rank 1: 2 rows, 1.
    split = {0: [0, 1, 3, 4], 1: [2, 5]}[rank]
    result = {}

    def compare(name: str, loss: float, got: torch.Tensor, want_loss: float, want: torch.Tensor):
        result[name] = {
            "grad_diff": float((got - want).abs().max()),
            "grad_scale": float(want.abs().max()),
            "loss_diff": abs(loss - want_loss),
        }

    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        want_loss, want = single(mode)
        compare(mode, *ranked(mode, split, mean=True), want_loss, want)
        compare(f"{mode}/naive", *ranked(mode, split, mean=False), want_loss, want)
    # Rank 1 has no rows at all: its zero backward still meets rank 0's all-reduce.
    want_loss, want = single("token-mean")
    loss, got = ranked("token-mean", [*range(6)] if rank == 0 else [], mean=True)
    compare("empty_rank", loss, got, want_loss, want)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    # Both ranks are past every collective; then leave without tearing down. Freeing the DDP
    # reducer and the gloo group after the peer has gone hung a rank in C++ destructors (no
    # Python frame) on a loaded machine, about 1 run in 3.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    # Before the test's deadline, print every thread's stack and exit: a hang names its line.
    faulthandler.dump_traceback_later(float(os.environ.get("RLVR_DDP_DUMP_S", "240")), exit=True)
    if sys.argv[1] == "fit":
        fit(sys.argv[2])
    else:
        grads(int(sys.argv[2]), sys.argv[3], sys.argv[4])
