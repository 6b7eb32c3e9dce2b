"""Plain GRPO vs ground-truth injection vs LUFFY-style guidance on a task the model fails.

The embedded SmolLM2-135M-Instruct on two-digit addition (greedy held-out accuracy starts near
0), the same seed, prompts, steps and hyperparameters for every arm; only the callback and the
off-policy weighting differ:

- ``grpo``: no guidance.
- ``gt``: ``GroundTruthInjection`` (template alignment, gating on all-wrong groups, reward
  capping), ``offpolicy_weighting: on_policy``.
- ``luffy``: ``MixedPolicyGuidance(source=reference, injection=always)``,
  ``offpolicy_weighting: shaping`` (``f(pi) = pi / (pi + 0.1)``).

Prints a table of held-out greedy accuracy before and after, the mean fraction of groups with a
non-zero advantage (as trained, injected members included), the mean fraction of groups whose
sampled outcome is uniform (all correct or all wrong: what dynamic sampling would drop) and the
mean training accuracy of the sampled (on-policy) completions.

    python benchmarks/guidance.py                       # defaults: 8 steps, ~10 min on 2 cores
    python benchmarks/guidance.py --steps 20 --arms grpo,luffy
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rlvr_lightning.testing import grouped

INSTRUCTION = "Put the final answer in \\boxed{}, for example \\boxed{5}."


def _recorder() -> Any:
    from rlvr_lightning.stages.hooks import RLVRCallback

    class Recorder(RLVRCallback):
        """Keeps every step's metrics."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []

        def on_step_output(self, trainer, module, output) -> None:
            self.steps.append(dict(output.metrics))

    return Recorder()


def _arm_callbacks(arm: str) -> tuple[list[Any], str]:
    from rlvr_lightning.callbacks import GroundTruthInjection, MixedPolicyGuidance

    match arm:
        case "grpo":
            return [], "shaping"
        case "gt":
            return [GroundTruthInjection(answer_column="answer")], "on_policy"
        case "luffy":
            return [MixedPolicyGuidance(source="reference", injection="always")], "shaping"
    raise ValueError(f"unknown arm {arm!r}; use grpo, gt or luffy")


def addition_data(args: argparse.Namespace, prompts: int) -> Any:
    """The benchmarks' data: ``args.digits``-digit sums, ``prompts`` per step, ``args.val_size``
    held-out prompts in one batch, the instruction above, split by ``args.seed``."""
    from rlvr_lightning import RLVRDataModule

    return RLVRDataModule(
        source="addition",
        task_config={"digits": args.digits},
        val_size=args.val_size,
        prompts_per_step=prompts,
        val_prompts_per_batch=args.val_size,
        instruction=INSTRUCTION,
        seed=args.seed,
    )


def bench_trainer(steps: int, callbacks: list[Any] | None = None) -> Any:
    """A quiet bf16-mixed CPU ``Trainer`` for ``steps`` optimiser steps that validates only
    when asked (``trainer.validate``); shared by the benchmarks that import this file."""
    from rlvr_lightning.testing import quiet_trainer

    return quiet_trainer(
        precision="bf16-mixed",
        max_steps=steps,
        limit_val_batches=1.0,
        val_check_interval=1_000_000,
        check_val_every_n_epoch=None,
        callbacks=callbacks or [],
    )


def sweep(args: argparse.Namespace, run: Any) -> dict[str, list[dict[str, Any]]]:
    """``run(arm, args, before)`` for every seed of ``args.seeds`` and arm of ``args.arms``
    (seed-major; ``before``: the seed's validation before training, measured by its first
    arm); returns each arm's rows in seed order."""
    results: dict[str, list[dict[str, Any]]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        args.seed, before = seed, None
        for arm in args.arms.split(","):
            row = run(arm, args, before)
            before = row["before"]
            results.setdefault(arm, []).append(row)
            print(f"done {arm} seed {seed}: {row}", flush=True)
    return results


def _validate(trainer: Any, module: Any, data: Any) -> float:
    results = trainer.validate(module, datamodule=data, verbose=False)
    return float(results[0]["val/accuracy"])


def run_arm(arm: str, args: argparse.Namespace, before: float | None) -> dict[str, Any]:
    import lightning.pytorch as pl

    from rlvr_lightning import RLVRModule
    from rlvr_lightning.rewards import answer_accuracy, boxed_accuracy, boxed_format
    from rlvr_lightning.types import Sampling

    pl.seed_everything(args.seed, verbose=False)
    callbacks, weighting = _arm_callbacks(arm)
    recorder = _recorder()
    module = RLVRModule(
        "embedded:smollm2-135m-instruct",
        **grouped(
            reward_fns=[boxed_accuracy, boxed_format, answer_accuracy],
            reward_weights=[1.0, 0.25, 0.25],
            accuracy_reward="boxed_accuracy",
            offpolicy_weighting=weighting,
            sampling=Sampling(
                max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group
            ),
            val_sampling=Sampling(
                max_new_tokens=args.max_new_tokens, temperature=0.0, group_size=1
            ),
            micro_batch_size=16,
            lr=args.lr,
        ),
    )
    data = addition_data(args, args.prompts)
    trainer = bench_trainer(args.steps, callbacks=[*callbacks, recorder])
    if before is None:
        before = _validate(trainer, module, data)
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    train_s = time.perf_counter() - start
    after = _validate(trainer, module, data)
    steps = recorder.steps
    nonzero = sum(1.0 - m["zero_advantage_frac"] for m in steps) / len(steps)
    uniform = sum(m["uniform_outcome_frac"] for m in steps) / len(steps)
    policy_acc = [m["accuracy"] for m in steps]  # the sampled rows only
    return {
        "arm": arm,
        "before": before,
        "after": after,
        "nonzero_adv_groups": nonzero,
        "uniform_outcome_groups": uniform,
        "train_accuracy": sum(policy_acc) / len(policy_acc),
        "train_s": train_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="grpo,gt,luffy")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=2, help="addends' digits (2: fails cold)")
    args = parser.parse_args()
    rows, before = [], None
    for arm in args.arms.split(","):
        row = run_arm(arm, args, before)
        before = row["before"]  # same model, seed and validation set: measured once
        rows.append(row)
        print(f"done {arm}: {row}", flush=True)
    print(
        f"\n{args.steps} steps x {args.prompts} prompts x G={args.group}, "
        f"{args.max_new_tokens} new tokens, lr {args.lr}, seed {args.seed}, "
        f"{args.val_size} held-out {args.digits}-digit sums (greedy)\n"
    )
    print(
        "| arm | val acc before | val acc after | groups with non-zero adv | "
        "groups with a uniform sampled outcome | train acc | train s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['before']:.3f} | {r['after']:.3f} | "
            f"{r['nonzero_adv_groups']:.3f} | {r['uniform_outcome_groups']:.3f} | "
            f"{r['train_accuracy']:.3f} | {r['train_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
