"""Single-turn GRPO vs multi-turn rollouts (execution feedback, a calculator tool), side by side.

Same embedded model, steps and seeds for every variant; each run is the shipped config through
the CLI in its own subprocess, one after the other:

- ``single@2``: ``configs/execution_feedback.yaml`` with ``multiturn.max_turns: 1`` and no
  environment (plain GRPO on two-digit sums);
- ``feedback@2``: the config as shipped (up to 3 attempts, "not correct" feedback between);
- ``single@3``: ``configs/tool_calculator.yaml`` without tools (plain GRPO, three-digit sums);
- ``calculator@3``: the config as shipped (a calculator tool, up to 3 turns).

Printed per variant (mean ± sd over seeds): held-out accuracy before and after training (final
answer: the last turn's), the first-turn accuracy after (the first attempt alone), turns per
trajectory and tool calls per trajectory in training, tokens trained / tokens seen, and the mean
step time. MURPHY's claim to look for: ``feedback@2``'s final accuracy above ``single@2``'s at the
same steps (its first-turn accuracy says whether the first attempt itself improved).

    python benchmarks/multi_turn.py                        # 3 seeds x 4 variants, ~1 h on 2 cores
    python benchmarks/multi_turn.py --seeds 0 --steps 4 --val-size 8   # a quick look
    python benchmarks/multi_turn.py --variants single@2,feedback@2
    python benchmarks/multi_turn.py --set='--data.init_args.task_config={digits: 1}'  # easier sums
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "single@2": (
        "execution_feedback.yaml",
        ["--model.init_args.multiturn.environment=null", "--model.init_args.multiturn.max_turns=1"],
    ),
    "feedback@2": ("execution_feedback.yaml", []),
    "single@3": (
        "tool_calculator.yaml",
        ["--model.init_args.multiturn.tools=null", "--model.init_args.multiturn.max_turns=1"],
    ),
    "calculator@3": ("tool_calculator.yaml", []),
}


def run(variant: str, seed: int, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """One fit through the CLI; its logged metrics, read back from the CSV logger."""
    config, extra = VARIANTS[variant]
    root = folder / f"{variant}-{seed}"
    cmd = [
        sys.executable, "-m", "rlvr_lightning.cli.command", "fit",
        "--config", str(ROOT / "configs" / config),
        f"--seed_everything={seed}", f"--trainer.max_steps={args.steps}",
        f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
        f"--data.init_args.val_size={args.val_size}",
        f"--data.init_args.val_prompts_per_batch={args.val_size}", *extra, *args.set,
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root.parent)
    if done.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed:\n{done.stderr[-3000:]}")
    metrics = read_metrics(root)
    metrics["wall_s"] = time.perf_counter() - start
    return metrics


def read_metrics(root: Path) -> dict[str, float]:
    """The run's numbers: validation before (first row) and after (last row), training means."""
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) not in (None, "")]

    def mean(key: str) -> float:
        values = series(key)
        return statistics.fmean(values) if values else float("nan")

    val = series("val/accuracy")
    first = series("val/first_turn_accuracy")
    trained, seen = series("train/multiturn/tokens_trained"), series("train/multiturn/tokens_seen")
    return {
        "val_before": val[0] if val else float("nan"),
        "val_after": val[-1] if val else float("nan"),
        "first_turn_after": first[-1] if first else (val[-1] if val else float("nan")),
        "turns": mean("train/multiturn/turns") if series("train/multiturn/turns") else 1.0,
        "tool_calls": mean("train/multiturn/tool_calls") if trained else 0.0,
        "trained_share": sum(trained) / sum(seen) if seen else 1.0,
        "step_s": mean("train/step_time_s"),
    }


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


COLUMNS = ("val_before", "val_after", "first_turn_after", "turns", "tool_calls",
           "trained_share", "step_s")  # fmt: skip


def report(results: dict[str, list[dict[str, float]]]) -> None:
    print("| variant | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for variant, runs in results.items():
        cells = [mean_sd([r[c] for r in runs]) for c in COLUMNS]
        print(f"| {variant} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--val-size", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a CLI override for every run, e.g. --set='--data.init_args.task_config={digits: 1}'",
    )  # fmt: skip
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="multi-turn-bench-") as tmp:
        for variant in args.variants.split(","):
            for seed in seeds:
                metrics = run(variant, seed, args, Path(tmp))
                print(f"{variant} seed {seed}: {metrics}", flush=True)
                results.setdefault(variant, []).append(metrics)
    report(results)


if __name__ == "__main__":
    main()
