"""Baselines at the same generated tokens: GRPO G=8 vs POISE G=2 (4x the prompts) vs PPO with
a value head (GAE), from the same start.

The embedded SmolLM2-135M-Instruct on addition (``--digits``), the same seed, validation set,
steps and hyperparameters for every arm; only the estimator, its head and the group shape
differ:

- ``grpo``: ``--prompts`` prompts x G=8, std-normalised group advantages.
- ``poise``: ``4 * --prompts`` prompts x G=2, ``estimator: probe`` (``heads.ProbeHead``: RLOO
  for ``--probe-bootstrap`` steps, first fit after ``--probe-warmup``).
- ``ppo``: ``--prompts`` prompts x G=8, ``estimator: gae`` with a linear ``heads.ValueHead``.

Prints, per arm and averaged over ``--seeds``: held-out greedy accuracy before and after,
the wall time of training, and for POISE the probe's correlation with the empirical pass rate
of held-out prompts: ``--k`` completions are sampled per held-out prompt, the probe's mean
prediction over them is compared with the share that is correct (Pearson r over prompts).

    python benchmarks/baselines.py                      # 3 seeds x 3 arms x 10 steps
    python benchmarks/baselines.py --steps 1 --val-size 2 --k 2 --seeds 0   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from guidance import addition_data, bench_trainer, sweep

ARMS = ("grpo", "poise", "ppo")


def _arm_module_args(arm: str, args: argparse.Namespace) -> tuple[dict[str, Any], int, int]:
    """``(RLVRModule keyword arguments, group size, prompts per step)`` of an arm."""
    from rlvr_lightning.heads import ProbeHead, ValueHead

    match arm:
        case "grpo":
            return {}, 8, args.prompts
        case "poise":
            head = lambda hidden: ProbeHead(  # noqa: E731
                hidden,
                reward_range=(0.0, 1.5),  # the total reward's range (weights 1, .25, .25)
                bootstrap_steps=args.probe_bootstrap,
                warmup_steps=args.probe_warmup,
            )
            return {"estimator": "probe", "probe_head": head}, 2, 4 * args.prompts
        case "ppo":
            head = lambda hidden: ValueHead(hidden, lr=1e-4)  # noqa: E731
            return (
                {"estimator": "gae", "value_head": head, "agg_mode": "token-mean"},
                8,
                args.prompts,
            )
    raise ValueError(f"unknown arm {arm!r}; use {', '.join(ARMS)}")


def _probe_pass_rate_corr(module: Any, data: Any, args: argparse.Namespace) -> float | None:
    """Pearson r over held-out prompts between the probe's mean prediction over ``k`` sampled
    completions and their pass rate; None without a fitted probe or when the pass rates do
    not vary."""
    import torch

    from rlvr_lightning.heads.probe import fit_quality
    from rlvr_lightning.types import Sampling

    head = module.probe_head
    if head is None or not head.fitted:
        return None
    loaders = data.val_dataloader()  # a list when the paraphrased split is on: take val
    batch = next(iter(loaders[0] if isinstance(loaders, list) else loaders))
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.k)
    with torch.no_grad():
        rollouts = module.rollout(batch, sampling)
        pass_rate = module.score(batch, rollouts).correct.float().view(len(batch), -1).mean(1)
        micro, chunk = module.options.update.micro_batch_size, module.updater.head_chunk_tokens
        pred = head.score_rollouts(module.policy, rollouts, micro, chunk)  # [B * k]
        pred = pred.view(len(batch), -1).mean(1)  # [B]
    if float(pass_rate.std()) == 0:  # every prompt equally (un)solved: r is undefined
        return None
    return fit_quality(pred.cpu(), pass_rate.cpu())[1]


def run_arm(arm: str, args: argparse.Namespace, before: float | None) -> dict[str, Any]:
    import lightning.pytorch as pl

    from rlvr_lightning import RLVRModule
    from rlvr_lightning.rewards import answer_accuracy, boxed_accuracy, boxed_format
    from rlvr_lightning.testing import grouped
    from rlvr_lightning.types import Sampling

    pl.seed_everything(args.seed, verbose=False)
    extra, group, prompts = _arm_module_args(arm, args)
    budget = args.max_new_tokens
    module = RLVRModule(
        "embedded:smollm2-135m-instruct",
        **grouped(
            reward_fns=[boxed_accuracy, boxed_format, answer_accuracy],
            reward_weights=[1.0, 0.25, 0.25],
            accuracy_reward="boxed_accuracy",
            sampling=Sampling(max_new_tokens=budget, temperature=1.0, group_size=group),
            val_sampling=Sampling(max_new_tokens=budget, temperature=0.0, group_size=1),
            micro_batch_size=16,
            lr=args.lr,
            **extra,
        ),
    )
    data = addition_data(args, prompts)
    trainer = bench_trainer(args.steps)
    if before is None:  # same model, seed and validation set for every arm: measured once
        before = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/accuracy"])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    train_s = time.perf_counter() - start
    after = float(trainer.validate(module, datamodule=data, verbose=False)[0]["val/accuracy"])
    corr = _probe_pass_rate_corr(module, data, args)
    return {"arm": arm, "before": before, "after": after, "train_s": train_s, "probe_corr": corr}


def _mean(values: list[float | None]) -> str:
    kept = [v for v in values if v is not None]
    return f"{statistics.fmean(kept):.3f}" if kept else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step at G=8")
    parser.add_argument("--digits", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--val-size", type=int, default=32, help="held-out prompts")
    parser.add_argument("--k", type=int, default=8, help="samples per held-out prompt (probe)")
    parser.add_argument("--probe-bootstrap", type=int, default=4)
    parser.add_argument("--probe-warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    results = sweep(args, run_arm)
    print(
        f"\n{args.steps} steps, {8 * args.prompts} rollouts x {args.max_new_tokens} new tokens "
        f"per step (G=8 x {args.prompts} or G=2 x {4 * args.prompts}), lr {args.lr}, seeds "
        f"{args.seeds}, {args.val_size} held-out {args.digits}-digit sums (greedy; probe r over "
        f"{args.k} samples each)\n"
    )
    print("| arm | val acc before | val acc after | train wall s | probe r vs pass rate |")
    print("|---|---|---|---|---|")
    for arm, rows in results.items():
        cols = [_mean([r[k] for r in rows]) for k in ("before", "after")]
        wall = statistics.fmean(r["train_s"] for r in rows)
        corr = _mean([r["probe_corr"] for r in rows])
        print(f"| {arm} | {cols[0]} | {cols[1]} | {wall:.0f} | {corr} |")


if __name__ == "__main__":
    main()
