"""Validation metrics (torchmetrics), the pure pass@k estimator and its confidence interval."""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
from torchmetrics import MeanMetric, Metric


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples, ``c`` correct: ``1 - C(n-c, k) / C(n, k)``."""
    if k > n:
        raise ValueError(f"pass@k needs k <= n samples, got k={k}, n={n}.")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_interval(
    total: float, total_sq: float, count: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Normal-approximation confidence interval of a mean of per-prompt values in [0, 1],
    from their sum, sum of squares and count: ``m ± z * s / sqrt(count)`` with ``s`` the
    sample standard deviation (``count - 1`` in the denominator), clipped to [0, 1]; NaN for
    fewer than 2 prompts. Each prompt's unbiased pass@k estimate is independent of the
    others', so their spread carries both the prompt and the sampling variance."""
    if count < 2:
        return math.nan, math.nan
    mean = total / count
    var = max(total_sq - count * mean * mean, 0.0) / (count - 1)
    half = NormalDist().inv_cdf(0.5 + confidence / 2) * math.sqrt(var / count)
    return max(mean - half, 0.0), min(mean + half, 1.0)


class PassAtK(Metric):
    """Mean pass@k over prompts; ``update`` takes a ``[B, n]`` boolean correctness matrix.

    Args:
        k: the ``k`` of pass@k (at most the samples per prompt ``n``).
        confidence: level of the interval of :meth:`summary` (0.95: this project's choice).
    """

    full_state_update = False

    def __init__(self, k: int, confidence: float = 0.95) -> None:
        super().__init__()
        self.k, self.confidence = k, confidence
        for name in ("total", "total_sq", "count", "samples"):
            zero = torch.tensor(0.0, dtype=torch.float64)
            self.add_state(name, default=zero, dist_reduce_fx="sum")

    def update(self, correct: torch.Tensor) -> None:
        n = correct.shape[1]
        for c in correct.sum(-1).tolist():
            estimate = pass_at_k(n, int(c), self.k)
            self.total += estimate
            self.total_sq += estimate * estimate
        self.count += correct.shape[0]
        self.samples += correct.numel()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).float()

    def summary(self) -> dict[str, float]:
        """``ci<level>_low``, ``ci<level>_high``, ``prompts`` and ``samples`` (completions
        scored) of the values so far, gathered over ranks."""
        with self.sync_context(should_unsync=True):
            total, total_sq = float(self.total), float(self.total_sq)
            count, samples = int(self.count), int(self.samples)
        low, high = mean_interval(total, total_sq, count, self.confidence)
        level = round(100 * self.confidence)
        return {
            f"ci{level}_low": low,
            f"ci{level}_high": high,
            "prompts": float(count),
            "samples": float(samples),
        }


class EvalMetrics(torch.nn.Module):
    """Greedy accuracy, mean reward and (with ``k > 1`` samples per prompt) pass@k of one
    evaluation stage, logged as ``<stage>/accuracy``, ``<stage>/reward``, ``<stage>/pass@k``."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.accuracy, self.reward = MeanMetric(), MeanMetric()
        self.pass_at_k = PassAtK(k) if k > 1 else None
