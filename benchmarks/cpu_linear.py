"""CPU matmul candidates on the embedded model's update shapes, against the machine's peak.

    python benchmarks/cpu_linear.py                    # 1024 rows: a 16-row x 64-token micro-batch
    python benchmarks/cpu_linear.py --rows 640 --reps 20

Candidates, each product timed on the same operands: torch's fp32 matmul (MKL's sgemm in the
PyPI build), oneDNN's fp32 kernel (``cpu_linear.mm_nt``), torch's bf16 matmul (oneDNN's bf16
matmul, which uses AVX512-BF16 or AMX where the CPU has them) and oneDNN's bf16 linear kernel
called directly. Products: a projection's forward ``x @ W^T``, its input gradient ``g @ W`` and
weight gradient ``g^T @ x`` for the attention (576 -> 576, 576 -> 192), MLP (576 <-> 1536) and
the LM head in 4096-row blocks (576 -> 4096), and one decoding step's LM head
(``--decode-rows`` x 576 -> 49152, torch's fp32 side as ``decode_head.head_by_blocks``
computes it without oneDNN). Each line alternates the candidates ``--reps`` times after a
warm-up and prints GFLOP/s (medians) and, last, the largest difference of oneDNN's fp32 result
from torch's relative to the largest value (fp32 rounding: ~1e-6).

The peak estimate (printed first) is cores x clock x FLOP per cycle per core: cores as torch
uses them (``torch.get_num_threads()``), the clock from ``lscpu``'s "CPU max MHz" (else
``/proc/cpuinfo``'s "cpu MHz", the current clock), fp32 FLOP/cycle = 2 (an FMA) x vector lanes
(16 with ``avx512f``, 8 with ``avx2``, else 4) x ``--fma-units`` (2 by default: most
AVX-512 server cores have two FMA pipes; some have one). bf16: 1024 FLOP/cycle/core with
``amx_bf16`` (Intel's figure for AMX), twice fp32 with ``avx512_bf16`` (a dot product of two bf16
pairs per fp32 lane), else fp32's. An upper bound: memory and the clock under load lower it.

Last, the fast-path measurement itself (``fast_paths``, as a run makes it on first use): the
linear choice's candidate times on the embedded shapes, the choice, and what measuring cost.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from rlvr_lightning.device import cpu_linear, decode_head, fast_paths

SHAPES = {"q/o 576x576": (576, 576), "k/v 576x192": (576, 192), "gate/up 576x1536": (576, 1536)}
SHAPES |= {"down 1536x576": (1536, 576), "head block 576x4096": (576, 4096)}
EMBEDDED = fast_paths.ModelShapes(
    linears=((576, 192, 60), (576, 576, 60), (576, 1536, 60), (1536, 576, 30)),
    heads=9,
    kv_heads=3,
    head_dim=64,
)
LINEAR = torch.ops.mkldnn._linear_pointwise


def _cpu_fact(lscpu_key: str, cpuinfo_key: str) -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        out = ""
    found = re.search(rf"^{lscpu_key}:\s*(.+)$", out, re.MULTILINE)
    if found:
        return found.group(1).strip()
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = re.search(rf"^{cpuinfo_key}\s*:\s*(.+)$", info, re.MULTILINE)
    return found.group(1).strip() if found else ""


def peak_estimate(fma_units: int) -> tuple[float, float, str]:
    """``(fp32 GFLOP/s, bf16 GFLOP/s, how)`` from cores, clock and the CPU's flags."""
    cores = torch.get_num_threads()
    mhz = float(_cpu_fact("CPU max MHz", "cpu MHz") or 0.0)
    flags = set(_cpu_fact("Flags", "flags").split())
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    fp32_cycle = 2 * lanes * fma_units
    if "amx_bf16" in flags:
        bf16_cycle, bf16_how = 1024, "amx_bf16: 1024"
    elif "avx512_bf16" in flags:
        bf16_cycle, bf16_how = 2 * fp32_cycle, f"avx512_bf16: 2 x {fp32_cycle}"
    else:
        bf16_cycle, bf16_how = fp32_cycle, "no bf16 instructions: as fp32"
    ghz = mhz / 1e3
    how = (
        f"{cores} cores x {ghz:.2f} GHz x fp32 {fp32_cycle} FLOP/cycle (2 x {lanes} lanes x "
        f"{fma_units} FMA units), bf16 {bf16_how} FLOP/cycle"
    )
    return cores * ghz * fp32_cycle, cores * ghz * bf16_cycle, how


