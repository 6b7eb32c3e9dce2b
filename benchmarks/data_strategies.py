"""Uniform sampling vs online prompt replay vs the variance curriculum, side by side.

Same starting model, task, rewards, seed and number of rollout steps for every strategy; each
runs in its own subprocess, one after the other. Prints per strategy: the fraction of generated
groups whose rewards are all equal (zero advantage), the mean |advantage|, greedy validation
accuracy after training, and wall time.

The starting model is the embedded SmolLM2-135M-Instruct after a shared warm-up
(``--warmup-steps`` of uniform GRPO on one-digit addition at lr 2e-5, run once per invocation).
Cold, the model mostly copies the instruction's ``\\boxed{5}`` example: for ~10 steps nearly
every prompt fails alike, then nearly all succeed, a prompt-independent format jump that no data
strategy addresses. Warm, its pass rates on two-digit sums spread from 0 to 1.

The compared runs train at lr 2e-6 by default. Replay and the curriculum's bank serve a prompt
again because of a pass rate measured one or two steps earlier, which predicts a mixed group
only while the policy changes little between steps: the regime of the replay paper's launch
config (lr 1e-6 on a 1.5B model). At the quickstart's lr 2e-5 this small model has solved a
replayed prompt by the time it returns, and the zero-variance fraction mostly follows how fast
each run learns (``--lr 2e-5``; the README reports both regimes).

    python benchmarks/data_strategies.py                         # 1 seed, ~25 min on 2 cores
    python benchmarks/data_strategies.py --seeds 0,1,2           # three seeds, ~70 min
    python benchmarks/data_strategies.py --lr 2e-5 --seeds 0,1,2  # the fast-learning regime
    python benchmarks/data_strategies.py --task mix --warmup-steps 0 --lr 2e-5  # cold start
    python benchmarks/data_strategies.py --start-from DIR        # from your own saved policy
    python benchmarks/data_strategies.py --steps 4 --warmup-steps 2 --val-size 16  # a quick look

With several seeds it also prints mean ± sd over seeds and the zero-variance rate of fresh
prompts and of prompts served again (replays, bank refills) separately: the second shows the
mechanism directly, while the overall fraction also moves with how fast each run learns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

from rlvr_lightning.data.stats import group_outcome
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.testing import grouped

RESULT_TAG = "RESULT "
WARMUP_LR = 2e-5  # the quickstart's: the format is learnt in ~10 steps
STRATEGIES = ("uniform", "replay", "curriculum")


def _strategies(name: str) -> dict:
    from rlvr_lightning.data.curriculum import VarianceCurriculum
    from rlvr_lightning.data.replay import PromptReplay

    if name == "replay":
        return {"replay": PromptReplay()}  # the released launch config's defaults
    if name == "curriculum":
        return {"curriculum": VarianceCurriculum(kappa_start=0.3, kappa_end=0.6, ramp_steps=20)}
    return {}


def _source(args: argparse.Namespace) -> dict:
    """``--task mix``: one- and two-digit addition, equal weights (easy and hard prompts)."""
    from rlvr_lightning.data import SourceSpec

    if args.task != "mix":
        return {"source": args.task, "task_config": {"digits": args.digits}}
    specs = [SourceSpec("addition", task_config={"digits": d}) for d in (1, 2)]
    return {"source": specs, "train_size": 200}


class Steps(RLVRCallback):
    """Records each rollout step and stops after ``steps`` of them."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.metrics: list[dict[str, float]] = []
        # origin -> [groups, zero-variance groups, of which all correct]
        self.groups = {"again": [0, 0, 0], "fresh": [0, 0, 0]}

    def on_step_output(self, trainer, module, output) -> None:
        self.metrics.append(dict(output.metrics))
        for obs in trainer.datamodule.last_observed:
            counts = self.groups["again" if obs.replayed else "fresh"]
            counts[0] += 1
            counts[1] += int(obs.reward_variance == 0)
            solved = group_outcome(obs.num_correct, obs.group_size) == "all_correct"
            counts[2] += int(obs.reward_variance == 0 and solved)
        if len(self.metrics) >= self.steps:
            trainer.should_stop = True


