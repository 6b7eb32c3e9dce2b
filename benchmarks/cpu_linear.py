"""fp32 matmul on the CPU: torch's own (MKL sgemm) vs oneDNN's kernel (``cpu_linear.mm_nt``),
on the embedded model's shapes, side by side in one process.

    python benchmarks/cpu_linear.py --rows 640 --reps 20

Products: a projection's forward ``x @ W^T``, its input gradient ``g @ W`` and weight gradient
``g^T @ x`` (the backward's two products, oneDNN taking the transposed views as they are), for
the attention (576 -> 576, 576 -> 192), MLP (576 <-> 1536) and the LM head in 4096-row blocks
(576 -> 4096); and one decoding step's LM head (``--decode-rows`` x 576 -> 49152, MKL as
``rollout.decode_head.head_by_blocks`` computes it without oneDNN). Each line alternates the sides
``--reps`` times after a warm-up and prints GFLOP/s (medians), the speed-up and the largest
difference between the two results relative to the largest value (fp32 rounding: ~1e-6).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlvr_lightning.device import cpu_linear, decode_head

SHAPES = {"q/o 576x576": (576, 576), "k/v 576x192": (576, 192), "gate/up 576x1536": (576, 1536)}
SHAPES |= {"down 1536x576": (1536, 576), "head block 576x4096": (576, 4096)}


def _seconds(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _line(name: str, flops: float, mkl, dnn, reps: int) -> None:
    times = {"mkl": [], "dnn": []}
    for _ in range(reps):  # alternate the sides
        times["mkl"] += _seconds(mkl, 1)
        times["dnn"] += _seconds(dnn, 1)
    a, b = (flops / statistics.median(times[k]) / 1e9 for k in ("mkl", "dnn"))
    want, got = mkl(), dnn()
    diff = float((want - got).abs().max() / want.abs().max())
    print(f"{name:32s} {a:8.0f} {b:8.0f} {b / a:7.2f}x {diff:10.1e}")


def _projection_lines(name: str, x, w, g, reps: int) -> None:
    """Forward, input-gradient and weight-gradient products of one projection."""
    flops = 2.0 * x.shape[0] * x.shape[1] * w.shape[0]
    _line(f"{name} fwd", flops, lambda: x @ w.t(), lambda: cpu_linear.mm_nt(x, w), reps)
    _line(f"{name} grad in", flops, lambda: g @ w, lambda: cpu_linear.mm_nt(g, w.t()), reps)
    _line(f"{name} grad W", flops, lambda: g.t() @ x, lambda: cpu_linear.mm_nt(g.t(), x.t()), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=640, help="tokens of one micro-batch")
    parser.add_argument("--decode-rows", type=int, default=64, help="rows decoding at once")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    if not cpu_linear.available():
        raise SystemExit("This torch build has no oneDNN linear kernel: nothing to compare.")
    gen = torch.Generator().manual_seed(0)
    m = args.rows
    print(f"{torch.get_num_threads()} threads, {m} rows; GFLOP/s (median of {args.reps})")
    print(f"{'product':32s} {'MKL':>8s} {'oneDNN':>8s} {'speed-up':>8s} {'rel diff':>10s}")
    for name, (k, n) in SHAPES.items():
        x, w, g = (torch.randn(*s, generator=gen) for s in ((m, k), (n, k), (m, n)))
        _projection_lines(name, x, w, g, args.reps)
    w = torch.randn(49152, 576, generator=gen)
    h = torch.randn(args.decode_rows, 576, generator=gen)
    flops = 2.0 * h.shape[0] * 576 * 49152
    available = cpu_linear.available
    try:
        cpu_linear.available = lambda: False  # head_by_blocks' MKL blocks
        mkl_head = decode_head.head_by_blocks(w, None, h)
        blocks = _seconds(lambda: decode_head.head_by_blocks(w, None, h), args.reps)
    finally:
        cpu_linear.available = available
    dnn = _seconds(lambda: cpu_linear.mm_nt(h, w), args.reps)
    a, b = (flops / statistics.median(t) / 1e9 for t in (blocks, dnn))
    diff = float((mkl_head - cpu_linear.mm_nt(h, w)).abs().max() / mkl_head.abs().max())
    name = f"decode head {h.shape[0]}x576x49152"
    print(f"{name:32s} {a:8.0f} {b:8.0f} {b / a:7.2f}x {diff:10.1e}")


if __name__ == "__main__":
    main()
