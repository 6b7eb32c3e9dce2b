"""Per-step statistics: the ``StepOutput`` that logging, the data module and callbacks read."""

from __future__ import annotations

import time
from typing import Any

import torch

from rlvr_lightning.algorithms.offpolicy import sources_of
from rlvr_lightning.algorithms.ops import masked_mean
from rlvr_lightning.algorithms.outcomes import sampled_rows, varies
from rlvr_lightning.types import PromptBatch, Rollouts, Scored, StepOutput


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B * G]`` -> ``[B, G]``."""
    return x.reshape(-1, group_size)


def row_advantages(advantages: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` one advantage per row: itself, or the mean over the row's completion tokens."""
    adv = advantages.detach().float().cpu()  # [N] or [N, T]
    if adv.dim() == 1:
        return adv
    return masked_mean(adv, completion_mask.detach().cpu(), dim=-1)  # [N]


def row_fields(batch: PromptBatch, scored: Scored, advantages: torch.Tensor) -> dict[str, Any]:
    """The per-row ``StepOutput`` fields, as trained (injected members in their slots).

    Copies to CPU what the step already computed; no decoding or extra scoring.
    """
    return {
        "prompts": [turns[-1]["content"] if turns else "" for turns in batch.messages],
        "completions": list(scored.rollouts.completions),
        "sources": sources_of(scored.rollouts),
        "per_function": {k: v.detach().float().cpu() for k, v in scored.per_function.items()},
        "row_rewards": scored.rewards.detach().float().cpu(),
        "row_correct": scored.correct.detach().cpu(),
        "advantages": row_advantages(advantages, scored.rollouts.loss_mask),
    }


def summarise_step(
    step: int,
    batch: PromptBatch,
    scored: Scored,
    advantages: torch.Tensor,
    update_metrics: dict[str, float],
    lr: float,
    trained: torch.Tensor | None = None,
) -> StepOutput:
    """Group-level statistics and the scalar metrics logged every step.

    ``rewards``, ``correct``, ``accuracy`` and ``reward`` describe the rows the policy sampled
    (``outcomes.sampled_rows``); ``accuracy_with_offpolicy`` and ``reward_with_offpolicy`` add
    the injected members, logged when a group holds any. ``trained``: ``[B]`` bool, the groups
    the update used (None: all). The per-row fields (``row_fields``) show the rows as trained.
    """
    g = scored.rollouts.group_size
    sampled_correct, sampled_rewards = sampled_rows(scored)
    rewards = group_view(sampled_rewards.detach().float().cpu(), g)  # [B, G]
    correct = group_view(sampled_correct.cpu(), g)  # [B, G]
    lengths = group_view(scored.rollouts.lengths.cpu(), g)  # [B, G]
    variance = rewards.var(dim=1, unbiased=True) if g > 1 else torch.zeros(len(rewards))  # [B]
    adv = advantages.detach().float().cpu()
    adv = group_view(adv if adv.dim() == 1 else adv.abs().amax(dim=-1), g)  # [B, G]
    metrics = {
        "reward": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "accuracy": float(correct.float().mean()),
        "zero_variance_frac": float((variance == 0).float().mean()),
        "uniform_outcome_frac": float((~varies(correct)).float().mean()),
        "zero_advantage_frac": float((adv.abs().amax(dim=1) == 0).float().mean()),
        "trained_group_frac": 1.0 if trained is None else float(trained.float().mean()),
        "adv_abs_mean": float(advantages.detach().abs().mean()),
        "completion_len": float(lengths.float().mean()),
        "truncated_frac": float(scored.rollouts.truncated.float().mean()),
        "lr": lr,
    }
    if scored.rollouts.offpolicy_mask is not None:
        metrics["accuracy_with_offpolicy"] = float(scored.correct.float().mean())
        metrics["reward_with_offpolicy"] = float(scored.rewards.detach().float().mean())
    for name, values in scored.per_function.items():
        metrics[f"reward/{name}"] = float(values.nanmean()) if values.numel() else 0.0
    metrics.update({k: v for k, v in scored.metrics.items() if not k.endswith("/mean")})
    metrics.update(turn_metrics(scored.rollouts))
    metrics.update(update_metrics)
    return StepOutput(
        step=step,
        prompt_ids=list(batch.prompt_ids),
        group_size=g,
        rewards=rewards,
        correct=correct,
        lengths=lengths,
        pass_rate=correct.float().mean(dim=1),
        group_variance=variance,
        metrics=metrics,
        trained=None if trained is None else trained.detach().cpu(),
        **row_fields(batch, scored, advantages),
    )


def turn_metrics(rollouts: Rollouts) -> dict[str, float]:
    """Multi-turn rollouts' means per trajectory (``multiturn/turns``, ``tool_calls``,
    ``tool_errors``) and the tokens trained against the tokens seen (the environment's are
    seen, never trained); empty for single-turn rows."""
    if rollouts.turn_stats is None:
        return {}
    stats = {
        f"multiturn/{k}": float(v.float().nanmean()) if v.numel() else 0.0
        for k, v in rollouts.turn_stats.items()
        if k != "env_reward"
    }
    trained, seen = float(rollouts.loss_mask.sum()), float(rollouts.completion_mask.sum())
    stats["multiturn/tokens_trained"] = trained
    stats["multiturn/tokens_seen"] = seen
    return stats


class StepClock:
    """Seconds of a training step: generation and scoring summed over its rounds (dynamic
    sampling may run several), the update from a lap after the rounds to a lap after it."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._laps = [time.perf_counter()]
        self.gen = self.score = 0.0

    def add(self, gen: float, score: float) -> None:
        self.gen += gen
        self.score += score

    def lap(self) -> None:
        self._laps.append(time.perf_counter())

    def metrics(self, rollouts: Rollouts) -> dict[str, float]:
        """``gen_tokens_per_s``, the stage times and ``step_time_s`` (up to the last lap)."""
        return {
            "gen_tokens_per_s": float(rollouts.lengths.sum()) / max(self.gen, 1e-9),
            "gen_time_s": self.gen,
            "score_time_s": self.score,
            "update_time_s": self._laps[-1] - self._laps[-2],
            "step_time_s": self._laps[-1] - self._laps[0],
        }
