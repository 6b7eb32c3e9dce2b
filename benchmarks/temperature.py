"""Fixed sampling temperature vs ERPO (per prompt) vs EAD (per position), from the same start.

Every arm starts from the same policy, trains the same number of rollout steps on the same
prompts, in the same order, with the same seeds and hyperparameters (GRPO, the quickstart's
rewards, ``old_logprobs: auto`` with TIS at cap 2, the module's defaults); only the temperature
callback differs:

- ``fixed``: every token at ``sampling.temperature`` = 1.
- ``erpo``: ``AdaptiveTemperature`` (spec §5.1): a prompt whose last group was all correct is
  sampled ``Δ`` hotter, up to ``T_max``, and reset to 1 after a mixed or all-wrong group.
- ``ead``: ``AnnealedTemperature`` (spec §5.2): token ``t`` at ``max(1 + τ_max − e^(t/d_s),
  τ_min)`` for ``t >= c`` (1 before), ``d_s = min(d_0 + α·s, d_max)``.
- ``erpo+ead``: both (a row's temperature times the position's factor).

The regime is one where all-correct groups occur, so that ERPO has something to act on: the
embedded SmolLM2-135M-Instruct after a shared warm-up (``--warmup-steps`` of fixed-temperature
GRPO at lr 2e-5, run once per invocation on the same prompt pool; cold, it mostly copies the
instruction's ``\\boxed{5}`` and nearly every group fails alike), on one-digit addition. In
one measured warm-up (data seed 0, a shared 2-core machine, 222 s) the sampled training
accuracy stayed below 0.2 for 8 steps, reached 0.75 at step 11 and 0.9-1.0 from step 15; a
4-step ``erpo`` run from it had 75% all-correct groups. ERPO keys its history by prompt, so the
training pool is small (``--train-size`` 8 prompts, 4 per step: each prompt is served once in
every two steps); with the data module's default pool (80 one-digit sums) a prompt would
return only after 20 steps. The held-out prompts (``--val-size``) are disjoint from that pool,
and the warm-up trains on the same pool, so nothing held out is ever trained on.

Prints one markdown table per run and one over seeds (mean ± sd) with, over the compared steps:
the share of groups whose *sampled* outcome is all correct (``StepOutput.pass_rate == 1``;
injected rows never count) and all wrong; ``again``: of the groups whose prompt was all correct
at its previous visit in the run, the share all correct again (the groups ERPO samples hotter);
the share with a uniform sampled outcome (``uniform_outcome_frac``) and with zero advantage
(``zero_advantage_frac``, what the update cannot learn from); the sampled training accuracy;
the mean temperature applied (over every sampled completion token, as the engine drew it);
held-out greedy accuracy and pass@k (``--k`` samples per prompt at temperature 1,
``val/pass@k``) before and after; and the wall time of training.

    python benchmarks/temperature.py                    # 3 seeds x 3 arms, ~15 min on 2 cores
    python benchmarks/temperature.py --arms fixed,erpo,ead,erpo+ead --seeds 0,1,2,3,4
    python benchmarks/temperature.py --steps 16 --lr 1e-5
    python benchmarks/temperature.py --start-from DIR    # from your own saved policy, no warm-up
    python benchmarks/temperature.py --policy tiny:0 --warmup-steps 0 --seeds 0 --steps 1 \\
        --prompts 2 --group 4 --max-new-tokens 8 --val-size 4   # seconds: checks the wiring

This script's choices (not the papers'): the task, pool, steps and warm-up above; ERPO's
``Δ = 0.1, T_max = 1.5, on_mixed: reset`` (the callback's and ``configs/adaptive_temperature
.yaml``'s, themselves this project's: the paper's rule is not public); EAD's ``τ_max = 1.2,
τ_min = 0.1`` are the paper's 1.5B values, and ``d_0 = 20, α = 0.5, c = 1`` its lengths
``(200, 5, 10)`` divided by 10, so that the schedule's whole shape lies inside these
completions of ~10-30 tokens: ``τ`` is 1.15 at ``t = 1``, 1 near ``t = 4`` and the floor 0.1
from ``t = 15`` at step 0 (the paper's ``d_0 = 200`` keeps ``τ`` above 1 for the first 36
tokens, so EAD would only heat these completions).
The prompts (split, pool and order) come from ``--data-seed``, the same for every seed; a
seed sets the RNG of sampling (``seed_everything``), reset before each arm's training.

Expected time of the default (an estimate from the smoke runs, not a timed full run, on 2
busy cores with ``OMP_NUM_THREADS=1``): the warm-up ~220 s, then ~7 s per compared step
(completions of ~12 tokens once warm) x 8 steps x 9 runs, plus 12 validations and model
loads: ~15 min.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

from data_strategies import WARMUP_LR, _mean_sd
from guidance import INSTRUCTION

from rlvr_lightning.testing import grouped

ARMS = ("fixed", "erpo", "ead", "erpo+ead")
# Columns averaged over seeds: (key, header, format).
COLUMNS = (
    ("all_correct", "all-correct groups", ".3f"),
    ("all_wrong", "all-wrong groups", ".3f"),
    ("again", "all-correct again", ".3f"),
    ("uniform", "uniform sampled outcome", ".3f"),
    ("zero_adv", "zero-adv groups", ".3f"),
    ("train_acc", "train acc", ".3f"),
    ("mean_t", "mean T", ".3f"),
    ("length", "completion tokens", ".1f"),
    ("before", "val acc before", ".3f"),
    ("after", "val acc after", ".3f"),
    ("pass_before", "pass@k before", ".3f"),
    ("pass_after", "pass@k after", ".3f"),
    ("train_s", "train s", ".0f"),
)


def _recorder() -> Any:
    import torch

    from rlvr_lightning.stages.hooks import RLVRCallback

    class Recorder(RLVRCallback):
        """Keeps each step's metrics, the sampled outcome per group and the temperature of
        every sampled token; listed last, so it sees the rows as the engine drew them (before
        ``π_old`` is recomputed at the base temperature)."""

        def __init__(self) -> None:
            self.metrics: list[dict[str, float]] = []
            self.pass_rates: list[float] = []  # one per group, all steps
            self.last: dict[str, float] = {}  # prompt id -> pass rate at its last visit
            self.solved_before = [0, 0]  # [groups solved at the previous visit, solved again]
            self.temp_sum, self.tokens = 0.0, 0

        def on_after_score(self, trainer, module, scored) -> None:
            rollouts = scored.rollouts
            mask = rollouts.completion_mask.bool()  # [N, T]
            if rollouts.offpolicy_mask is not None:
                mask &= ~rollouts.offpolicy_mask.bool()
            temps = rollouts.token_temperature.to(mask.device)  # [N, T]
            self.temp_sum += float(torch.where(mask, temps, 0.0).sum())
            self.tokens += int(mask.sum())

        def on_step_output(self, trainer, module, output) -> None:
            self.metrics.append(dict(output.metrics))
            for pid, rate in zip(output.prompt_ids, output.pass_rate.tolist(), strict=True):
                self.pass_rates.append(rate)
                if self.last.get(pid, 0.0) >= 1.0:
                    self.solved_before[0] += 1
                    self.solved_before[1] += int(rate >= 1.0)
                self.last[pid] = rate

    return Recorder()


def _arm_callbacks(arm: str, args: argparse.Namespace) -> list[Any]:
    from rlvr_lightning.callbacks import AdaptiveTemperature, AnnealedTemperature

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; use {', '.join(ARMS)}")
    callbacks: list[Any] = []
    if "erpo" in arm.split("+"):
        callbacks.append(
            AdaptiveTemperature(delta=args.erpo_delta, t_max=args.erpo_t_max, on_mixed="reset")
        )
    if "ead" in arm.split("+"):
        ead = dict(tau_max=args.ead_tau_max, tau_min=args.ead_tau_min, d0=args.ead_d0,
                   alpha=args.ead_alpha, c=args.ead_c)  # fmt: skip
        callbacks.append(AnnealedTemperature(**ead))
    return callbacks


def _build(policy: str, args: argparse.Namespace, lr: float) -> tuple[Any, Any]:
    """The module and data module of every run (warm-up and arms alike)."""
    from rlvr_lightning import RLVRDataModule, RLVRModule
    from rlvr_lightning.rewards import answer_accuracy, boxed_accuracy, boxed_format
    from rlvr_lightning.types import Sampling

    module = RLVRModule(
        policy,
        **grouped(
            reward_fns=[boxed_accuracy, boxed_format, answer_accuracy],
            reward_weights=[1.0, 0.25, 0.25],
            accuracy_reward="boxed_accuracy",
            sampling=Sampling(
                max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group
            ),
            val_sampling=Sampling(
                max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.k
            ),
            micro_batch_size=16,
            lr=lr,
        ),
    )
    data = RLVRDataModule(
        source=args.task,
        task_config={"digits": args.digits},
        train_size=args.train_size,
        val_size=args.val_size,
        prompts_per_step=args.prompts,
        val_prompts_per_batch=args.val_size,
        instruction=INSTRUCTION,
        seed=args.data_seed,
    )
    return module, data


def _trainer(steps: int, callbacks: list[Any]) -> Any:
    from rlvr_lightning.testing import quiet_trainer

    return quiet_trainer(precision="bf16-mixed", max_steps=steps, callbacks=callbacks)


def _validate(trainer: Any, module: Any, data: Any, k: int) -> tuple[float, float]:
    """Held-out greedy accuracy and pass@k (NaN when ``k`` is 1)."""
    trainer.limit_val_batches = 1.0
    results = trainer.validate(module, datamodule=data, verbose=False)[0]
    return float(results["val/accuracy"]), float(results.get(f"val/pass@{k}", float("nan")))


def warm_up(args: argparse.Namespace, folder: str) -> str:
    """The shared starting policy: ``--start-from``, or the warm-up exported into ``folder``."""
    import lightning.pytorch as pl
    from rlvr_lightning.callbacks import ExportModel

    if args.start_from:
        return args.start_from
    if args.warmup_steps <= 0:
        return args.policy
    pl.seed_everything(args.data_seed, verbose=False)
    module, data = _build(args.policy, args, WARMUP_LR)
    recorder = _recorder()
    trainer = _trainer(args.warmup_steps, [recorder, ExportModel(dirpath=folder, card=False)])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    acc = " ".join(f"{m['accuracy']:.2f}" for m in recorder.metrics)
    print(
        f"warm-up: {args.warmup_steps} steps in {time.perf_counter() - start:.0f} s; sampled "
        f"train acc per step: {acc}",
        flush=True,
    )
    return folder


def run_arm(
    arm: str, seed: int, start: str, args: argparse.Namespace, before: tuple[float, float] | None
) -> dict[str, Any]:
    """One arm from ``start``; ``before`` = (acc, pass@k) already measured for this seed."""
    import lightning.pytorch as pl

    pl.seed_everything(seed, verbose=False)
    module, data = _build(start, args, args.lr)
    recorder = _recorder()
    trainer = _trainer(args.steps, [*_arm_callbacks(arm, args), recorder])
    if before is None:
        before = _validate(trainer, module, data, args.k)
    pl.seed_everything(seed, verbose=False)  # every arm's training samples from this state
    began = time.perf_counter()
    trainer.fit(module, datamodule=data)
    train_s = time.perf_counter() - began
    after = _validate(trainer, module, data, args.k)
    m, rates = recorder.metrics, recorder.pass_rates
    solved, again = recorder.solved_before
    return {
        "arm": arm,
        "seed": seed,
        "all_correct": statistics.fmean(r >= 1.0 for r in rates),
        "all_wrong": statistics.fmean(r <= 0.0 for r in rates),
        "again": again / solved if solved else float("nan"),
        "again_groups": solved,
        "uniform": statistics.fmean(x["uniform_outcome_frac"] for x in m),
        "zero_adv": statistics.fmean(x["zero_advantage_frac"] for x in m),
        "train_acc": statistics.fmean(x["accuracy"] for x in m),  # the sampled rows only
        "mean_t": recorder.temp_sum / max(recorder.tokens, 1),
        "length": statistics.fmean(x["completion_len"] for x in m),
        "before": before[0],
        "after": after[0],
        "pass_before": before[1],
        "pass_after": after[1],
        "train_s": train_s,
    }


def _print_runs(rows: list[dict[str, Any]]) -> None:
    header = ["arm", "seed", *(h for _, h, _ in COLUMNS)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = [r["arm"], str(r["seed"])]
        cells += [format(r[key], fmt) for key, _, fmt in COLUMNS]
        cells[header.index("all-correct again")] += f" ({r['again_groups']})"
        print("| " + " | ".join(cells) + " |")


def _print_over_seeds(arms: list[str], rows: list[dict[str, Any]]) -> None:
    header = ["arm", *(h for _, h, _ in COLUMNS)]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for arm in arms:
        runs = [r for r in rows if r["arm"] == arm]
        cells = [arm]
        for key, _, fmt in COLUMNS:
            values = [r[key] for r in runs if r[key] == r[key]]  # NaN-free (`again` may be)
            cells.append(_mean_sd(values, fmt) if values else "-")
        print("| " + " | ".join(cells) + " |")


def _report(args: argparse.Namespace, arms: list[str], rows: list[dict[str, Any]]) -> None:
    start = f"after {args.warmup_steps} warm-up steps" if args.warmup_steps > 0 else "cold"
    start = f"from {args.start_from}" if args.start_from else f"{args.policy}, {start}"
    print(
        f"\n{args.task} ({args.digits} digit(s)), {args.steps} rollout steps x {args.prompts} "
        f"prompts x G={args.group} from a pool of {args.train_size}, {args.max_new_tokens} new "
        f"tokens, lr {args.lr:g}, seeds {args.seeds}; {start}; validation: {args.val_size} "
        f"held-out prompts, greedy acc and pass@{args.k} at T = 1. Group shares are over all "
        "compared steps' groups; 'all-correct again' (groups): of groups whose prompt was all "
        "correct at its previous visit.\n\nper run:\n"
    )
    _print_runs(rows)
    print("\nover seeds (mean ± sd):\n")
    _print_over_seeds(arms, rows)


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="fixed,erpo,ead", help=f"comma-separated: {', '.join(ARMS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; one run per arm each")
    p.add_argument("--steps", type=int, default=8, help="rollout steps per arm")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--train-size", type=int, default=8, help="the training prompt pool")
    p.add_argument("--val-size", type=int, default=20, help="held-out prompts")
    p.add_argument("--k", type=int, default=4, help="validation pass@k samples (T = 1)")
    p.add_argument("--lr", type=float, default=2e-5, help="learning rate of the compared runs")
    p.add_argument("--task", default="addition", help="addition or multiplication")
    p.add_argument("--digits", type=int, default=1)
    p.add_argument("--data-seed", type=int, default=0, help="split, pool and prompt order")
    p.add_argument("--warmup-steps", type=int, default=20, help="shared warm-up (0: cold)")
    p.add_argument("--start-from", help="a saved policy folder to start from (no warm-up)")
    p.add_argument("--policy", default="embedded:smollm2-135m-instruct", help="base policy")
    p.add_argument("--erpo-delta", type=float, default=0.1)
    p.add_argument("--erpo-t-max", type=float, default=1.5)
    p.add_argument("--ead-tau-max", type=float, default=1.2)
    p.add_argument("--ead-tau-min", type=float, default=0.1)
    p.add_argument("--ead-d0", type=float, default=20.0)
    p.add_argument("--ead-alpha", type=float, default=0.5)
    p.add_argument("--ead-c", type=int, default=1)
    return p.parse_args()


def main() -> None:
    args = _parse_args()
    arms, seeds = args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    for arm in arms:
        _arm_callbacks(arm, args)  # an unknown arm fails before any training
    rows: list[dict[str, Any]] = []
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlvr-temperature-") as folder:
        start = warm_up(args, folder)
        for seed in seeds:  # seed-major, so a cut-short sweep still compares like with like
            before = None  # same start, seed and held-out prompts: measured once per seed
            for arm in arms:
                row = run_arm(arm, seed, start, args, before)
                before = (row["before"], row["pass_before"])
                rows.append(row)
                print(f"done {arm} seed {seed}: {row}", flush=True)
    _report(args, arms, rows)
    print(
        f"\ntotal wall time {time.perf_counter() - began:.0f} s (warm-up and validations included)"
    )


if __name__ == "__main__":
    main()
