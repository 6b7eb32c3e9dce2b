"""Multi-turn stage of a step: environments for the rows, the prompts they see, the trajectories,
and the per-turn credit of the advantages.

The generation stage calls :func:`multi_turn_rollouts` when the module's ``multiturn`` group is
on; the trajectories then flow through scoring, π_old and the update like single-turn rows, with
``Rollouts.env_mask`` keeping the environment's tokens out of every loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.algorithms.multiturn import (
    blend_turn_advantages,
    step_advantages,
    turn_counts,
    turn_index,
    turn_returns,
)
from rlvr_lightning.environments import (
    Session,
    SessionFactory,
    respond_all,
    template_renders_tools,
    tools_instruction,
)
from rlvr_lightning.options import MultiTurn
from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.multiturn import TurnLimits, run_trajectories
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored

NO_TOKEN_LIMIT = 10**9
"""``max_total_tokens: null``: each model turn is bounded by ``sampling.max_new_tokens`` and each
tool result by ``max_tool_output_chars``, the trajectory by nothing else."""


def with_reset_text(messages: list[dict], text: str | None) -> list[dict]:
    """``messages`` with ``text`` appended to the last user message (TRL's ``reset`` rule)."""
    if not text:
        return list(messages)
    last = messages[-1]
    return [*messages[:-1], {**last, "content": str(last.get("content", "")) + text}]


def with_tools_instruction(messages: list[dict], instruction: str) -> list[dict]:
    """``messages`` with the tools' description in the system message (a new one first when
    there is none), for chat templates that do not render ``tools``."""
    if messages and messages[0].get("role") == "system":
        head = messages[0]
        return [{**head, "content": f"{head.get('content', '')}\n\n{instruction}"}, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]


def row_columns(batch: PromptBatch, b: int) -> dict[str, Any]:
    """Prompt ``b``'s dataset row, as TRL passes it to ``reset(**row)``: its columns and
    ``prompt`` (the messages)."""
    row = {k: v[b] for k, v in batch.columns.items()}
    row.setdefault("prompt", batch.messages[b])
    return row


def start_sessions(
    factory: SessionFactory, batch: PromptBatch, group_size: int
) -> tuple[list[Session], list[list[dict]]]:
    """One session per trajectory (``B * G``), reset with its prompt's row, and the messages
    each trajectory starts from."""
    sessions, messages = [], []
    for b in range(len(batch)):
        row = row_columns(batch, b)
        for _ in range(group_size):
            session = factory.new()
            sessions.append(session)
            messages.append(with_reset_text(batch.messages[b], session.reset(dict(row))))
    return sessions, messages


def render_prompts(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[list[dict]], schemas: list[dict]
) -> list[str]:
    """Each conversation through the chat template with the generation prompt; the tools go
    in through ``tools=`` where the template renders them, else as a system instruction
    (``environments.tools_instruction``, the documented fallback format)."""
    renders = bool(schemas) and template_renders_tools(tokenizer)
    texts = []
    for messages in conversations:
        if schemas and not renders:
            messages = with_tools_instruction(messages, tools_instruction(schemas))
        texts.append(
            tokenizer.apply_chat_template(
                messages,
                tools=schemas if renders else None,
                add_generation_prompt=True,
                tokenize=False,
            )
        )
    return texts


def multi_turn_rollouts(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    factory: SessionFactory,
    batch: PromptBatch,
    sampling: Sampling,
    options: MultiTurn,
    temperatures: torch.Tensor | None,
    device: torch.device,
) -> Rollouts:
    """The ``B * G`` trajectories of ``batch``; ``turn_stats`` gets each environment's
    ``get_reward()`` as ``env_reward`` (NaN without one)."""
    if batch.position_temperatures is not None:
        raise ValueError(
            "A temperature that changes along the completion (AnnealedTemperature) is not "
            "applied to multi-turn trajectories; remove the callback or set "
            "multiturn.max_turns: 1 without tools or environment."
        )
    g = sampling.group_size
    sessions, messages = start_sessions(factory, batch, g)
    shared = all(messages[i] == messages[i - i % g] for i in range(len(messages)))
    texts = render_prompts(tokenizer, messages[::g] if shared else messages, factory.schemas)
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    limits = TurnLimits(options.max_turns, options.max_total_tokens or NO_TOKEN_LIMIT)

    def respond(rows: list[int], answers: list[str]):
        chosen = [sessions[i] for i in rows]
        return respond_all(chosen, answers, tokenizer, options.tool_timeout_s)

    prompts = (enc.input_ids.to(device), enc.attention_mask.to(device))
    rollouts = run_trajectories(
        engine, tokenizer, prompts, sampling, respond, limits, temperatures, per_row=not shared
    )
    rewards = [s.reward() for s in sessions]
    env_reward = torch.tensor([float("nan") if r is None else float(r) for r in rewards])
    stats = {**(rollouts.turn_stats or {}), "env_reward": env_reward}
    return dataclasses.replace(rollouts, turn_stats=stats)


def turn_credit(scored: Scored, advantages: torch.Tensor, options: MultiTurn) -> torch.Tensor:
    """The estimator's advantages with per-turn credit (``algorithms.multiturn``): unchanged
    for single-turn rows or ``step_weight = 0``, else ``[N, T]`` with each model turn's
    step-level advantage blended in."""
    r = scored.rollouts
    if r.env_mask is None or options.step_weight == 0:
        return advantages
    mask = r.loss_mask.cpu()  # [N, T]
    turns = turn_counts(mask).clamp(min=1)  # [N]
    returns = turn_returns(scored.rewards.cpu(), turns, options.turn_discount)  # [N, K]
    step = step_advantages(returns, r.group_size)  # [N, K]
    out = blend_turn_advantages(advantages.cpu(), step, turn_index(mask), options.step_weight)
    return out.to(advantages.device)
