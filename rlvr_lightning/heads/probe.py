"""POISE's probe (spec §7.1): a ridge regression on PCA-reduced hidden states that predicts a
prompt's expected reward, and the cross-rollout baseline built from its predictions.

What is here is the maths: :func:`pca_basis`, :func:`ridge_fit`, :class:`RidgeProbe` (whose
fitted state lives in buffers so that it is saved with a checkpoint), :func:`fit_quality` and
:func:`rows_to_drop` (the FIFO buffer's whole-group eviction). The target and the baseline,
:func:`sibling_mean` and :func:`poise_advantages`, are advantage estimators and live in
``advantages.py`` (re-exported here). ``probe_head.ProbeHead`` wires them into training.
"""

from __future__ import annotations

import torch
from torch import nn

from rlvr_lightning.algorithms.advantages import poise_advantages, sibling_mean

__all__ = [
    "RidgeProbe",
    "fit_quality",
    "pca_basis",
    "poise_advantages",
    "ridge_fit",
    "rows_to_drop",
    "sibling_mean",
]


def pca_basis(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean [D], components [D, k])`` of the top-``k`` principal directions of ``x [M, D]``.

    Components beyond the rank of the centred data (fewer rows than ``k``) are 0, so the shapes
    stay fixed and a fit on few rows still loads into the same buffers.
    """
    x = x.float()  # [M, D]
    mean = x.mean(0)  # [D]
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)  # vh: [r, D]
    components = x.new_zeros(x.shape[1], k)  # [D, k]
    kept = min(k, vh.shape[0])
    components[:, :kept] = vh[:kept].T
    return mean, components


def ridge_fit(x: torch.Tensor, y: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [F], bias [])`` minimising ``|y - x w - b|² + alpha |w|²``; the intercept is
    not penalised (features and target are centred first, as scikit-learn's ``Ridge``)."""
    x, y = x.double(), y.double()  # [M, F], [M]
    x_mean, y_mean = x.mean(0), y.mean()
    xc, yc = x - x_mean, y - y_mean
    gram = xc.T @ xc + alpha * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)  # [F, F]
    weight = torch.linalg.solve(gram, xc.T @ yc)  # [F]
    return weight.float(), (y_mean - x_mean @ weight).float()


class RidgeProbe(nn.Module):
    """``g(z) = clip(w · [PCA_p(h_prompt), PCA_r(h_response), scalars] + b, 0, 1)``.

    Defaults are POISE's Qwen3-4B configuration: 32 prompt and 64 response components,
    ``alpha = 100``, predictions clipped to ``[0, 1]``. Scalars (e.g. mean token entropies)
    enter unscaled.

    Args:
        prompt_dim: width of the prompt hidden-state feature.
        response_dim: width of the response hidden-state feature.
        num_scalars: number of scalar features.
        prompt_pca: principal components kept of the prompt feature.
        response_pca: principal components kept of the response feature.
        alpha: ridge penalty.
        low: predictions are clipped to ``[low, high]`` (POISE: ``[0, 1]``, its rewards being
            correctness); None for both: to the range of the targets of the last fit (this
            project's choice, for weighted rewards whose range is not known in advance).
        high: see ``low``.
    """

    def __init__(
        self,
        prompt_dim: int,
        response_dim: int,
        num_scalars: int,
        *,
        prompt_pca: int = 32,
        response_pca: int = 64,
        alpha: float = 100.0,
        low: float | None = 0.0,
        high: float | None = 1.0,
    ) -> None:
        super().__init__()
        if (low is None) != (high is None) or (low is not None and not low < high):
            raise ValueError(
                f"RidgeProbe needs low < high, or both None (the targets' range), got "
                f"[{low}, {high}]."
            )
        self.alpha, self.from_targets = alpha, low is None
        # [2] clipping range; from the targets at each fit when not given.
        self.register_buffer("bounds", torch.tensor([low or 0.0, 1.0 if high is None else high]))
        self.register_buffer("prompt_mean", torch.zeros(prompt_dim))
        self.register_buffer("prompt_components", torch.zeros(prompt_dim, prompt_pca))
        self.register_buffer("response_mean", torch.zeros(response_dim))
        self.register_buffer("response_components", torch.zeros(response_dim, response_pca))
        self.register_buffer("weight", torch.zeros(prompt_pca + response_pca + num_scalars))
        self.register_buffer("bias", torch.zeros(()))
        self.register_buffer("fitted", torch.zeros((), dtype=torch.bool))

    def features(
        self, prompt_h: torch.Tensor, response_h: torch.Tensor, scalars: torch.Tensor
    ) -> torch.Tensor:
        """``[M, prompt_pca + response_pca + S]`` probe features of ``M`` rollouts."""
        p = (prompt_h.float() - self.prompt_mean) @ self.prompt_components  # [M, kp]
        r = (response_h.float() - self.response_mean) @ self.response_components  # [M, kr]
        return torch.cat([p, r, scalars.float()], dim=-1)

    @torch.no_grad()
    def fit(
        self,
        prompt_h: torch.Tensor,
        response_h: torch.Tensor,
        scalars: torch.Tensor,
        targets: torch.Tensor,
    ) -> None:
        """Refit PCA and ridge on ``M`` rows (``[M, Dp]``, ``[M, Dr]``, ``[M, S]``, ``[M]``)."""
        kp, kr = self.prompt_components.shape[1], self.response_components.shape[1]
        self.prompt_mean, self.prompt_components = pca_basis(prompt_h, kp)
        self.response_mean, self.response_components = pca_basis(response_h, kr)
        self.weight, self.bias = ridge_fit(
            self.features(prompt_h, response_h, scalars), targets, self.alpha
        )
        if self.from_targets:
            self.bounds = torch.stack([targets.min(), targets.max()]).float().to(self.bounds)
        self.fitted = torch.ones((), dtype=torch.bool, device=self.fitted.device)

    def forward(
        self, prompt_h: torch.Tensor, response_h: torch.Tensor, scalars: torch.Tensor
    ) -> torch.Tensor:
        """``[M]`` predicted expected reward in ``bounds``."""
        if not bool(self.fitted):
            raise RuntimeError("RidgeProbe.forward before fit: fit it on collected rows first.")
        pred = self.features(prompt_h, response_h, scalars) @ self.weight + self.bias  # [M]
        return pred.clamp(self.bounds[0], self.bounds[1])


def fit_quality(pred: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """``(R², Pearson r)`` of ``[M]`` predictions against targets; 0 where the targets (R²) or
    either side (r) have no variance, so a constant buffer never logs NaN."""
    pred, target = pred.double(), target.double()  # [M]
    resid = ((target - pred) ** 2).sum()
    total = ((target - target.mean()) ** 2).sum()
    r2 = float(1 - resid / total) if total > 0 else 0.0
    pc, tc = pred - pred.mean(), target - target.mean()
    denom = (pc.norm() * tc.norm()).item()
    return r2, float((pc @ tc) / denom) if denom > 0 else 0.0


def rows_to_drop(group_ids: torch.Tensor, overflow: int) -> int:
    """How many of the oldest rows to evict so that at least ``overflow`` go and no group is
    split: the count is extended to the end of the group it would cut.

    Args:
        group_ids: ``[M]`` group id of each buffered row, oldest first, a group's rows adjacent.
        overflow: rows over the buffer's capacity.
    """
    m = group_ids.numel()
    if overflow <= 0:
        return 0
    if overflow >= m:
        return m
    same = group_ids[overflow:] == group_ids[overflow - 1]  # [M - overflow]
    # Rows after the cut that still belong to the cut group: the leading run of True.
    return overflow + int(same.int().cumprod(0).sum())
