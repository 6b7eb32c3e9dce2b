"""The update's passes with completions in length buckets (``shared_prompts.length_buckets``) vs one
completion pass per micro-batch padded to its longest row.

    python benchmarks/length_buckets.py --prompts 8 --group 8 --max-new-tokens 64 --reps 3
    python benchmarks/length_buckets.py --precision bf16 ...

One batch is sampled from the embedded model (HF engine, one-digit addition, temperature 1,
seeded); both sides then run forward + backward of the mean token log-prob over the same
micro-batches of ``--micro`` rows (whole groups, as the update forms them), in the given
precision (``bf16``: autocast with the weights cast once, as the trainer runs it). The
log-probs of both sides are checked to agree. Sides alternate within every repetition after
one warm-up each; the tokens each side runs (completion rows x their pass's longest row) and
the median times and their ratio are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack

import torch
from generation import _prompts


def _update_pass(policy, rollouts, micros, pass_tokens) -> tuple[float, torch.Tensor]:
    """Seconds of one forward + backward of the mean token log-prob over ``micros``, and the
    log-probs ``[N, T]``."""
    from rlvr_lightning.device.forward import completion_forward

    logps = torch.zeros(rollouts.completion_mask.shape)
    start = time.perf_counter()
    for idx in micros:
        mask = rollouts.completion_mask[idx].float()  # [m, T]
        logp = completion_forward(
            policy,
            rollouts.prompt_ids[idx],
            rollouts.prompt_mask[idx],
            rollouts.completion_ids[idx],
            rollouts.completion_mask[idx],
            rollouts.temperature[idx],
            bucket_pass_tokens=pass_tokens,
        ).logp  # [m, T]
        (-(logp * mask).sum() / mask.sum()).backward()
        logps[idx] = logp.detach().float()
    policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start, logps


def _tokens_run(lengths: torch.Tensor, micros, pass_tokens) -> int:
    """Completion tokens fed (rows x the longest row of their pass), as ``completion_forward``
    runs them."""
    from rlvr_lightning.device.shared_prompts import length_buckets

    total = 0
    for idx in micros:
        ls = lengths[idx]
        buckets = (
            [torch.arange(len(ls))] if pass_tokens is None else length_buckets(ls, pass_tokens)
        )
        total += sum(len(b) * max(int(ls[b].max()) - 1, 0) for b in buckets)
    return total


def precision_context(precision: str) -> ExitStack:
    """bf16: autocast with the weights cast once, as the module's update runs; fp32: nothing."""
    from rlvr_lightning.device import weights_cast_once

    stack = ExitStack()
    if precision == "bf16":
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
        stack.enter_context(weights_cast_once("cpu"))
    return stack


def _fixed_batch(args: argparse.Namespace):
    """The embedded model, one generated batch of rollouts and its micro-batches (printed)."""
    from rlvr_lightning import RLVRModule
    from rlvr_lightning.device.forward import group_microbatches
    from rlvr_lightning.device.shared_prompts import BUCKET_PASS_TOKENS
    from rlvr_lightning.types import Sampling

    pass_tokens = BUCKET_PASS_TOKENS if args.pass_tokens is None else args.pass_tokens
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group)
    module = RLVRModule(sampling=sampling)
    ids, mask = _prompts(module, args.prompts)
    torch.manual_seed(0)
    module.policy.eval()
    with torch.no_grad():
        rollouts = module.engine.generate(ids, mask, sampling)
    module.policy.train()
    lengths = rollouts.completion_mask.sum(-1)  # [N]
    groups = torch.arange(len(lengths)) // args.group  # [N]
    micros = group_microbatches(groups, args.micro)
    print(
        f"completion lengths: mean {lengths.float().mean():.1f}, max {int(lengths.max())}; "
        f"prompt tokens {int(ids.shape[1])}; precision {args.precision}"
    )

    return module, rollouts, micros, pass_tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--pass-tokens", type=int, default=None, help="default: BUCKET_PASS_TOKENS")
    args = p.parse_args(argv)

    module, rollouts, micros, pass_tokens = _fixed_batch(args)
    lengths = rollouts.completion_mask.sum(-1)  # [N]

    sides = {"one pass": None, "buckets": pass_tokens}
    for name, tokens in sides.items():
        print(f"{name:<9} completion tokens run {_tokens_run(lengths, micros, tokens)}")
    real = int((lengths - 1).clamp(min=0).sum())
    print(f"real completion tokens {real} (+ 1 per row from the prompt pass)")

    def update(name: str):
        with precision_context(args.precision):
            return _update_pass(module.policy, rollouts, micros, sides[name])

    first = {name: update(name)[1] for name in sides}  # warm-up
    m = rollouts.completion_mask > 0
    gap = (first["one pass"][m] - first["buckets"][m]).abs().max()
    print(f"max |log-prob difference| between the sides: {float(gap):.2e}")
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        for name in sides if rep % 2 == 0 else list(sides)[::-1]:
            seconds = update(name)[0]
            times.setdefault(name, []).append(seconds)
            print(f"rep {rep} {name:<9} update {seconds:6.2f} s")
    base, new = (statistics.median(times[name]) for name in sides)
    print(f"update: one pass {base:6.2f} s  buckets {new:6.2f} s  ratio {new / base:.2f}x")


if __name__ == "__main__":
    main()
