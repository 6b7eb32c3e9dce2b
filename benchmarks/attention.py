"""Generation and update time with ``transformers``' SDPA attention vs ``rlvr_grouped``
(``rlvr_lightning.device.attention``), same model, batch and precision.

    python benchmarks/attention.py --precision bf16 --reps 3
    python benchmarks/attention.py --precision fp32 --reps 3

One policy (the embedded model) switches its attention implementation between the sides. Per
repetition and side: one HF-engine rollout of ``prompts`` x ``group`` completions (one-digit
addition, temperature 1, ``max_new_tokens``; tokens/s over real tokens), then forward +
backward of the mean token log-prob over one fixed batch in micro-batches of ``micro`` rows
(the update's passes, length buckets included). ``bf16``: autocast with the weights cast once,
as the trainer runs it. Sides alternate after one warm-up each; medians and ratios are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack

import torch
from generation import _prompts
from length_buckets import _update_pass, precision_context


def _print_summary(results: dict[str, list[tuple[float, float]]], sides: list[str]) -> None:
    """Medians of generation speed and update time, SDPA against the grouped attention."""
    (base_tok, base_upd), (new_tok, new_upd) = (
        (statistics.median(r[0] for r in results[n]), statistics.median(r[1] for r in results[n]))
        for n in sides
    )
    print(
        f"generation: sdpa {base_tok:.1f} tok/s, rlvr_grouped {new_tok:.1f} tok/s "
        f"({new_tok / base_tok:.2f}x)\nupdate: sdpa {base_upd:.2f} s, rlvr_grouped "
        f"{new_upd:.2f} s ({new_upd / base_upd:.2f}x the time)"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    args = p.parse_args(argv)

    from rlvr_lightning import RLVRModule
    from rlvr_lightning.device import attention
    from rlvr_lightning.device.forward import group_microbatches
    from rlvr_lightning.device.shared_prompts import BUCKET_PASS_TOKENS
    from rlvr_lightning.types import Sampling

    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group)
    module = RLVRModule(sampling=sampling)
    policy = module.policy
    ids, mask = _prompts(module, args.prompts)

    def context() -> ExitStack:
        return precision_context(args.precision)

    torch.manual_seed(0)
    policy.eval()
    with torch.no_grad(), context():
        batch = module.engine.generate(ids, mask, sampling)  # the update's fixed batch
    micros = group_microbatches(torch.arange(batch.num_rows) // args.group, args.micro)
    lengths = batch.completion_mask.sum(-1).float()
    print(
        f"{args.precision}; update batch: {batch.num_rows} rows, mean completion "
        f"{lengths.mean():.1f} tokens, micro-batches of {args.micro}"
    )

    def measure(name: str) -> tuple[float, float]:
        policy.set_attn_implementation(name)
        policy.eval()
        with torch.no_grad(), context():
            start = time.perf_counter()
            out = module.engine.generate(ids, mask, sampling)
            tok_s = float(out.completion_mask.sum()) / (time.perf_counter() - start)
        policy.train()
        with context():
            update_s = _update_pass(policy, batch, micros, BUCKET_PASS_TOKENS)[0]
        return tok_s, update_s

    attention.register()
    sides = ["sdpa", attention.NAME]
    for name in sides:
        measure(name)  # warm-up
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for rep in range(args.reps):
        for name in sides if rep % 2 == 0 else sides[::-1]:
            tok_s, update_s = measure(name)
            results[name].append((tok_s, update_s))
            print(f"rep {rep} {name:<13} generation {tok_s:6.1f} tok/s  update {update_s:6.2f} s")
    _print_summary(results, sides)


if __name__ == "__main__":
    main()
