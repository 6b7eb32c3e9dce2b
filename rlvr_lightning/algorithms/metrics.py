"""Validation metrics (torchmetrics) and the pure pass@k estimator."""

from __future__ import annotations

import math

import torch
from torchmetrics import MeanMetric, Metric


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples, ``c`` correct: ``1 - C(n-c, k) / C(n, k)``."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n samples, got k={k}, n={n}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class PassAtK(Metric):
    """Mean pass@k over prompts; ``update`` takes a ``[B, n]`` boolean correctness matrix."""

    full_state_update = False

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.add_state(
            "total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )

    def update(self, correct: torch.Tensor) -> None:
        n = correct.shape[1]
        for c in correct.sum(-1).tolist():
            self.total += pass_at_k(n, int(c), self.k)
        self.count += correct.shape[0]

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).float()


class EvalMetrics(torch.nn.Module):
    """Greedy accuracy, mean reward and (with ``k > 1`` samples per prompt) pass@k of one
    evaluation stage, logged as ``<stage>/accuracy``, ``<stage>/reward``, ``<stage>/pass@k``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.accuracy, self.reward = MeanMetric(), MeanMetric()
        self.pass_at_k = PassAtK(k) if k > 1 else None
