"""Credit assignment over multi-turn trajectories: turns of a row, discounted returns per turn,
step-level advantages, and their blend with the trajectory's (episode-level) advantage.

A trajectory row holds its model turns and the environment's turns between them
(``Rollouts.env_mask``); a model turn is a maximal run of model tokens (``loss_mask`` = 1), so
two model turns are always separated by at least one environment token (the chat template's
turn markers). The spec is "Multi-turn rollouts" in ``docs/mechanisms_multiturn.md``.
"""

from __future__ import annotations

import torch


def turn_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` 0-based model turn of each model token, ``-1`` on environment tokens and
    padding.

    >>> turn_index(torch.tensor([[1, 1, 0, 0, 1, 0]])).tolist()
    [[0, 0, -1, -1, 1, -1]]
    """
    model = loss_mask.bool()  # [N, T]
    before = torch.nn.functional.pad(model[:, :-1], (1, 0), value=False)  # [N, T] previous token
    starts = model & ~before  # [N, T] first token of each model turn
    index = starts.long().cumsum(-1) - 1  # [N, T]
    return torch.where(model, index, torch.full_like(index, -1))


def turn_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` number of model turns of each row."""
    return turn_index(loss_mask).amax(-1).clamp(min=-1) + 1


def turn_returns(rewards: torch.Tensor, turns: torch.Tensor, gamma: float) -> torch.Tensor:
    """``[N, K]`` discounted return of turn ``k`` of each trajectory, NaN past its last turn.

    The trajectory's reward ``R`` is earned at its last turn ``K_i - 1``; turn ``k`` gets
    ``gamma ** (K_i - 1 - k) * R`` (Semi-online RL's discounted future return with the reward
    at the end; MURPHY's max- and mean-reward propagation both give ``R`` to every earlier
    attempt of a chain, ``gamma = 1``).

    Args:
        rewards: ``[N]`` trajectory rewards; turns: ``[N]`` model turns per row (>= 1).
    """
    k = int(turns.max()) if turns.numel() else 0
    pos = torch.arange(k, device=rewards.device)[None, :]  # [1, K]
    left = (turns[:, None] - 1 - pos).float()  # [N, K] turns until the reward
    out = rewards.float()[:, None] * torch.pow(torch.tensor(gamma), left)
    return torch.where(left >= 0, out, torch.full_like(out, float("nan")))


def step_advantages(returns: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``[N, K]`` advantage of each turn against the same turn of the other trajectories of its
    group: ``(R_ik - mean) / (std + eps)`` over the group's rows that reached turn ``k``
    (unbiased std); 0 where fewer than two rows reached it, NaN past a row's last turn.

    Hand check, one group of two, one turn: returns ``[1, 0]`` -> mean 0.5, std 0.7071 ->
    ``[0.7071, -0.7071]``.
    """
    n, k = returns.shape
    grouped = returns.reshape(n // group_size, group_size, k)  # [B, G, K]
    present = ~grouped.isnan()
    count = present.sum(1, keepdim=True)  # [B, 1, K]
    filled = grouped.nan_to_num(0.0)
    mean = filled.sum(1, keepdim=True) / count.clamp(min=1)
    var = ((filled - mean) ** 2 * present).sum(1, keepdim=True) / (count - 1).clamp(min=1)
    adv = (grouped - mean) / (var.sqrt() + eps)
    adv = torch.where(count >= 2, adv, torch.zeros_like(adv))
    return torch.where(present, adv, torch.full_like(adv, float("nan"))).reshape(n, k)


def blend_turn_advantages(
    episode: torch.Tensor, step: torch.Tensor, turn_idx: torch.Tensor, step_weight: float
) -> torch.Tensor:
    """``[N, T]`` per-token advantage ``(1 - w) * A_episode + w * A_step[turn]`` on model tokens,
    0 elsewhere (Semi-online RL's weighted step- and episode-level advantages).

    Args:
        episode: ``[N]`` or ``[N, T]`` advantage from the estimator; step: ``[N, K]``
            (``step_advantages``); turn_idx: ``[N, T]`` (``turn_index``); step_weight: ``w``.
    """
    ep = episode if episode.dim() == 2 else episode[:, None].expand(turn_idx.shape)
    if step.shape[1] == 0:
        return torch.where(turn_idx >= 0, ep, torch.zeros_like(ep))
    gathered = step.nan_to_num(0.0).gather(1, turn_idx.clamp(min=0))  # [N, T]
    out = (1.0 - step_weight) * ep.float() + step_weight * gathered.to(ep.device)
    return torch.where(turn_idx >= 0, out, torch.zeros_like(out))