def _seconds(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _line(name: str, flops: float, sides: dict, reps: int) -> None:
    """One product: each candidate's GFLOP/s (sides alternate) and oneDNN fp32's difference."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(reps):
        for key, fn in sides.items():
            times[key] += _seconds(fn, 1)
    rates = [flops / statistics.median(times[k]) / 1e9 for k in sides]
    want, got = sides["torch fp32"](), sides["oneDNN fp32"]()
    diff = float((want - got).abs().max() / want.abs().max())
    print(f"{name:28s}" + "".join(f" {r:11.0f}" for r in rates) + f" {diff:10.1e}")


def _projection_lines(name: str, x, w, g, reps: int) -> None:
    """Forward, input-gradient and weight-gradient products of one projection, fp32 and bf16."""
    flops = 2.0 * x.shape[0] * x.shape[1] * w.shape[0]
    xb, wb, gb = x.bfloat16(), w.bfloat16(), g.bfloat16()

    def sides(torch_fp32, onednn_fp32, torch_bf16, onednn_bf16) -> dict:
        return {
            "torch fp32": torch_fp32,
            "oneDNN fp32": onednn_fp32,
            "torch bf16": torch_bf16,
            "oneDNN bf16": onednn_bf16,
        }

    def dnn(a, b):
        return lambda: LINEAR(a, b, None, "none", [], "")

    fwd = sides(lambda: x @ w.t(), dnn(x, w), lambda: xb @ wb.t(), dnn(xb, wb))
    grad_in = sides(lambda: g @ w, dnn(g, w.t()), lambda: gb @ wb, dnn(gb, wb.t()))
    grad_w = sides(lambda: g.t() @ x, dnn(g.t(), x.t()), lambda: gb.t() @ xb, dnn(gb.t(), xb.t()))
    _line(f"{name} fwd", flops, fwd, reps)
    _line(f"{name} grad in", flops, grad_in, reps)
    _line(f"{name} grad W", flops, grad_w, reps)


def _decode_line(rows: int, reps: int, gen: torch.Generator) -> None:
    w = torch.randn(49152, 576, generator=gen)
    h = torch.randn(rows, 576, generator=gen)
    wb, hb = w.bfloat16(), h.bfloat16()
    flops = 2.0 * rows * 576 * 49152
    with fast_paths.forced({"linear/float32": "torch"}):  # head_by_blocks' torch blocks
        blocks = _seconds(lambda: decode_head.head_by_blocks(w, None, h), reps)
        torch_head = decode_head.head_by_blocks(w, None, h)
    times = [blocks] + [
        _seconds(fn, reps)
        for fn in (
            lambda: cpu_linear.mm_nt(h, w),
            lambda: hb @ wb.t(),
            lambda: LINEAR(hb, wb, None, "none", [], ""),
        )
    ]
    rates = [flops / statistics.median(t) / 1e9 for t in times]
    diff = float((torch_head - cpu_linear.mm_nt(h, w)).abs().max() / torch_head.abs().max())
    name = f"decode head {rows}x576x49152"
    print(f"{name:28s}" + "".join(f" {r:11.0f}" for r in rates) + f" {diff:10.1e}")


def _measurement_line() -> None:
    """What ``fast_paths`` measures for the linear choice on the embedded shapes, and its cost."""
    start = time.perf_counter()
    trial = cpu_linear._trial(EMBEDDED, torch.float32)
    seconds, errors, steady = fast_paths.run_trial(trial, "torch")
    choice = fast_paths.select("torch", seconds, errors, trial.tolerance)
    cost = time.perf_counter() - start
    times = ", ".join(f"{n} {s * 1e3:.0f} ms" for n, s in seconds.items())
    print(
        f"\nfast path linear/float32 on the embedded shapes ({cpu_linear.MEASURE_TOKENS} rows, "
        f"30 layers): {times} -> {choice}; measuring took {cost:.2f} s"
        + ("" if steady else " (unsteady timings: a run would not cache this choice)")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="tokens of one micro-batch")
    parser.add_argument("--decode-rows", type=int, default=64, help="rows decoding at once")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--fma-units", type=int, default=2, help="FMA pipes per core (peak)")
    args = parser.parse_args()
    if not cpu_linear.available():
        raise SystemExit("This torch build has no oneDNN linear kernel: nothing to compare.")
    fp32_peak, bf16_peak, how = peak_estimate(args.fma_units)
    print(f"peak estimate: fp32 {fp32_peak:.0f} GFLOP/s, bf16 {bf16_peak:.0f} GFLOP/s ({how})")
    gen = torch.Generator().manual_seed(0)
    m = args.rows
    print(f"{torch.get_num_threads()} threads, {m} rows; GFLOP/s (median of {args.reps})")
    heads = ("torch fp32", "oneDNN fp32", "torch bf16", "oneDNN bf16", "fp32 diff")
    print(f"{'product':28s}" + "".join(f" {h:>11s}" for h in heads[:4]) + f" {heads[4]:>10s}")
    for name, (k, n) in SHAPES.items():
        x, w, g = (torch.randn(*s, generator=gen) for s in ((m, k), (n, k), (m, n)))
        _projection_lines(name, x, w, g, args.reps)
    _decode_line(args.decode_rows, args.reps, gen)
    _measurement_line()


if __name__ == "__main__":
    main()