def _module_and_data(args: argparse.Namespace) -> tuple:
    """The module (answer accuracy + format, G=8, bf16 run) and the data module of a run."""
    from rlvr_lightning import RLVRModule
    from rlvr_lightning.data import RLVRDataModule
    from rlvr_lightning.models import EMBEDDED_DEFAULT
    from rlvr_lightning.rewards import answer_accuracy, boxed_format
    from rlvr_lightning.types import Sampling

    model = RLVRModule(
        **grouped(
            policy=args.policy or EMBEDDED_DEFAULT,
            reward_fns=[answer_accuracy, boxed_format],
            reward_weights=[1.0, 0.25],
            sampling=Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=8),
            val_sampling=Sampling(max_new_tokens=args.max_new_tokens, temperature=0.0),
            micro_batch_size=16,
            lr=args.lr,
        )
    )
    data = RLVRDataModule(
        **_source(args),
        val_size=args.val_size,
        prompts_per_step=8,
        val_prompts_per_batch=args.val_size,
        instruction="Put the final answer in \\boxed{}, for example \\boxed{5}.",
        seed=args.seed,
        **_strategies(args.strategy),
    )
    return model, data


def worker(args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl
    from rlvr_lightning.callbacks import ExportModel

    from rlvr_lightning.testing import quiet_trainer

    pl.seed_everything(args.seed)
    steps = Steps(args.steps)
    callbacks: list[pl.Callback] = [steps]
    if args.export:  # the warm-up run: keep its policy for the strategy runs
        callbacks.append(ExportModel(dirpath=args.export, card=False))
    model, data = _module_and_data(args)
    trainer = quiet_trainer(precision="bf16-mixed", max_steps=10 * args.steps, callbacks=callbacks)
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    train_s = time.perf_counter() - start
    trainer.limit_val_batches = 1.0
    val = trainer.validate(model, datamodule=data, verbose=False)[0]
    m = steps.metrics
    return {
        "strategy": args.strategy,
        "rollout_steps": len(m),
        "optimizer_steps": trainer.global_step,
        "zero_variance_frac": statistics.mean(x["zero_variance_frac"] for x in m),
        "adv_abs_mean": statistics.mean(x["adv_abs_mean"] for x in m),
        "train_accuracy": statistics.mean(x["accuracy"] for x in m),
        "trained_group_frac": statistics.mean(x["trained_group_frac"] for x in m),
        "val_accuracy": float(val["val/accuracy"]),
        "served_again": sum(r.reused for r in data.stats.records.values()),
        "groups": steps.groups,
        "prompts_seen": len(data.stats),
        "train_s": train_s,
    }


def _run(name: str, seed: int, *extra: str, label: str = "") -> dict:
    """One worker subprocess; ``extra`` flags override the command line's (last one wins)."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--strategy", name, "--seed", str(seed)]
    out = subprocess.run([*cmd, *extra], capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith(RESULT_TAG)]
    if out.returncode != 0 or not lines:
        sys.exit(f"{name} (seed {seed}) failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix(RESULT_TAG))
    print(
        f"done: {label or name}, seed {seed}: zero-var {result['zero_variance_frac']:.3f}, "
        f"val acc {result['val_accuracy']:.3f}, {result['train_s']:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    return result


def _warm_up(args: argparse.Namespace, seed: int, folder: str) -> list[str]:
    """Train the shared starting policy into ``folder``; flags that make workers start from it."""
    if args.start_from:
        return ["--policy", args.start_from]
    if args.warmup_steps <= 0:
        return []
    _run("uniform", seed, "--task", "addition", "--digits", "1", "--steps",
         str(args.warmup_steps), "--lr", str(WARMUP_LR), "--export", folder,
         label="warm-up")  # fmt: skip
    return ["--policy", folder]


def _mean_sd(values: list[float], fmt: str = ".3f") -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{statistics.mean(values):{fmt}} ± {statistics.stdev(values):{fmt}}"


def _origin_rate(runs: list[dict], origin: str) -> str:
    """Zero-variance rate of one origin's groups, pooled: ``rate (all-correct part; groups)``."""
    groups, zero, solved = (sum(r["groups"][origin][i] for r in runs) for i in range(3))
    return f"{zero / groups:.3f} ({solved / groups:.3f}; {groups})" if groups else "- (0)"


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="rollout steps per strategy")
    parser.add_argument("--task", default="addition", help="addition, multiplication or mix")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--val-size", type=int, default=30)
    parser.add_argument("--seeds", default="0", help="comma-separated; one run per seed each")
    parser.add_argument("--lr", type=float, default=2e-6, help="learning rate of the compared runs")
    parser.add_argument(
        "--start-from", help="a saved policy folder to compare from (skips the warm-up)"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=16,
        help="shared uniform GRPO steps on one-digit addition before the comparison (0: none)",
    )
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--strategy", help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)  # worker mode
    parser.add_argument("--policy", help=argparse.SUPPRESS)  # worker: start from this folder
    parser.add_argument("--export", help=argparse.SUPPRESS)  # worker: save the policy here
    return parser.parse_args()


