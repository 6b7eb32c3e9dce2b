"""One GRPO step, TRL's ``GRPOTrainer`` vs rlvr-lightning, same model, data, lengths and loss.

Each measurement runs in a fresh subprocess (so peak RSS is that side's alone); sides alternate
within every repetition. A worker trains ``warmup + steps`` optimiser steps and reports the wall
time between consecutive step ends (the warm-up steps are dropped) and its peak RSS.

    python benchmarks/vs_trl.py                     # needs trl: pip install -e '.[bench]'
    python benchmarks/vs_trl.py --sides rlvr,trl,rlvr-vllm --vllm-python .venv-vllm/bin/python

Configuration shared by both sides: the embedded SmolLM2-135M-Instruct, one-digit addition,
``prompts`` x ``group`` completions per step, ``max_new_tokens`` new tokens at temperature 1,
AdamW at the same constant lr, grad-norm clip 1.0, GRPO loss (per-sequence token mean,
group-std advantages, clip 0.2), KL off, rewards ``boxed_accuracy`` + ``boxed_format``,
micro-batches of ``micro`` rows, HF ``generate`` on both sides (``rlvr-vllm``: our vLLM engine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from rlvr_lightning.testing import grouped

INSTRUCTION = "Put the final answer in \\boxed{}."
RESULT_TAG = "RESULT "


def _examples(n: int) -> list[Any]:
    from rlvr_lightning.data.tasks import addition_examples

    train, _ = addition_examples(1, train_size=n, val_size=10, seed=0)
    return train


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB


def _report(side: str, step_ends: list[float], warmup: int, extra: dict[str, Any]) -> None:
    times = [b - a for a, b in itertools.pairwise(step_ends)][warmup:]
    print(
        RESULT_TAG + json.dumps({"side": side, "step_s": times, "rss_gb": _peak_rss_gb(), **extra})
    )


# ---- workers ---------------------------------------------------------------------------------


def _trl_config(args: argparse.Namespace) -> Any:
    """TRL's GRPOConfig for the shared settings (constant lr, no KL, clip 0.2, group-std)."""
    from trl import GRPOConfig

    rollout_rows = args.prompts * args.group
    return GRPOConfig(
        output_dir="outputs/bench_trl",
        use_cpu=True,
        bf16=args.precision == "bf16",
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=rollout_rows // args.micro,
        num_generations=args.group,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        loss_type="grpo",
        scale_rewards="group",
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        max_steps=args.warmup + args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        seed=0,
    )


def run_trl(args: argparse.Namespace) -> None:
    """TRL's GRPOTrainer on the same prompts and rewards."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from rlvr_lightning.data.prompts import to_messages
    from rlvr_lightning.models import embedded_model_path
    from rlvr_lightning.rewards import boxed_accuracy, boxed_format

    def text(c: Any) -> str:
        return c[-1]["content"] if isinstance(c, list) else c

    def accuracy(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
        return boxed_accuracy([text(c) for c in completions], answer=answer)

    def fmt(completions: list[Any], **_: Any) -> list[float | None]:
        return boxed_format([text(c) for c in completions])

    rows = [
        {"prompt": to_messages(e.prompt, None, INSTRUCTION), "answer": e.columns["answer"]}
        for e in _examples(args.prompts * (args.warmup + args.steps))
    ]
    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    config = _trl_config(args)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[accuracy, fmt],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    lengths = [
        h["completions/mean_length"]
        for h in trainer.state.log_history
        if "completions/mean_length" in h
    ]
    _report("trl", ends, args.warmup, {"mean_completion_len": lengths})


def _rlvr_module(args: argparse.Namespace, engine: str) -> Any:
    """The module for the shared settings on the ``hf`` or ``vllm`` engine."""
    from rlvr_lightning import RLVRModule
    from rlvr_lightning.rewards import boxed_accuracy, boxed_format
    from rlvr_lightning.types import Sampling

    engine_kwargs = {
        "dtype": "bfloat16" if args.precision == "bf16" else "float32",
        "kv_cache_gb": 0.5,  # 64 rows x 128 tokens need ~0.2 GiB; vLLM's CPU default is 4
    }
    return RLVRModule(
        "embedded:smollm2-135m-instruct",
        **grouped(
            algorithm="grpo",
            reward_fns=[boxed_accuracy, boxed_format],
            sampling=Sampling(
                max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group
            ),
            micro_batch_size=args.micro,
            lr=args.lr,
            grad_clip=1.0,
            kl_coef=0.0,
            engine=engine,
            engine_kwargs=engine_kwargs if engine == "vllm" else None,
        ),
    )


def run_rlvr(args: argparse.Namespace, engine: str) -> None:
    """rlvr-lightning's Trainer loop on the same prompts and rewards."""
    import lightning.pytorch as pl

    from rlvr_lightning import RLVRDataModule
    from rlvr_lightning.testing import quiet_trainer

    pl.seed_everything(0, verbose=False)
    ends: list[float] = []
    lengths: list[float] = []
    stages: list[dict[str, float]] = []

    class Clock(pl.Callback):
        def on_train_start(self, *a: Any) -> None:
            ends.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, module: Any, *a: Any) -> None:
            ends.append(time.perf_counter())
            lengths.append(module.last_step.metrics["completion_len"])
            stages.append({k: module.last_step.metrics[k] for k in ("gen_time_s", "update_time_s")})

    module = _rlvr_module(args, engine)
    data = RLVRDataModule(
        "addition",
        task_config={"digits": 1},
        instruction=INSTRUCTION,
        prompts_per_step=args.prompts,
        val_size=10,
    )
    trainer = quiet_trainer(
        precision="bf16-mixed" if args.precision == "bf16" else "32-true",
        max_steps=args.warmup + args.steps,
        callbacks=[Clock()],
    )
    trainer.fit(module, datamodule=data)
    _report(
        "rlvr" if engine == "hf" else "rlvr-vllm",
        ends,
        args.warmup,
        {"mean_completion_len": lengths, "stages": stages, "fast_paths": _fast_paths()},
    )


