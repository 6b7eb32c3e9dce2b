"""Outcome advantage estimators over groups of completions of the same prompt.

Rewards arrive as ``[N]`` with ``N = B * G`` and each group's ``G`` rows consecutive (see
:mod:`rlvr_lightning.types`). Every estimator returns ``[N]``, one advantage per completion,
which the losses broadcast over its tokens. A group of one completion has no baseline to compare
against, so every estimator gives it advantage 0.
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "dr_grpo", "rloo"]


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[N]`` rewards as ``[B, G]`` floats, with a clear error when the shapes do not fit."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {tuple(rewards.shape)}.")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} rows, which is not a whole number of groups of "
            f"group_size={group_size}; pass N = B * G rewards with each group's rows consecutive."
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards.reshape(-1, group_size)  # [B, G]


def group_stats(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group reward mean ``[B]`` and unbiased variance ``[B]`` (0 for ``G = 1``).

    Used to log zero-variance groups, which carry no learning signal under GRPO.
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
    mean = grouped.mean(-1)  # [B]
    if group_size == 1:
        return mean, torch.zeros_like(mean)
    return mean, grouped.var(-1, unbiased=True)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantage ``(r - mean_g) / (std_g + eps)``, or ``r - mean_g`` (Dr. GRPO).

    ``std_g`` is the unbiased ``torch.std`` with ``eps = 1e-6``, as verl. verl gives a singleton
    group mean 0 and std 1 (advantage = reward); here it gets 0, since one completion carries
    no relative signal.

    Args:
        rewards: ``[N]`` rewards, groups of ``group_size`` consecutive rows.
        group_size: completions per prompt ``G``.
        normalize_std: divide by the group std (GRPO) or not (Dr. GRPO).
        eps: added to the std so that all-equal groups give 0, not NaN.
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
    if group_size == 1:
        return torch.zeros_like(grouped).view(-1)
    centered = grouped - grouped.mean(-1, keepdim=True)  # [B, G]
    if normalize_std:
        centered = centered / (grouped.std(-1, keepdim=True, unbiased=True) + eps)
    return centered.view(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: ``r_i - mean_{j != i} r_j`` within each group.

    The baseline excludes the row itself, so it is independent of that row's sample and the
    estimate stays unbiased; it equals ``G / (G - 1) * (r_i - mean_g)``.
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
    if group_size == 1:
        return torch.zeros_like(grouped).view(-1)
    others_mean = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)  # [B, G]
    return (grouped - others_mean).view(-1)


def compute_advantages(
    rewards: torch.Tensor, group_size: int, estimator: Estimator, eps: float = 1e-6
) -> torch.Tensor:
    """The advantage estimator named ``estimator``, applied to ``[N]`` rewards; returns ``[N]``.

    This is the only place that maps an estimator name to a function: ``"grpo"`` (std-normalised
    group advantage), ``"dr_grpo"`` (group advantage without std) and ``"rloo"``.
    """
    match estimator:
        case "grpo":
            return group_advantages(rewards, group_size, normalize_std=True, eps=eps)
        case "dr_grpo":
            return group_advantages(rewards, group_size, normalize_std=False)
        case "rloo":
            return rloo_advantages(rewards, group_size)
    raise ValueError(f"Unknown advantage estimator {estimator!r}; use 'grpo', 'dr_grpo' or 'rloo'.")


def masked_group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    baseline_mask: torch.Tensor,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group advantage of every row against the mean (and std) of its group's baseline rows.

    With off-policy members in a group, ``baseline_mask`` selects whose rewards form the
    baseline (e.g. the on-policy members only, LUFFY's ``grpo_split``); every row, in the
    baseline or not, gets ``(r - mean_b) / (std_b + eps)``. With all rows selected this equals
    :func:`group_advantages`. This project's choices for small baselines: a group with one
    baseline row is centred but not divided by a std, and one with none gets advantage 0.

    Args:
        rewards: ``[N]`` rewards, groups of ``group_size`` consecutive rows.
        group_size: rows per group ``G``.
        baseline_mask: ``[N]`` bool, rows that form their group's baseline.
        normalize_std: divide by the baseline's unbiased std (GRPO) or not (Dr. GRPO).
        eps: added to the std.
    """
    grouped = _grouped(rewards, group_size)  # [B, G]
    member = baseline_mask.reshape(grouped.shape).to(grouped.dtype)  # [B, G]
    count = member.sum(-1, keepdim=True)  # [B, 1]
    mean = (grouped * member).sum(-1, keepdim=True) / count.clamp_min(1)  # [B, 1]
    centered = grouped - mean  # [B, G]
    if normalize_std:
        var = (centered**2 * member).sum(-1, keepdim=True) / (count - 1).clamp_min(1)  # [B, 1]
        centered = torch.where(count >= 2, centered / (var.sqrt() + eps), centered)
    return torch.where(count > 0, centered, 0.0).view(-1)


def max_member_advantage(
    num_members: int, reward_gap: torch.Tensor, *, normalize_std: bool = True
) -> torch.Tensor:
    """The largest advantage a member of a group of ``num_members`` could get: its reward is
    ``reward_gap`` above that of every other member (one success among failures).

    GRPO's standardised advantage is then ``(n - 1) / sqrt(n)`` whatever the gap (Samuelson's
    bound on a z-score with the unbiased std), or 0 when the gap is 0; without std it is
    ``gap * (n - 1) / n``. Hand check (n = 4): ``3 / 2 = 1.5``; gap 2 without std: ``1.5``.

    Args:
        num_members: members of the group the bound is for (``n >= 2``).
        reward_gap: ``[B]`` reward difference between the member and the others (>= 0).
        normalize_std: GRPO (True) or Dr. GRPO (False) advantages.
    """
    if num_members < 2:
        raise ValueError(f"max_member_advantage needs num_members >= 2, got {num_members}.")
    n = float(num_members)
    gap = reward_gap.clamp_min(0.0)  # [B]
    if normalize_std:
        return torch.where(gap > 0, (n - 1) / n**0.5, 0.0)
    return gap * (n - 1) / n
