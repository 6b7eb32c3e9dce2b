"""Peak memory and time of a forward+backward of the log-prob loss: chunked LM head vs full logits.

    python benchmarks/head_memory.py                          # 16 rows x 128 completion tokens
    python benchmarks/head_memory.py --shapes 16x128,32x200 --reps 2

The embedded SmolLM2-135M-Instruct (V = 49152), fp32 (``--precision bf16``: bf16 autocast),
``rows`` completions of ``tokens`` random tokens after ``group``-shared random prompts of
``prompt_tokens`` tokens, loss ``-mean(log p)`` over every completion token through
``forward.completion_logprobs``; ``fused`` uses ``head_chunk_tokens=--chunk``, ``unfused``
the model's full logits. Each measurement is a fresh process; the sides alternate within every
repetition.

Memory: a worker runs one warm-up step (so the gradient buffers exist and the kernels are
built), zeroes the gradients, returns freed heap memory to the OS (glibc ``malloc_trim``),
resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` = 5, which resets ``ru_maxrss``
too) and runs the timed step; the figure is the step's peak RSS (``getrusage(RUSAGE_SELF)
.ru_maxrss``) minus the RSS just before it. Without the reset, ``ru_maxrss`` would keep the
peak of model loading and the warm-up; where the reset is refused, the figure is the peak
since process start minus the RSS after loading (an upper bound of the same thing).
``--warmup 0`` skips the warm-up: the step then also allocates the gradients (~0.5 GiB, both
sides alike) and builds the kernels. A worker's address space is capped at ``--max-gib``, so a
side that does not fit fails with an allocation error instead of waking the OOM killer.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULT_TAG = "RESULT "
SIDES = ("fused", "unfused")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB


def _reset_peak() -> bool:
    """Return freed heap to the OS and reset the peak-RSS mark; False where refused."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _inputs(rows: int, group: int, prompt_tokens: int, tokens: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (max(rows // group, 1), prompt_tokens), generator=gen)
    prompt_ids = prompts.repeat_interleave(group, 0)[:rows]  # [n, p]
    completion_ids = torch.randint(0, vocab, (rows, tokens), generator=gen)  # [n, t]
    ones = torch.ones_like
    return prompt_ids, ones(prompt_ids), completion_ids, ones(completion_ids), torch.ones(rows)


def run_worker(args: argparse.Namespace) -> None:
    """One side in this process: load, warm up, then the measured step(s)."""
    from contextlib import nullcontext

    import torch

    from rlvr_lightning import models
    from rlvr_lightning.device.forward import completion_logprobs

    cap = int(args.max_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(args.threads)
    model, _ = models.load_policy(models.EMBEDDED_DEFAULT, "float32")
    model.train()
    inputs = _inputs(
        args.rows, args.group, args.prompt_tokens, args.tokens, model.config.vocab_size
    )
    chunk = args.chunk if args.worker == "fused" else None
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()
    )
    loaded_rss = _rss_mib()

    def step() -> None:
        with autocast:
            logp, _ = completion_logprobs(model, *inputs, head_chunk_tokens=chunk)  # [n, t]
            loss = -logp.mean()
        loss.backward()

    for _ in range(args.warmup):
        step()
    model.zero_grad(set_to_none=False)
    times, peaks, reset = [], [], True
    for _ in range(args.steps):
        reset = _reset_peak() and reset
        before = _rss_mib() if reset else loaded_rss
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        peaks.append(_peak_rss_mib() - before)
        model.zero_grad(set_to_none=False)
    print(RESULT_TAG + json.dumps({"step_s": times, "peak_mib": peaks, "reset": reset}))


def _run_side(side: str, shape: tuple[int, int], args: argparse.Namespace) -> dict[str, Any]:
    rows, tokens = shape
    flags = [
        f"--rows={rows}",
        f"--tokens={tokens}",
        *(
            f"--{k.replace('_', '-')}={getattr(args, k)}"
            for k in (
                "group",
                "prompt_tokens",
                "chunk",
                "precision",
                "threads",
                "warmup",
                "steps",
                "max_gib",
            )
        ),
    ]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if out.returncode != 0 or not lines:
        sys.stderr.write(out.stderr[-4000:])
        return {"failed": f"exit code {out.returncode}"}
    return json.loads(lines[-1][len(RESULT_TAG) :])


def _shape(text: str) -> tuple[int, int]:
    rows, tokens = text.lower().split("x")
    return int(rows), int(tokens)


def _medians(runs: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Median peak MiB and step seconds over the runs that did not fail; None if all did."""
    runs = [r for r in runs if "failed" not in r]
    if not runs:
        return None
    peaks = [p for r in runs for p in r["peak_mib"]]
    return statistics.median(peaks), statistics.median(t for r in runs for t in r["step_s"])


def _table(results: dict[tuple[tuple[int, int], str], list[dict[str, Any]]]) -> str:
    lines = [
        "| rows x tokens | side | peak MiB (median) | step s (median) | peak / unfused | "
        "time / unfused |",
        "|---|---|---|---|---|---|",
    ]
    for shape in sorted({shape for shape, _ in results}):
        medians = {side: _medians(results.get((shape, side), [])) for side in SIDES}
        base = medians["unfused"]
        for side, m in medians.items():
            cells = ["failed", "failed"] if m is None else [f"{m[0]:.0f}", f"{m[1]:.2f}"]
            both = m is not None and base is not None
            cells += [f"{m[0] / base[0]:.2f}", f"{m[1] / base[1]:.2f}"] if both else ["", ""]
            lines.append(f"| {shape[0]} x {shape[1]} | {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="16x128", help="comma list of ROWSxTOKENS")
    p.add_argument("--reps", type=int, default=2, help="fresh processes per side and shape")
    p.add_argument("--group", type=int, default=8, help="rows sharing one prompt")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--chunk", type=int, default=1024, help="head_chunk_tokens of the fused side")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    p.add_argument("--steps", type=int, default=1, help="measured steps per process")
    p.add_argument("--max-gib", type=float, default=16.0, help="address-space cap per worker")
    p.add_argument("--json", help="also write all raw results to this file")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return run_worker(args)
    results: dict[tuple[tuple[int, int], str], list[dict[str, Any]]] = {}
    for shape in map(_shape, args.shapes.split(",")):
        for rep in range(args.reps):
            for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
                r = _run_side(side, shape, args)
                results.setdefault((shape, side), []).append(r)
                print(f"{shape[0]}x{shape[1]} rep {rep} {side:<8} {r}", flush=True)
    print(
        f"\nSmolLM2-135M, {args.precision}, prompts {args.prompt_tokens} tokens shared by "
        f"{args.group} rows, chunk {args.chunk}, {args.threads} threads; peak = step's peak RSS "
        "minus RSS before it; ratios: fused / unfused\n"
    )
    print(_table(results))
    if args.json:
        raw = {f"{s[0]}x{s[1]}/{side}": rs for (s, side), rs in results.items()}
        Path(args.json).write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
