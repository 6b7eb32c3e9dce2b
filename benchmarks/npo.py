"""Plain GRPO vs NPO at fixed steps vs AutoNPO, from the same start.

Reuses ``guidance.py``'s run (embedded SmolLM2-135M-Instruct, two-digit addition, same seed,
prompts, steps and hyperparameters); only the callback differs:

- ``grpo``: no guidance.
- ``npo``: ``NearFuturePolicyGuidance(mode=lookahead)``: at step ``--at`` the run looks
  ``--delta`` steps ahead, then guides failing groups (sampled accuracy < 0.6) for the rest of
  the run. (The paper's manual NPO picks the intervention steps by hand, as here; its guide is
  the look-ahead checkpoint, which this arm builds in-run instead of loading a file.)
- ``autonpo``: ``mode=auto``: reward-plateau / entropy-collapse triggers over ``--window``
  steps, ``Δ`` from ``--candidates`` by ``S = Q / V`` on the mistake pool.

Prints held-out greedy accuracy before and after, mean sampled training accuracy and the wall
time of training (which includes the look-ahead steps).

    python benchmarks/npo.py --steps 6              # ~10 min on 2 cores
    python benchmarks/npo.py --steps 20 --seeds 0,1,2
    python benchmarks/npo.py --digits 1 --steps 14 --at 6 --delta 4 --candidates 2,4 --window 3
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import guidance


def _arm_callbacks(arm: str, args: argparse.Namespace) -> tuple[list[Any], str]:
    from rlvr_lightning.callbacks import NearFuturePolicyGuidance

    rest = max(args.steps - args.at, 1)
    match arm:
        case "grpo":
            return [], "shaping"
        case "npo":
            cb = NearFuturePolicyGuidance(
                mode="lookahead", intervene_at=[args.at], lookahead=args.delta, duration=rest
            )
            return [cb], "shaping"
        case "autonpo":
            candidates = [int(c) for c in args.candidates.split(",")]
            cb = NearFuturePolicyGuidance(
                mode="auto", candidates=candidates, window=args.window, min_gap=args.steps,
                duration=rest, min_reward_gain=0.01,
            )  # fmt: skip
            return [cb], "shaping"
    raise ValueError(f"unknown arm {arm!r}; use grpo, npo or autonpo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", default="grpo,npo,autonpo")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--at", type=int, default=1, help="npo: the intervention's start step")
    parser.add_argument("--delta", type=int, default=2, help="npo: steps looked ahead")
    parser.add_argument("--candidates", default="1,2", help="autonpo: the Δ grid")
    parser.add_argument("--window", type=int, default=1, help="autonpo: trigger window")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--val-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--seeds", default="0")
    parser.add_argument(
        "--digits", type=int, default=2, help="1: the model learns within ~15 steps cold"
    )
    args = parser.parse_args()
    guidance._arm_callbacks = lambda arm: _arm_callbacks(arm, args)  # the arms of this study
    results = guidance.sweep(args, guidance.run_arm)
    print(
        f"\n{args.steps} steps x {args.prompts} prompts x G={args.group}, "
        f"{args.max_new_tokens} new tokens, lr {args.lr}, seeds {args.seeds}, "
        f"{args.val_size} held-out {args.digits}-digit sums (greedy)\n"
    )
    print("| arm | val acc before | val acc after | train acc | wall s |")
    print("|---|---|---|---|---|")
    for arm, rows in results.items():
        mean = {k: statistics.fmean(r[k] for r in rows) for k in ("before", "after")}
        acc = statistics.fmean(r["train_accuracy"] for r in rows)
        wall = statistics.fmean(r["train_s"] for r in rows)
        print(f"| {arm} | {mean['before']:.3f} | {mean['after']:.3f} | {acc:.3f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
