"""A prompt's outcome: what the policy's own samples say about it, before any hook.

Replay, the curriculum, dynamic sampling, the guidance callbacks and the logged
``train/accuracy`` / ``train/reward`` all decide from one thing per prompt: how many of the
``G`` completions the policy itself sampled are correct. ``RLVRModule.score`` keeps a snapshot
of the sampled rows (``Scored.sampled_correct`` / ``sampled_rewards``) that the
``on_after_score`` hooks carry unchanged, so a reference injected into a group, or a sample a
hook replaced, never shifts the count: ``[1, 0, 0, 0]`` stays ``1/4`` whatever is injected.

"Informative" (spec §8.2) asks a different question, about the group *as trained*: does its
accuracy outcome vary (``accuracy``, DAPO's test, the default), or its total reward
(``reward``)? For a group of samples the two views agree; a group a hook completed with an
off-policy member is judged with that member, which is how injection rescues an all-wrong group.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from rlvr_lightning.types import Scored

InformativeBy = Literal["accuracy", "reward"]


def sampled_rows(scored: Scored) -> tuple[torch.Tensor, torch.Tensor]:
    """``([N] bool correct, [N] rewards)`` of the rows as the policy sampled them."""
    correct = scored.correct if scored.sampled_correct is None else scored.sampled_correct
    rewards = scored.rewards if scored.sampled_rewards is None else scored.sampled_rewards
    return correct, rewards


def snapshot(scored: Scored) -> Scored:
    """``scored`` with its current rows recorded as the sampled ones (kept if already set)."""
    correct, rewards = sampled_rows(scored)
    return dataclasses.replace(scored, sampled_correct=correct, sampled_rewards=rewards)


def varies(values: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: whether the ``[B, G]`` values of each group are not all equal."""
    values = values.float()
    return values.amax(dim=1) > values.amin(dim=1)


def informative_groups(
    correct: torch.Tensor, rewards: torch.Tensor, group_size: int, by: InformativeBy
) -> torch.Tensor:
    """``[B]`` bool: groups of ``[N]`` rows whose accuracy outcome (``by="accuracy"``: some but
    not all correct) or total reward (``by="reward"``) varies."""
    if by not in ("accuracy", "reward"):
        raise ValueError(f"informative must be 'accuracy' or 'reward', got {by!r}.")
    values = correct if by == "accuracy" else rewards
    return varies(values.detach().cpu().reshape(-1, group_size))


def pass_rates(correct: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` ``k / G`` of ``[N]`` correct flags."""
    return correct.detach().cpu().reshape(-1, group_size).float().mean(dim=1)
