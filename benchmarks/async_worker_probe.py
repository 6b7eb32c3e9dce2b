"""Does a rollout worker PROCESS (its own copy of the HF policy, weights pushed after each
update) pay on this CPU, against the in-process schedule that takes turns?

Per round, on the embedded SmolLM2-135M-Instruct in fp32: the in-process schedule generates
a round with the project's HF engine, then runs one update (forward, backward and AdamW step
on the round's rows); the worker schedule pushes the weights to a spawned process (through
shared memory), which generates the next round while this process runs the update. Prints the
stage times and both schedules' seconds per round, with both processes at the given torch
thread counts.

    python benchmarks/async_worker_probe.py                      # 3 rounds of 4 x 8 rows
    python benchmarks/async_worker_probe.py --threads 1 --rounds 5 --prompts 8
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from rlvr_lightning.models import EMBEDDED_DEFAULT, load_policy
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.types import Sampling

SAMPLING = Sampling(max_new_tokens=32, temperature=1.0, group_size=8)


def prompts(tokenizer: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` one-digit additions through the chat template: ``([n, P] ids, [n, P] mask)``."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + {i + 2}? Answer in \\boxed{{}}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(n)
    ]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def generate(engine: HFEngine, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return engine.generate(ids, mask, SAMPLING, None).completion_ids  # [N, T]


def update(model: Any, opt: Any, ids: torch.Tensor, completions: torch.Tensor) -> None:
    """One forward, backward and AdamW step on the round's rows (a stand-in for the loss)."""
    rows = torch.cat([ids.repeat_interleave(SAMPLING.group_size, 0), completions], 1)  # [N, P+T]
    hidden = model.model(rows).last_hidden_state[:, ids.shape[1] - 1 : -1]  # [N, T, H]
    logits = model.lm_head(hidden)  # [N, T, V]: the completion positions only
    loss = -logits.log_softmax(-1).gather(-1, completions[..., None]).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def worker(inbox: Any, outbox: Any, threads: int, n: int) -> None:
    """The worker process: load pushed weights, generate, send the tokens back."""
    torch.set_num_threads(threads)
    model, tokenizer = load_policy(EMBEDDED_DEFAULT)
    engine = HFEngine(model, tokenizer)
    ids, mask = prompts(tokenizer, n)
    outbox.put("ready")
    while (weights := inbox.get()) is not None:
        model.load_state_dict(weights)
        outbox.put(generate(engine, ids, mask))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--prompts", type=int, default=4, help="prompts per round (8 rows each)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load_policy(EMBEDDED_DEFAULT)
    engine, opt = HFEngine(model, tokenizer), torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids, mask = prompts(tokenizer, args.prompts)
    gen, upd = [], []
    completions = generate(engine, ids, mask)  # warm-up
    for _ in range(args.rounds):  # in-process: take turns
        t0 = time.perf_counter()
        completions = generate(engine, ids, mask)
        t1 = time.perf_counter()
        update(model, opt, ids, completions)
        gen.append(t1 - t0)
        upd.append(time.perf_counter() - t1)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=worker, args=(inbox, outbox, args.threads, args.prompts))
    child.start()
    outbox.get()
    shared = {k: v.detach().clone().share_memory_() for k, v in model.state_dict().items()}
    inbox.put(shared)
    outbox.get()  # the worker's warm-up round
    push, overlap = [], []
    for _ in range(args.rounds):  # worker: generate round r+1 while round r updates
        t0 = time.perf_counter()
        for name, tensor in model.state_dict().items():
            shared[name].copy_(tensor)
        push.append(time.perf_counter() - t0)
        inbox.put(shared)
        update(model, opt, ids, completions)
        completions = outbox.get()
        overlap.append(time.perf_counter() - t0)
    inbox.put(None)
    child.join()
    med = statistics.median
    print(f"threads per process: {args.threads}, rounds: {args.rounds} (medians, seconds)")
    print(f"generate {med(gen):.2f}  update {med(upd):.2f}  push {med(push):.3f}")
    print(f"in-process (turns): {med(g + u for g, u in zip(gen, upd, strict=True)):.2f} / round")
    print(f"worker process (overlap): {med(overlap):.2f} / round")


if __name__ == "__main__":
    main()
