"""fp32 linear layers through oneDNN on the CPU, where measured faster than torch's own.

torch runs an fp32 matmul on the CPU with MKL's sgemm. On this project's machine (AMD EPYC,
AVX-512) that reaches 195-230 GFLOP/s, where oneDNN's fp32 kernels, the ones torch's own
compiler calls (``torch.ops.mkldnn._linear_pointwise``), reach 380-510 GFLOP/s on the same
shapes: the forward product and both backward products (``benchmarks/README.md``). bf16 and
fp16 matmuls go to oneDNN already. :func:`install` routes a model's plain ``nn.Linear`` layers
through :func:`linear`, which uses oneDNN only for fp32 tensors on the CPU outside autocast
and ``F.linear`` otherwise; the results are fp32 products summed in another order (they agree
with ``F.linear`` to fp32 rounding, not bit for bit).

Which one runs is measured (``fast_paths``, path ``"linear"`` in fp32): torch's own products
(the reference) against oneDNN's on the prepared model's linear shapes at ``MEASURE_TOKENS``
rows, the forward and both backward products, each shape counted once per layer. On a CPU
where MKL's sgemm is as fast (measured on an Intel Xeon with AMX: the gap closes), torch's
path stays.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from rlvr_lightning.device import fast_paths

# Rows of the products timed when choosing (this project's choice: an eighth of a 16-row
# micro-batch of 64-token completions, so that the timing costs well under a second).
MEASURE_TOKENS = 128


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN's linear kernel and it computes ``F.linear``."""
    if not torch.backends.mkldnn.is_available():
        return False
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return False
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=gen) for s in ((5, 7), (3, 7), (3,)))
    try:
        with torch.no_grad():
            got = op(x, w, b, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


_off = 0  # depth of `disabled()` blocks


@contextmanager
def disabled() -> Iterator[None]:
    """Within: :func:`linear` is ``F.linear`` (checks that compare against ``F.linear``)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes the oneDNN path for these operands (fp32 on the CPU outside
    autocast, and measured faster: ``fast_paths``). :func:`available` (which
    runs oneDNN once) is asked only for fp32 CPU work: a first fp32 oneDNN call changes how
    later bf16 matmuls run (measured: other bf16 results, +0.15 GiB peak in ``vs_trl.py``), so
    a bf16 run never makes one."""
    return (
        not _off
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and available()
        and fast_paths.choice("linear", torch.float32) == "onednn"
    )


def mm_nt(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for 2-D fp32 CPU tensors (``a`` ``[m, k]``, ``b`` ``[n, k]``; strided
    views such as ``x.t()`` are taken as they are), through oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """``F.linear`` with every product through oneDNN; keeps ``x`` and ``weight``, as autograd."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        flat = x.reshape(-1, x.shape[-1])  # [m, k]
        ctx.save_for_backward(flat, weight)
        ctx.has_bias, ctx.shape = bias is not None, x.shape
        return mm_nt(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        flat, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g = grad.reshape(-1, grad.shape[-1])  # [m, n]
        grad_x = mm_nt(g, weight.t()).view(ctx.shape) if need_x else None  # g @ W
        grad_w = mm_nt(g.t(), flat.t()) if need_w else None  # g^T @ x: [n, k]
        grad_b = g.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear(x, weight, bias)``; through oneDNN when :func:`usable`."""
    if not usable(x, weight):
        return F.linear(x, weight, bias)
    if not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        flat = x.reshape(-1, x.shape[-1])
        return mm_nt(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return _Linear.apply(x, weight, bias)


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def install(model: nn.Module) -> int:
    """Route every plain ``nn.Linear`` of ``model`` (exact type, no forward of its own) through
    :func:`linear`; returns how many (without oneDNN they compute ``F.linear``). The LM head is
    left alone: ``chunked_head`` and the decoding loop compute it themselves (through
    :func:`linear` / :func:`mm_nt`), and ``forward.fused_head`` bypasses only an untouched head.
    """
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and module is not head and "forward" not in vars(module):
            module.forward = functools.partial(_forward, module)
            switched += 1
    return switched


def _trial(shapes: fast_paths.ModelShapes, dtype: torch.dtype) -> fast_paths.Trial:
    """torch's products against oneDNN's on each linear shape: ``x W^T``, ``g W``, ``g^T x``."""
    gen = torch.Generator().manual_seed(0)
    m, pieces = MEASURE_TOKENS, []
    for k, n, count in shapes.linears:
        x, w, g = (torch.randn(*s, generator=gen).to(dtype) for s in ((m, k), (n, k), (m, n)))
        works = {
            "torch": lambda x=x, w=w, g=g: (x @ w.t(), g @ w, g.t() @ x),
            "onednn": lambda x=x, w=w, g=g: (mm_nt(x, w), mm_nt(g, w.t()), mm_nt(g.t(), x.t())),
        }
        pieces.append((float(count), works))
    # fp32 sums of <= a few thousand products in another order differ by ~1e-6 relative.
    return fast_paths.Trial(tolerance=1e-4, pieces=pieces)


fast_paths.register("linear", "torch", _trial)
