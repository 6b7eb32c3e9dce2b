"""Scoring stage: the reward functions over a round's completions, and the correctness snapshot."""

from __future__ import annotations

from rlvr_lightning.rewards import RewardCombiner
from rlvr_lightning.rewards.trl_contract import RewardState, conversational_rows
from rlvr_lightning.types import PromptBatch, Rollouts, Scored


def reward_columns(batch: PromptBatch, rollouts: Rollouts) -> dict[str, list]:
    """The batch's columns repeated ``G`` times to align with the rows, plus ``prompts`` (the
    data module's ``prompts`` column: the prompt text, or the message list of a conversational
    prompt; the messages for batches without it), ``completion_ids`` (the completion's token
    ids up to and including EOS) and ``completion_length`` (their number)."""
    g = rollouts.group_size
    columns = {k: [v for v in vals for _ in range(g)] for k, vals in batch.columns.items()}
    columns.setdefault("prompts", [m for m in batch.messages for _ in range(g)])
    mask = rollouts.completion_mask.bool()  # [N, T]
    columns["completion_ids"] = [
        ids[keep].tolist() for ids, keep in zip(rollouts.completion_ids, mask, strict=True)
    ]
    columns["completion_length"] = rollouts.lengths.tolist()
    return columns


def score_rollouts(
    rewards: RewardCombiner,
    batch: PromptBatch,
    rollouts: Rollouts,
    accuracy_reward: str,
    threshold: float,
    state: RewardState,
) -> Scored:
    """Run the reward functions; a row is correct when ``accuracy_reward`` >= ``threshold``.
    Completions reach them as TRL's message lists where the data's prompt is a conversation
    (a batch built by hand without a ``prompts`` column keeps strings); ``state`` is TRL's
    ``trainer_state``. The snapshot (``sampled_correct``/``sampled_rewards``) is taken here,
    before any hook."""
    chat = conversational_rows(
        [v for v in batch.columns.get("prompts", []) for _ in range(rollouts.group_size)] or None,
        len(rollouts.completions),
    )
    result = rewards(rollouts.completions, reward_columns(batch, rollouts), chat, state)
    acc = result.per_function[accuracy_reward].nan_to_num(0.0)  # [N]
    total, correct = result.total.to(rollouts.completion_ids.device), acc >= threshold
    return Scored(
        rollouts=rollouts,
        rewards=total,
        per_function=result.per_function,
        correct=correct,
        metrics=result.metrics,
        sampled_correct=correct,
        sampled_rewards=total,
    )
