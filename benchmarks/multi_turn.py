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
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from cli_runs import fit, mean_sd

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
    overrides = [
        f"--seed_everything={seed}", f"--trainer.max_steps={args.steps}",
        f"--data.init_args.val_size={args.val_size}",
        f"--data.init_args.val_prompts_per_batch={args.val_size}", *extra, *args.set,
    ]  # fmt: skip
    series, wall = fit(config, folder / f"{variant}-{seed}", overrides)
    metrics = summarise(series)
    metrics["wall_s"] = wall
    return metrics


def summarise(series: dict[str, list[float]]) -> dict[str, float]:
    """The run's numbers: validation before (first row) and after (last row), training means."""
    nan = float("nan")

    def mean(key: str, default: float = nan) -> float:
        return statistics.fmean(series[key]) if series.get(key) else default

    val = series.get("val/accuracy", [])
    first = series.get("val/first_turn_accuracy", [])
    trained = series.get("train/multiturn/tokens_trained", [])
    seen = series.get("train/multiturn/tokens_seen", [])
    return {
        "val_before": val[0] if val else nan,
        "val_after": val[-1] if val else nan,
        "first_turn_after": first[-1] if first else (val[-1] if val else nan),
        "turns": mean("train/multiturn/turns", 1.0),
        "tool_calls": mean("train/multiturn/tool_calls", 0.0),
        "trained_share": sum(trained) / sum(seen) if seen else 1.0,
        "step_s": mean("train/step_time_s"),
    }


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
