"""Multi-turn trajectories: the model and an environment take turns until the environment says
done, the turn limit or the token budget.

Any engine continues them (``RolloutEngine.generate`` on the conversations so far, the rows
still going only: a row that finishes leaves the batch). The environment's tokens are part of
the context and never trained on (``Rollouts.env_mask``); their behaviour log-prob is 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.turns import TurnText, between_turns
from rlvr_lightning.types import Rollouts, Sampling


class EnvTurn(Protocol):
    """What an environment says after a model turn (``environments.Turn``)."""

    messages: list[dict]
    done: bool
    tool_calls: int
    tool_errors: int


Respond = Callable[[list[int], list[str]], Sequence[EnvTurn]]
"""``respond(rows, texts)``: the environment turns after the model turns ``texts`` of ``rows``
(indices into the ``N`` trajectories), in that order."""


@dataclass(frozen=True)
class TurnLimits:
    """Where a trajectory stops besides the environment's ``done``.

    Args:
        max_turns: model turns per trajectory.
        max_total_tokens: tokens after the prompt (model and environment together); an
            environment turn that would pass it ends the trajectory before it is appended.
    """

    max_turns: int
    max_total_tokens: int


@dataclass
class _Row:
    ids: list[int] = field(default_factory=list)  # tokens after the prompt
    env: list[int] = field(default_factory=list)  # 1 on environment tokens
    logp: list[float] = field(default_factory=list)  # behaviour log-probs (0 on env tokens)
    conversation: list[dict] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    done: bool = False
    truncated: bool = False


def run_trajectories(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompts: tuple[torch.Tensor, torch.Tensor],
    sampling: Sampling,
    respond: Respond,
    limits: TurnLimits,
    temperatures: torch.Tensor | None = None,
    per_row: bool = False,
) -> Rollouts:
    """``N = B * G`` trajectories from left-padded ``prompts`` (``([B, P] ids, [B, P] mask)``,
    each sampled ``G`` times; ``per_row``: ``[N, P]``, a prompt per row, for environments that
    changed the prompts of a group differently). ``temperatures``: ``[N]``."""
    ids, mask = prompts
    first_g = 1 if per_row else sampling.group_size
    out = engine.generate(
        ids, mask, dataclasses.replace(sampling, group_size=first_g), temperatures
    )
    first = out
    starts = [p[m.bool()].tolist() for p, m in zip(out.prompt_ids, out.prompt_mask, strict=True)]
    rows, text = [_Row() for _ in range(out.num_rows)], TurnText.of(tokenizer)
    active = list(range(out.num_rows))
    while active:
        _absorb(rows, active, out, limits)
        active = _environment_turns(rows, active, respond, tokenizer, text, limits)
        if not active:
            break
        ctx = left_pad([starts[i] + rows[i].ids for i in active], tokenizer.pad_token_id)
        room = max(limits.max_total_tokens - len(rows[i].ids) for i in active)
        turn = dataclasses.replace(
            sampling, group_size=1, max_new_tokens=min(sampling.max_new_tokens, room)
        )
        temps = None if temperatures is None else first.temperature[active]
        out = engine.generate(*ctx, turn, temps)
    return _assemble(first, rows, sampling.group_size, tokenizer.pad_token_id)


def _absorb(rows: list[_Row], active: list[int], out: Rollouts, limits: TurnLimits) -> None:
    """Append each active row's sampled turn (cut at the row's token budget)."""
    for j, i in enumerate(active):
        row, keep = rows[i], out.completion_mask[j].bool()
        new = out.completion_ids[j][keep].tolist()
        logp = out.behaviour_logp[j][keep].float().tolist()
        room = limits.max_total_tokens - len(row.ids)
        cut = len(new) > room
        new, logp = new[:room], logp[:room]
        row.ids += new
        row.env += [0] * len(new)
        row.logp += logp
        row.turns += 1
        row.conversation.append({"role": "assistant", "content": out.completions[j]})
        row.truncated = bool(out.truncated[j]) or cut
        row.done = row.truncated or row.turns >= limits.max_turns


def _environment_turns(
    rows: list[_Row],
    active: list[int],
    respond: Respond,
    tokenizer: PreTrainedTokenizerBase,
    text: TurnText,
    limits: TurnLimits,
) -> list[int]:
    """Ask the environments of the rows still going; return the rows that continue."""
    asking = [i for i in active if not rows[i].done]
    if not asking:
        return []
    turns = respond(asking, [rows[i].conversation[-1]["content"] for i in asking])
    going = []
    for i, turn in zip(asking, turns, strict=True):
        row = rows[i]
        row.tool_calls += turn.tool_calls
        row.tool_errors += turn.tool_errors
        if getattr(turn, "assistant", None):  # the turn as TRL's message (with tool_calls)
            row.conversation[-1] = dict(turn.assistant)
        if turn.done or not turn.messages:
            row.done = True
            continue
        between = between_turns(tokenizer, text, True, turn.messages)
        if len(row.ids) + len(between) >= limits.max_total_tokens:
            row.done = True  # no room for the environment's answer and another model turn
            continue
        row.conversation += [dict(m) for m in turn.messages]
        row.ids += between
        row.env += [1] * len(between)
        row.logp += [0.0] * len(between)
        going.append(i)
    return going


def left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as ``([N, W] ids, [N, W] mask)``, left-padded with ``pad``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s) :] = 1
    return ids, mask


def _assemble(first: Rollouts, rows: list[_Row], group_size: int, pad: int) -> Rollouts:
    """The trajectories as ``Rollouts``: completion = every token after the prompt."""
    n, width = len(rows), max(1, max(len(r.ids) for r in rows))
    ids = torch.full((n, width), pad, dtype=torch.long)
    cmask, env = (
        torch.zeros((n, width), dtype=torch.long),
        torch.zeros((n, width), dtype=torch.long),
    )
    logp = torch.zeros((n, width))
    for r, row in enumerate(rows):
        k = len(row.ids)
        ids[r, :k] = torch.tensor(row.ids, dtype=torch.long)
        cmask[r, :k] = 1
        env[r, :k] = torch.tensor(row.env, dtype=torch.long)
        logp[r, :k] = torch.tensor(row.logp)
    device = first.completion_ids.device
    stats = {
        "turns": [r.turns for r in rows],
        "tool_calls": [r.tool_calls for r in rows],
        "tool_errors": [r.tool_errors for r in rows],
    }
    return Rollouts(
        prompt_ids=first.prompt_ids,
        prompt_mask=first.prompt_mask,
        completion_ids=ids.to(device),
        completion_mask=cmask.to(device),
        behaviour_logp=logp.to(device),
        temperature=first.temperature,
        truncated=torch.tensor([r.truncated for r in rows], device=device),
        completions=[readable(r.conversation) for r in rows],
        group_size=group_size,
        env_mask=env.to(device),
        conversations=tuple(tuple(r.conversation) for r in rows),
        turn_stats={k: torch.tensor(v, dtype=torch.float32) for k, v in stats.items()},
    )


def readable(conversation: Sequence[dict]) -> str:
    """A trajectory as one text, one turn a paragraph (``[tool] ...`` for what the environment
    said), for tables and logs; a single-turn trajectory is its answer alone."""
    if len(conversation) == 1:
        return str(conversation[0].get("content", ""))
    return "\n\n".join(
        str(m.get("content", ""))
        if m.get("role") == "assistant"
        else f"[{m.get('role')}] {m.get('content', '')}"
        for m in conversation
    )
