"""Forward+backward time of the update's micro-batches: whole groups in prompt order vs
groups ordered by their longest completion (``group_microbatches(..., lengths)``), for one or
more micro-batch sizes.

    python benchmarks/update_padding.py --prompts 8 --group 8 --max-new-tokens 64 --reps 3
    python benchmarks/update_padding.py --micro 16,64 --precision bf16

One rollout batch of one-digit addition is sampled once from the embedded model (temperature 1);
both sides then run the same rows through ``completion_forward`` and a backward of the mean
token log-prob, in micro-batches of ``--micro`` rows, alternating within every repetition after
one warm-up pass each. Printed: padded completion tokens (rows x longest row, summed over the
micro-batches), real tokens, and the median seconds per pass of each side and its ratio to the
first side (the first micro-batch size, groups in prompt order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from generation import _prompts  # benchmarks/ is on sys.path when run as a script


def _pass(module, rollouts, micros, autocast) -> float:
    from rlvr_lightning.forward import completion_forward

    start = time.perf_counter()
    for idx in micros:
        mask = rollouts.completion_mask[idx].float()  # [m, T]
        with autocast:
            logp = completion_forward(
                module.policy,
                rollouts.prompt_ids[idx],
                rollouts.prompt_mask[idx],
                rollouts.completion_ids[idx],
                rollouts.completion_mask[idx],
                rollouts.temperature[idx],
            ).logp  # [m, T]
        (-(logp * mask).sum() / mask.sum()).backward()
    module.policy.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro", default="16", help="comma list of micro-batch sizes (rows)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args(argv)

    from rlvr_lightning import RLVRModule
    from rlvr_lightning.forward import group_microbatches
    from rlvr_lightning.types import Sampling

    torch.manual_seed(0)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group)
    module = RLVRModule(sampling=sampling)
    ids, mask = _prompts(module, args.prompts)
    module.policy.eval()
    with torch.no_grad():
        rollouts = module.engine.generate(ids, mask, sampling)
    module.policy.train()
    lengths = rollouts.completion_mask.sum(-1)  # [N]
    groups = torch.arange(len(lengths)) // args.group  # [N]
    sides = {}
    for size in map(int, args.micro.split(",")):
        sides[f"{size} by group"] = group_microbatches(groups, size)
        sides[f"{size} by length"] = group_microbatches(groups, size, lengths)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    )
    print(f"completion lengths: mean {lengths.float().mean():.1f}, max {int(lengths.max())}")
    for name, micros in sides.items():
        padded = sum(len(m) * int(lengths[m].max()) for m in micros)
        print(f"{name:<14} padded tokens {padded:>5} (real {int(lengths.sum())})")
        _pass(module, rollouts, micros, autocast)  # warm-up
    times: dict[str, list[float]] = {n: [] for n in sides}
    for rep in range(args.reps):
        for name in sides if rep % 2 == 0 else list(sides)[::-1]:
            times[name].append(_pass(module, rollouts, sides[name], autocast))
            print(f"rep {rep} {name:<14} {times[name][-1]:6.2f} s")
    base = statistics.median(next(iter(times.values())))
    for name, ts in times.items():
        print(
            f"{name:<14} median {statistics.median(ts):6.2f} s  {statistics.median(ts) / base:.2f}x"
        )


if __name__ == "__main__":
    main()
