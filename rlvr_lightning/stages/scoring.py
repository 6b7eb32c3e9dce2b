"""Scoring stage: the reward functions over a round's completions, and the correctness snapshot."""

from __future__ import annotations

import dataclasses

import torch

from rlvr_lightning.rewards import RewardCombiner
from rlvr_lightning.rewards.combine import RewardResult
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
    columns["completion_length"] = rollouts.loss_mask.sum(-1).tolist()  # model tokens
    if rollouts.conversations is not None:  # multi-turn: what each turn said
        talks = rollouts.conversations
        columns["turns"] = [[m["content"] for m in t if m["role"] == "assistant"] for t in talks]
        for name in ("tool_calls", "tool_errors"):
            columns[name] = [int(v) for v in rollouts.turn_stats[name].tolist()]
        columns["num_turns"] = [len(t) for t in columns["turns"]]
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
    columns = reward_columns(batch, rollouts)
    if rollouts.conversations is None:
        result = rewards(rollouts.completions, columns, chat, state)
    else:  # TRL's multi-turn contract: the whole conversation after the prompt, as messages
        talks = [list(t) for t in rollouts.conversations]
        result = with_env_reward(rewards(talks, columns, [True] * len(talks), state), rollouts)
    acc = result.per_function[accuracy_reward].nan_to_num(0.0)  # [N]
    total, correct = result.total.to(rollouts.completion_ids.device), acc >= threshold
    if rollouts.conversations is not None:
        first = first_turn_correct(rewards, columns, rollouts, correct, accuracy_reward, threshold)
        turns = float(rollouts.turn_stats["turns"].float().mean())
        metrics = {
            **result.metrics,
            "multiturn/first_turn_accuracy": float(first.float().mean()),
            "multiturn/turns": turns,
        }
        result = dataclasses.replace(result, metrics=metrics)
    return Scored(
        rollouts=rollouts,
        rewards=total,
        per_function=result.per_function,
        correct=correct,
        metrics=result.metrics,
        sampled_correct=correct,
        sampled_rewards=total,
    )


def first_turn_correct(
    rewards: RewardCombiner,
    columns: dict[str, list],
    rollouts: Rollouts,
    correct: torch.Tensor,
    accuracy_reward: str,
    threshold: float,
) -> torch.Tensor:
    """``[N]`` bool: whether each trajectory's first answer was already correct (the accuracy
    reward on the first assistant turn alone; a one-turn trajectory: ``correct``). The reward
    functions run a second time on the multi-turn rows, for this metric only."""
    talks = rollouts.conversations or ()
    multi = [i for i, t in enumerate(talks) if sum(m["role"] == "assistant" for m in t) > 1]
    first = correct.detach().clone().cpu()
    if multi:
        sub = {k: [v[i] for i in multi] for k, v in columns.items()}
        answers = [[next(m for m in talks[i] if m["role"] == "assistant")] for i in multi]
        result = rewards(answers, sub, [True] * len(multi))
        first[multi] = result.per_function[accuracy_reward].nan_to_num(0.0).cpu() >= threshold
    return first


ENV_REWARD = "environment"
"""Name of the environments' ``get_reward()`` among the rewards (weight 1, as in TRL)."""


def with_env_reward(result: RewardResult, rollouts: Rollouts) -> RewardResult:
    """``result`` with the environments' ``get_reward()`` (``turn_stats["env_reward"]``, NaN:
    none) added to the total with weight 1 and kept under ``environment``."""
    env = (rollouts.turn_stats or {}).get("env_reward")
    if env is None or bool(env.isnan().all()):
        return result
    env = env.to(result.total.device, result.total.dtype)  # [N]
    per_function = {**result.per_function, ENV_REWARD: env}
    metrics = {**result.metrics, f"reward/{ENV_REWARD}/mean": float(env.nanmean())}
    return dataclasses.replace(
        result, total=result.total + env.nan_to_num(0.0), per_function=per_function, metrics=metrics
    )
