"""POISE's probe (spec §7.1): a ridge regression on PCA-reduced hidden states that predicts a
prompt's expected reward, and the cross-rollout baseline built from its predictions.

What is here is the maths: :func:`sibling_mean` (the probe's regression target, from the
siblings' rewards, and the baseline, from the siblings' predictions), :func:`poise_advantages`,
:func:`pca_basis`, :func:`ridge_fit` and :class:`RidgeProbe`, whose fitted state lives in
buffers so that it is saved with a checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn


def sibling_mean(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N]`` mean of the *other* rows of each row's group: ``(Σ_{j≠i} x_j) / (G - 1)``.

    With ``x`` the rewards it is POISE's probe target (``other_rollout_correctness``); with
    ``x`` the probe's predictions it is the baseline ``b_i``, which never sees row ``i``'s own
    state, so the advantage stays unbiased.
    """
    if group_size < 2 or x.dim() != 1 or x.numel() % group_size:
        raise ValueError(
            f"sibling_mean needs [N] values in groups of group_size >= 2; got shape "
            f"{tuple(x.shape)} with group_size={group_size}."
        )
    grouped = x.float().reshape(-1, group_size)  # [B, G]
    return ((grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)).reshape(-1)


def poise_advantages(
    rewards: torch.Tensor, predictions: torch.Tensor, group_size: int
) -> torch.Tensor:
    """``[N]`` POISE advantages ``A_i = r_i - b_i``, ``b_i`` the mean of the siblings' probe
    predictions (:func:`sibling_mean`); for ``G = 2``: ``A_1 = r_1 - g(z_2)``."""
    return rewards.float() - sibling_mean(predictions, group_size)


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
    ``alpha = 100``. Scalars (e.g. mean token entropies) enter unscaled.

    Args:
        prompt_dim: width of the prompt hidden-state feature.
        response_dim: width of the response hidden-state feature.
        num_scalars: number of scalar features.
        prompt_pca: principal components kept of the prompt feature.
        response_pca: principal components kept of the response feature.
        alpha: ridge penalty.
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
    ) -> None:
        super().__init__()
        self.alpha = alpha
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
        self.fitted = torch.ones((), dtype=torch.bool, device=self.fitted.device)

    def forward(
        self, prompt_h: torch.Tensor, response_h: torch.Tensor, scalars: torch.Tensor
    ) -> torch.Tensor:
        """``[M]`` predicted expected reward in ``[0, 1]``."""
        if not bool(self.fitted):
            raise RuntimeError("RidgeProbe.forward before fit: fit it on collected rows first.")
        pred = self.features(prompt_h, response_h, scalars) @ self.weight + self.bias  # [M]
        return pred.clamp(0.0, 1.0)