def _report(
    args: argparse.Namespace, seeds: list[int], names: list[str], runs: dict[str, list[dict]]
) -> None:
    """Print the per-run table, the over-seeds table and each strategy's ratio to the first."""
    digits = "1 and 2" if args.task == "mix" else args.digits
    start = f"after {args.warmup_steps} warm-up steps" if args.warmup_steps > 0 else "cold"
    start = f"from {args.start_from}" if args.start_from else f"embedded model, {start}"
    print(
        f"\n{args.task} ({digits} digits), {args.steps} rollout steps of 8 prompts x 8 "
        f"completions at lr {args.lr:g}, seeds {args.seeds}, validation: {args.val_size} "
        f"held-out prompts, greedy; {start}"
    )
    print("per run:\n")
    header = ("strategy", "seed", "zero-var groups", "mean |adv|", "train acc", "trained groups",
              "served again", "distinct prompts", "opt steps", "val acc", "wall s")  # fmt: skip
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in names:
        for seed, r in zip(seeds, runs[name], strict=True):
            print(
                f"{name} | {seed} | {r['zero_variance_frac']:.3f} | {r['adv_abs_mean']:.3f} | "
                f"{r['train_accuracy']:.3f} | {r['trained_group_frac']:.3f} | "
                f"{r['served_again']} | {r['prompts_seen']} | "
                f"{r['optimizer_steps']} | {r['val_accuracy']:.3f} | {r['train_s']:.0f}"
            )
    print(
        "\nover seeds (mean ± sd; zero-var by origin pools all runs: rate (all-correct part; "
        "groups)):\n"
    )
    header = ("strategy", "zero-var groups", "mean |adv|", "val acc", "wall s",
              "zero-var: fresh prompts", "zero-var: served again")  # fmt: skip
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in names:
        rs = runs[name]
        print(
            f"{name} | {_mean_sd([r['zero_variance_frac'] for r in rs])} | "
            f"{_mean_sd([r['adv_abs_mean'] for r in rs])} | "
            f"{_mean_sd([r['val_accuracy'] for r in rs])} | "
            f"{_mean_sd([r['train_s'] for r in rs], '.0f')} | "
            f"{_origin_rate(rs, 'fresh')} | {_origin_rate(rs, 'again')}"
        )
    base = names[0]
    for name in names[1:]:
        ratios = [
            r["zero_variance_frac"] / max(b["zero_variance_frac"], 1e-9)
            for r, b in zip(runs[name], runs[base], strict=True)
        ]
        lower = sum(x < 1 for x in ratios)
        print(
            f"{name}: zero-variance fraction {statistics.mean(ratios):.2f}x {base}'s "
            f"(mean of per-seed ratios; lower in {lower} of {len(ratios)} seeds)"
        )


def main() -> None:
    args = _parse_args()
    if args.strategy:
        print(RESULT_TAG + json.dumps(worker(args)), flush=True)
        return
    seeds = [int(x) for x in args.seeds.split(",")]
    names = args.strategies.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="rlvr-warm-") as folder:
        start_from = _warm_up(args, seeds[0], folder)
        for seed in seeds:  # seed-major, so a cut-short sweep still compares like with like
            for name in names:
                runs[name].append(_run(name, seed, *start_from))
    _report(args, seeds, names, runs)


if __name__ == "__main__":
    main()
