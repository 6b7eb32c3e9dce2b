"""What the update needs from the Lightning strategy to keep data-parallel ranks in step.

Every rank must enter the same collectives in the same order: DDP all-reduces gradients inside
a backward, and the data module gathers observations after the step. A rank whose groups were
all filtered still trains (on zero rows) rather than skipping, so the module asks these
questions of the strategy and hands ``PolicyUpdate`` plain callables (it stays free of
Lightning).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Literal

import torch
from lightning.pytorch.strategies import Strategy


def over_ranks(
    strategy: Strategy, value: float, op: Literal["mean", "max"], device: torch.device
) -> float:
    """``value`` reduced over all ranks (the value itself on a single process)."""
    if getattr(strategy, "world_size", 1) == 1:
        return float(value)
    # float64: a token count stays exact; NCCL and gloo both reduce it.
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    return float(strategy.reduce(tensor, reduce_op=op))


def no_backward_sync(strategy: Strategy) -> AbstractContextManager:
    """A context in which a backward accumulates gradients without DDP's all-reduce (a no-op
    for strategies that do not all-reduce in the backward)."""
    block = getattr(strategy, "block_backward_sync", None)
    return block() if block is not None else nullcontext()