def _fast_paths() -> dict[str, str]:
    """The fast paths this worker ran with: choice, how it was made, each candidate's time."""
    from rlvr_lightning.device import fast_paths

    return {
        key: f"{d.choice} ({d.source}; "
        + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in d.seconds.items())
        + ")"
        for key, d in fast_paths.chosen().items()
    }


# ---- driver ----------------------------------------------------------------------------------


def _worker_cmd(side: str, args: argparse.Namespace) -> list[str]:
    python = args.vllm_python if side == "rlvr-vllm" else sys.executable
    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k
        in {"prompts", "group", "max_new_tokens", "micro", "lr", "warmup", "steps", "precision"}
    ]
    if args.trl_gradient_checkpointing:
        flags.append("--trl-gradient-checkpointing")
    return [python, os.path.abspath(__file__), "--worker", side, *flags]


def _run_side(side: str, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if side == "rlvr-vllm":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    out = subprocess.run(_worker_cmd(side, args), capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stderr[-4000:])
        raise RuntimeError(f"{side} worker failed with exit code {out.returncode}")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sides", default="rlvr,trl", help="comma list of rlvr, trl, rlvr-vllm")
    p.add_argument("--reps", type=int, default=3, help="fresh processes per side")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro", type=int, default=16, help="rows per forward/backward, both sides")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup", type=int, default=1, help="optimiser steps not timed")
    p.add_argument("--steps", type=int, default=2, help="timed optimiser steps per process")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="TRL's own default (GRPOConfig); off by default here because rlvr-lightning does "
        "not checkpoint activations, so both sides compute the same",
    )
    p.add_argument("--vllm-python", default=sys.executable, help="interpreter with vllm installed")
    p.add_argument("--json", help="also write all raw results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def _summary(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]]) -> dict:
    """Print the medians of each side (and their ratios to TRL's); return them."""
    summary = {
        s: {
            "median_step_s": statistics.median(t for r in rs for t in r["step_s"]),
            "median_peak_rss_gb": statistics.median(r["rss_gb"] for r in rs),
            "mean_completion_len": statistics.mean(x for r in rs for x in r["mean_completion_len"]),
        }
        for s, rs in results.items()
    }
    print(
        f"\n{args.prompts} prompts x {args.group} completions, {args.max_new_tokens} new tokens, "
        f"{args.precision}, micro-batch {args.micro}, {args.reps} reps x {args.steps} timed steps"
    )
    print(f"{'side':<10} {'median step s':>14} {'peak RSS GiB':>13} {'mean len':>9}")
    for s, m in summary.items():
        print(
            f"{s:<10} {m['median_step_s']:>14.2f} {m['median_peak_rss_gb']:>13.2f} "
            f"{m['mean_completion_len']:>9.1f}"
        )
    for s, rs in results.items():
        for r in rs[:1]:  # the same machine and cache: every rep reads the same choices
            for key, text in r.get("fast_paths", {}).items():
                print(f"{s} fast path {key}: {text}")
    if "trl" in summary:
        base = summary["trl"]
        for s, m in summary.items():
            if s != "trl":
                print(
                    f"{s} / trl: step time {m['median_step_s'] / base['median_step_s']:.2f}x, "
                    f"peak memory {m['median_peak_rss_gb'] / base['median_peak_rss_gb']:.2f}x"
                )
    return summary


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker == "trl":
        return run_trl(args)
    if args.worker in ("rlvr", "rlvr-vllm"):
        return run_rlvr(args, "hf" if args.worker == "rlvr" else "vllm")

    sides = args.sides.split(",")
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for rep in range(args.reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            r = _run_side(side, args)
            results[side].append(r)
            print(
                f"rep {rep} {side:<10} step_s {[round(t, 2) for t in r['step_s']]} "
                f"peak_rss {r['rss_gb']:.2f} GiB",
                flush=True,
            )
    summary = _summary(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
