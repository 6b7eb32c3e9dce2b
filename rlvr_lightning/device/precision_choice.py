"""fp32 or bf16 for a run, chosen by timing the update's products on the model's shapes.

Path ``"precision"`` of ``fast_paths``: candidate ``"32-true"`` (the reference) computes each
linear layer's three products of an update (``x W^T``, ``g W``, ``g^T x``) in fp32 through the
product the ``"linear"`` path chose on this machine (MKL or oneDNN); ``"bf16-mixed"`` casts the
operands to bf16 first, as autocast does, and multiplies there (oneDNN's bf16 kernels, which
use AMX or AVX512-BF16 where the CPU has them). bf16 is kept only when it is ``MIN_GAIN``
faster and its products agree with fp32's within ``TOLERANCE``. Lightning's precision names are
the candidates, so the choice is what ``trainer.precision`` takes. Whether bf16 *learns* as well
is not something a product can show: the quickstart's six-run table (README) is that check.
"""

from __future__ import annotations

import torch
from torch import nn

from rlvr_lightning.device import cpu_linear, fast_paths

PATH = "precision"
REFERENCE, BF16 = "32-true", "bf16-mixed"
# bf16 keeps 8 bits of mantissa: inputs round by up to 2^-9 relative, and a product of a few
# hundred terms (accumulated in fp32) lands within ~1% of the largest fp32 value; 5% allows a
# kernel's blocking, and still refuses a wrong kernel (this project's choice).
TOLERANCE = 5e-2


def choose(model: nn.Module) -> str:
    """``"bf16-mixed"`` or ``"32-true"`` for ``model`` on this machine: measured once (cached
    per machine, libraries and shapes); ``"32-true"`` when nothing can be measured (no
    transformers config, ``RLVR_FAST_PATHS=reference``)."""
    fast_paths.use_shapes(fast_paths.ModelShapes.of(model))
    return fast_paths.choice(PATH, torch.float32)


def _fp32_products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if cpu_linear.available() and fast_paths.choice("linear", torch.float32) == "onednn":
        mm = cpu_linear.mm_nt
        return mm(x, w), mm(g, w.t()), mm(g.t(), x.t())
    return x @ w.t(), g @ w, g.t() @ x


def _bf16_products(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xb, wb, gb = x.bfloat16(), w.bfloat16(), g.bfloat16()
    return xb @ wb.t(), gb @ wb, gb.t() @ xb


def _trial(shapes: fast_paths.ModelShapes, dtype: torch.dtype) -> fast_paths.Trial:
    """Both precisions' products on every linear shape, ``MEASURE_TOKENS`` rows."""
    gen = torch.Generator().manual_seed(0)
    m, pieces = cpu_linear.MEASURE_TOKENS, []
    for k, n, count in shapes.linears:
        x, w, g = (torch.randn(*s, generator=gen) for s in ((m, k), (n, k), (m, n)))
        works = {
            REFERENCE: lambda x=x, w=w, g=g: _fp32_products(x, w, g),
            BF16: lambda x=x, w=w, g=g: _bf16_products(x, w, g),
        }
        pieces.append((float(count), works))
    return fast_paths.Trial(tolerance=TOLERANCE, pieces=pieces)


fast_paths.register(PATH, REFERENCE, _trial)
