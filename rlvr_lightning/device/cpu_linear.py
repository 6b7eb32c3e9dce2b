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
where MKL's sgemm is as fast (issue 40's Intel Xeon made TRL's MKL-bound fp32 step 1.3x
faster than this AMD CPU did), torch's path stays. bf16/fp16 products with autograd stay on
torch's matmul, which is oneDNN's bf16 matmul already (bit-equal to ``_linear_pointwise`` in
bf16, measured here) and uses AVX512-BF16 or AMX where the CPU has them; no-grad ones may use
packed weights (:func:`packed_weights`).
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
    # Asked first inside a bf16 autocast block (a validation before training) too: compare fp32.
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        try:
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
    """``F.linear(x, weight, bias)``; through oneDNN when :func:`usable` (fp32) or on a
    packed weight (:func:`packed_weights`, low precision without grad)."""
    if not usable(x, weight):
        packed = _prepacked(x, weight, bias) if _packing["dtype"] is not None else None
        return F.linear(x, weight, bias) if packed is None else packed
    if not torch.is_grad_enabled() or not (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        flat = x.reshape(-1, x.shape[-1])
        return mm_nt(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
    return _Linear.apply(x, weight, bias)


# No-grad products in bf16/fp16 while the weights are fixed (``packed_weights``): torch's matmul
# (oneDNN's, which reorders the weight into its blocked layout on every call) or oneDNN's linear
# kernel on a weight reordered once per block (``prepacked``), as measured (``NOGRAD_PATH``).
NOGRAD_PATH = "linear.nograd"
PACK_ROWS = 64  # the row count oneDNN prepares a packed weight for: decoding's 8 x 8 rows
_packing: dict[str, object] = {"dtype": None, "weights": {}}


@contextmanager
def packed_weights(dtype: torch.dtype) -> Iterator[None]:
    """Within: no-grad products computed in ``dtype`` (autocast's) may use a copy of each weight
    packed once for oneDNN, where measured faster. The weights must not change inside (a
    weight modified in place is packed again, by its version counter)."""
    saved = dict(_packing)
    _packing.update(dtype=dtype, weights={})
    try:
        yield
    finally:
        _packing.clear()
        _packing.update(saved)


def _prepacked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``F.linear`` under autocast without grad, on a packed copy of ``weight``; None where
    this route does not apply (outside ``packed_weights``, another dtype, not chosen)."""
    dtype = _packing["dtype"]
    if (
        dtype is None
        or torch.is_grad_enabled()
        or x.device.type != "cpu"
        or not torch.is_autocast_enabled("cpu")
        or torch.get_autocast_dtype("cpu") != dtype
        or not available()
        or fast_paths.choice(NOGRAD_PATH, dtype) != "prepacked"
    ):
        return None
    store = _packing["weights"]
    version, packed = store.get(id(weight), (None, None))
    if version != weight._version:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), PACK_ROWS)
        store[id(weight)] = (weight._version, packed)
    flat = x.reshape(-1, x.shape[-1]).to(dtype)  # [m, k]
    b = None if bias is None else bias.to(dtype)
    with torch.autocast("cpu", enabled=False):
        out = torch.ops.mkldnn._linear_pointwise(flat, packed, b, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


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


def _nograd_trial(shapes: fast_paths.ModelShapes, dtype: torch.dtype) -> fast_paths.Trial:
    """torch's low-precision product against oneDNN's on a packed weight, ``PACK_ROWS`` rows
    (packing is not timed: it happens once per block of decoding steps)."""
    if not available() or dtype == torch.float32:
        return fast_paths.Trial(tolerance=0.0, pieces=[])
    gen = torch.Generator().manual_seed(0)
    pieces = []
    for k, n, count in shapes.linears:
        x, w = (torch.randn(*s, generator=gen).to(dtype) for s in ((PACK_ROWS, k), (n, k)))
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
        works = {
            "torch": lambda x=x, w=w: (x @ w.t(),),
            "prepacked": lambda x=x, p=packed: (
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
            ),
        }
        pieces.append((float(count), works))
    # Both accumulate in fp32 and round once to bf16/fp16: ~1 unit of the last place apart.
    return fast_paths.Trial(tolerance=1e-2, pieces=pieces)


fast_paths.register("linear", "torch", _trial)
fast_paths.register(NOGRAD_PATH, "torch", _nograd_trial)
