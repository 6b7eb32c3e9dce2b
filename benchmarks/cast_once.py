"""bf16 autocast as Lightning runs it (each matmul casts its fp32 weight again) vs weights cast
once per block (``precision.weights_cast_once``), for generation and for the update's passes.

    python benchmarks/cast_once.py --prompts 8 --group 8 --max-new-tokens 64 --reps 3

Both sides run inside ``torch.autocast("cpu", bfloat16, cache_enabled=False)``, Lightning's
``bf16-mixed`` context; "once" adds ``weights_cast_once`` around each generation and each
update pass. Generation: the HF engine on one-digit addition prompts from the same seed, so
both sides decode the same tokens (checked). Update: forward + backward of the mean token
log-prob over micro-batches of ``--micro`` rows of one sampled batch. Sides alternate within
every repetition after one warm-up each; medians and the ratio once / per matmul are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from generation import _prompts


def _update_pass(module, rollouts, micros) -> float:
    """Seconds of one forward + backward of the mean token log-prob over ``micros``."""
    from rlvr_lightning.device.forward import completion_forward

    start = time.perf_counter()
    for idx in micros:
        mask = rollouts.completion_mask[idx].float()  # [m, T]
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
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)

    from rlvr_lightning import RLVRModule
    from rlvr_lightning.device.forward import group_microbatches
    from rlvr_lightning.device.precision import weights_cast_once
    from rlvr_lightning.types import Sampling

    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group)
    module = RLVRModule(sampling=sampling)
    ids, mask = _prompts(module, args.prompts)
    lightning_autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    sides = {"per matmul": nullcontext, "once": lambda: weights_cast_once("cpu")}

    def generate(name: str):
        torch.manual_seed(0)
        module.policy.eval()
        start = time.perf_counter()
        with torch.no_grad(), lightning_autocast, sides[name]():
            rollouts = module.engine.generate(ids, mask, sampling)
        module.policy.train()
        return rollouts, time.perf_counter() - start

    rollouts, _ = generate("per matmul")
    lengths = rollouts.completion_mask.sum(-1)  # [N]
    groups = torch.arange(len(lengths)) // args.group  # [N]
    micros = group_microbatches(groups, args.micro)
    print(f"completion lengths: mean {lengths.float().mean():.1f}, max {int(lengths.max())}")

    def update(name: str) -> float:
        with lightning_autocast, sides[name]():
            return _update_pass(module, rollouts, micros)

    times: dict[tuple[str, str], list[float]] = {}
    for name in sides:  # warm-up, and the same tokens on both sides
        same, _ = generate(name)
        assert torch.equal(same.completion_ids, rollouts.completion_ids), "sides decoded apart"
        update(name)
    for rep in range(args.reps):
        for name in sides if rep % 2 == 0 else list(sides)[::-1]:
            gen_s = generate(name)[1]
            upd_s = update(name)
            times.setdefault(("generation", name), []).append(gen_s)
            times.setdefault(("update", name), []).append(upd_s)
            print(f"rep {rep} {name:<10} generation {gen_s:6.2f} s  update {upd_s:6.2f} s")
    for stage in ("generation", "update"):
        base = statistics.median(times[(stage, "per matmul")])
        once = statistics.median(times[(stage, "once")])
        print(f"{stage:<10} per matmul {base:6.2f} s  once {once:6.2f} s  ratio {once / base:.2f}x")


if __name__ == "__main__":
    main()
