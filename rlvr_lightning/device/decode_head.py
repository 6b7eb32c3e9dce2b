"""The LM head while decoding in fp32 on the CPU: ``W @ h^T`` in vocabulary blocks, or one
oneDNN product where that kernel is there (``cpu_linear``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rlvr_lightning.device import cpu_linear
from rlvr_lightning.device.forward import fused_head

# Vocabulary rows of the LM head per matmul while decoding in fp32 (this project's choice).
HEAD_BLOCK = 4096


def head_by_blocks(weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor):
    """``F.linear(hidden, weight, bias)`` as ``weight @ hidden^T``, ``HEAD_BLOCK`` vocabulary
    rows at a time: at decoding's 16-64 rows the fp32 ``[n, H] x [H, V]`` product runs far
    below the cores' peak (measured 16-30 ms at 16-64 rows against 11-26 ms this way, the
    embedded model's 49152 x 576 head).

    Where oneDNN's fp32 kernel is there (``cpu_linear``) it computes the whole product instead:
    10.6 ms against 24.3 in blocks at 64 rows, 5.2 against 9.8 at 16.

    Args:
        weight: ``[V, H]``; bias: ``[V]`` or None; hidden: ``[..., H]``.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])  # [n, H]
    if cpu_linear.usable(flat, weight):
        return cpu_linear.mm_nt(flat, weight, bias).view(*hidden.shape[:-1], -1)
    out = flat.new_empty(weight.shape[0], flat.shape[0])  # [V, n]
    for start in range(0, weight.shape[0], HEAD_BLOCK):
        rows = slice(start, start + HEAD_BLOCK)
        torch.mm(weight[rows], flat.t(), out=out[rows])
    logits = out.t() if bias is None else out.t() + bias  # [n, V]
    return logits.contiguous().view(*hidden.shape[:-1], -1)


@contextmanager
def fp32_head_by_blocks(model: nn.Module) -> Iterator[None]:
    """Within: the model's LM head computes with ``head_by_blocks`` when it is a plain
    ``nn.Linear`` (``forward.fused_head``) in fp32 on the CPU without autocast; otherwise
    (bf16 matmuls, GPUs, LoRA heads) nothing changes. For no-grad decoding only."""
    head = fused_head(model)
    device = None if head is None else head.weight.device.type
    if (
        head is None
        or device != "cpu"
        or head.weight.dtype != torch.float32
        or torch.is_autocast_enabled(device)
    ):
        yield
        return
    head.forward = lambda hidden: head_by_blocks(head.weight, head.bias, hidden)
    try:
        yield
    finally:
        del head.forward
