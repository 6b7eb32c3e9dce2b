"""Generated tokens/s of a rollout engine vs raw ``model.generate`` at the same batch.

    python benchmarks/generation.py                          # HF engine vs raw generate
    python benchmarks/generation.py --engines hf,raw,vllm    # with vllm installed

Both sides get the same left-padded prompts (``prompts`` one-digit addition questions, each
repeated ``group`` times), ``max_new_tokens``, temperature 1 and the same model weights. Only
real tokens count: each completion up to and including its first EOS. Sides alternate within
every repetition; the median tokens/s of each and the ratio to raw ``generate`` are printed.
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

INSTRUCTION = "Put the final answer in \\boxed{}."


def _prompts(module, n: int):
    from rlvr_lightning.data.prompts import to_messages
    from rlvr_lightning.data.tasks import addition_examples
    from rlvr_lightning.types import PromptBatch

    train, _ = addition_examples(1, train_size=n, val_size=2, seed=0)
    batch = PromptBatch(
        [str(i) for i in range(n)],
        [to_messages(e.prompt, None, INSTRUCTION) for e in train],
        {},
    )
    return module.encode_prompts(batch)


def raw_generate(model, tokenizer, eos_ids, ids, mask, sampling) -> int:
    """Plain ``model.generate`` on the repeated prompts; returns the real tokens generated."""
    from rlvr_lightning.rollout.hf import completion_mask

    g = sampling.group_size
    out = model.generate(
        input_ids=ids.repeat_interleave(g, 0),
        attention_mask=mask.repeat_interleave(g, 0),
        do_sample=True,
        temperature=1.0,
        top_k=None,
        top_p=None,
        max_new_tokens=sampling.max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
    )
    return int(completion_mask(out[:, ids.shape[1] :], eos_ids).sum())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", default="hf,raw", help="comma list of hf, raw, vllm")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args(argv)

    from rlvr_lightning import RLVRModule
    from rlvr_lightning.models import embedded_model_path
    from rlvr_lightning.types import Sampling

    torch.manual_seed(0)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=1.0, group_size=args.group)
    module = RLVRModule(sampling=sampling)
    module.policy.eval()
    ids, mask = _prompts(module, args.prompts)
    engines = args.engines.split(",")
    vllm_engine = None
    if "vllm" in engines:
        from rlvr_lightning.rollout.vllm import VLLMEngine

        dtype = "bfloat16" if args.precision == "bf16" else "float32"
        vllm_engine = VLLMEngine(str(embedded_model_path()), module.tokenizer, dtype=dtype)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    )

    def run(name: str) -> tuple[int, float]:
        start = time.perf_counter()
        with torch.no_grad(), autocast:
            if name == "raw":
                tokens = raw_generate(
                    module.policy, module.tokenizer, module.engine.eos_ids, ids, mask, sampling
                )
            else:
                engine = vllm_engine if name == "vllm" else module.engine
                tokens = int(engine.generate(ids, mask, sampling).lengths.sum())
        return tokens, time.perf_counter() - start

    for name in engines:  # warm-up: first calls pay one-off costs
        run(name)
    rates: dict[str, list[float]] = {n: [] for n in engines}
    for rep in range(args.reps):
        for name in engines if rep % 2 == 0 else engines[::-1]:
            tokens, seconds = run(name)
            rates[name].append(tokens / seconds)
            rate = tokens / seconds
            print(f"rep {rep} {name:<5} {tokens:>5} tokens {seconds:6.2f} s {rate:7.1f} tok/s")
    print(
        f"\n{args.prompts} prompts x {args.group} completions, {args.max_new_tokens} new tokens, "
        f"{args.precision}, {args.reps} reps (median tokens/s)"
    )
    medians = {n: statistics.median(r) for n, r in rates.items()}
    for name, rate in medians.items():
        ratio = f"  {rate / medians['raw']:.2f}x raw generate" if "raw" in medians else ""
        print(f"{name:<5} {rate:7.1f} tok/s{ratio}")


if __name__ == "__main__":
    main()
