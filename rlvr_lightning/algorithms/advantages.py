"""Advantage estimators: outcome estimators over groups, per-token GAE with a critic, and
POISE's baseline from the siblings' probe predictions.

Rewards arrive as ``[N]`` with ``N = B * G`` and each group's ``G`` rows consecutive (see
:mod:`rlvr_lightning.types`). The group estimators return ``[N]``, one advantage per
completion, which the losses broadcast over its tokens; a group of one completion has no
baseline to compare against, so they give it advantage 0. :func:`gae` uses per-token values
of a critic instead and returns ``[N, T]``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rlvr_lightning.algorithms.ops import masked_mean, masked_var

Estimator = Literal["grpo", "dr_grpo", "rloo", "gae", "probe"]


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
    """``[N]`` POISE advantages ``A_i = r_i - b_i`` (spec §7.1), ``b_i`` the mean of the
    siblings' probe predictions (:func:`sibling_mean`); for ``G = 2``: ``A_1 = r_1 - g(z_2)``.
    Not divided by a std (POISE: ``norm_adv_by_std_in_grpo=False``). With the rewards as
    ``predictions`` this is :func:`rloo_advantages`."""
    return rewards.float() - sibling_mean(predictions, group_size)


def outcome_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` token rewards: each row's scalar reward at its last valid token, 0 elsewhere.

    The reward of an outcome-verified completion arrives when it ends (spec §8.7); a row
    without valid tokens gets no reward. A row that hit ``max_new_tokens`` is treated the same
    way (its reward was scored on the truncated text).
    """
    valid = mask.bool()  # [N, T]
    last = valid.cumsum(-1).eq(valid.sum(-1, keepdim=True)) & valid  # [N, T], one per row
    return torch.where(last, rewards.to(torch.float32)[:, None], 0.0)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each row (spec §8.7).

    ``δ_t = r_t + γ V_{t+1} - V_t`` and ``Â_t = δ_t + γλ Â_{t+1}``, computed backwards; ``t + 1``
    is the row's next *valid* token (padding in between is skipped, as verl does) and after the
    last valid token the episode ends (``V = 0``). Returns are ``R_t = Â_t + V_t``, the critic's
    TD(λ) target. Padding positions contribute nothing, whatever they hold, and get 0.

    Args:
        rewards: ``[N]`` scalar sequence rewards, placed at each row's last valid token
            (:func:`outcome_token_rewards`), or ``[N, T]`` per-token rewards.
        values: ``[N, T]`` values ``V(s_t)`` of the state before token ``t`` (treated as
            constants).
        mask: ``[N, T]`` nonzero on completion tokens.
        gamma: discount ``γ`` (verl: 1.0).
        lam: GAE ``λ`` (verl: 1.0).

    Returns:
        ``(advantages [N, T], returns [N, T])``, fp32, 0 on padding.
    """
    valid = mask.bool()  # [N, T]
    if rewards.dim() == 1:
        rewards = outcome_token_rewards(rewards, valid)  # [N, T]
    r = torch.where(valid, rewards.float(), 0.0)  # [N, T]
    v = torch.where(valid, values.detach().float(), 0.0)  # [N, T]
    advantages = torch.zeros_like(v)  # [N, T]
    next_value = torch.zeros_like(v[:, 0])  # [N]
    next_adv = torch.zeros_like(v[:, 0])  # [N]
    for t in reversed(range(v.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]  # [N]
        adv_t = delta + gamma * lam * next_adv  # [N]
        advantages[:, t] = torch.where(valid[:, t], adv_t, 0.0)
        next_value = torch.where(valid[:, t], v[:, t], next_value)
        next_adv = torch.where(valid[:, t], adv_t, next_adv)
    returns = torch.where(valid, advantages + v, 0.0)  # [N, T]
    return advantages, returns


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    estimator: Estimator,
    eps: float = 1e-6,
    *,
    values: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    whiten_rows: torch.Tensor | None = None,
    predictions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The advantage estimator named ``estimator``, applied to ``[N]`` rewards.

    This is the only place that maps an estimator name to a function: ``"grpo"`` (std-normalised
    group advantage), ``"dr_grpo"`` (group advantage without std) and ``"rloo"`` return ``[N]``;
    ``"gae"`` (:func:`gae` with ``values``, ``mask``, ``gamma``, ``lam``) returns ``[N, T]``,
    whitened over the batch's valid tokens (``ops.masked_whiten``, as verl) unless ``whiten``
    is False; ``whiten_rows`` (``[N]`` bool, the rows the update trains) restricts the
    whitening statistics to their tokens (:func:`whiten_over`), so groups the selection drops
    never shape the trained groups' advantages. ``"probe"`` (:func:`poise_advantages` with
    ``predictions``, ``[N]`` probe outputs) returns ``[N]``.
    """
    match estimator:
        case "grpo":
            return group_advantages(rewards, group_size, normalize_std=True, eps=eps)
        case "dr_grpo":
            return group_advantages(rewards, group_size, normalize_std=False)
        case "rloo":
            return rloo_advantages(rewards, group_size)
        case "gae":
            if values is None or mask is None:
                raise ValueError(
                    "estimator 'gae' needs per-token values and the completion mask; the module "
                    "computes them with a value head (model.init_args.value_head)."
                )
            advantages, _ = gae(rewards, values, mask, gamma, lam)  # [N, T]
            return whiten_over(advantages, mask, whiten_rows) if whiten else advantages
        case "probe":
            if predictions is None:
                raise ValueError(
                    "estimator 'probe' needs the probe's [N] predictions; the module computes "
                    "them with a probe head (model.init_args.probe_head)."
                )
            return poise_advantages(rewards, predictions, group_size)
    raise ValueError(
        f"Unknown advantage estimator {estimator!r}; use 'grpo', 'dr_grpo', 'rloo', 'gae' or "
        "'probe'."
    )


def whiten_over(
    x: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """``[N, T]`` ``x`` whitened on every valid token of ``mask`` with the mean and variance of
    the valid tokens of ``rows`` (``[N]`` bool; None or no token there: all rows), 0 on
    padding. Hand check: ``x = [[1, 3], [100, 100]]``, all valid, ``rows = [True, False]``:
    mean 2, variance 2 (unbiased, as ``ops.masked_var``), so row 0 becomes ``[-1, 1] / √2``."""
    stat = mask if rows is None else mask * rows.to(mask.device)[:, None].to(mask.dtype)
    if not bool(stat.bool().any()):
        stat = mask
    mean, var = masked_mean(x, stat), masked_var(x, stat)  # [], []
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), 0.0)


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
