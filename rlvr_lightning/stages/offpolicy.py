"""Off-policy group members: completions that were supplied rather than sampled (spec §3, §4).

A callback builds :class:`Member`\\ s (a reference solution, a teacher response, a stored
trajectory) and :func:`inject` puts each in the slot of one sampled row of its group
(:func:`guidance_slots` chooses which), so the batch keeps ``G`` consecutive rows per prompt
and everything downstream (advantages, the update) works unchanged; the prompt's outcome is
read from the snapshot taken before any hook (``outcomes.py``). The injected rows carry a
source tag, a token-level ``offpolicy_mask`` and, optionally, stored behaviour log-probs; the
update weights their tokens with ``offpolicy_losses.offpolicy_token_loss`` and the module's
``offpolicy_weighting`` option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from rlvr_lightning.algorithms.offpolicy import floor_accuracy, sources_of
from rlvr_lightning.types import SOURCE_POLICY, PromptBatch, Rollouts, Scored


class ScoringModule(Protocol):
    """What :func:`inject` and :func:`scored_batch` read of the module (``RLVRModule``)."""

    tokenizer: Any
    engine: Any
    step_batch: PromptBatch | None
    rewards: Any  # the RewardCombiner: the accuracy reward's weight
    accuracy_reward: str
    options: Any  # rewards.accuracy_threshold

    def score(self, batch: PromptBatch, rollouts: Rollouts) -> Scored: ...


@dataclasses.dataclass(frozen=True)
class Member:
    """One off-policy completion for the group of batch row ``row // G``.

    Args:
        row: the rollout row ``[0, N)`` whose slot the member takes.
        source: its tag (``reference``, ``teacher``, ``experience``, ...); not ``policy``.
        text: the completion as text; EOS is appended after tokenising.
        token_ids: the completion as token ids (used as given, EOS included if wanted);
            exactly one of ``text`` and ``token_ids`` is set.
        behaviour_logp: ``[len(token_ids)]`` log-probs of the tokens under the policy that
            produced them (ExGRPO's stored trajectories); None = unknown, stored as 0
            (probability 1, LUFFY's convention for a teacher).
        temperature: temperature at which the policy scores the tokens (that of
            ``behaviour_logp`` when given).
        reward: floor on the member's accuracy reward (AMPO: 1.0), on that reward's own
            scale: ``max(verifier's value, reward)``, the total moved by its weight and
            ``correct`` judged again (``offpolicy.floor_accuracy``); None = the verifier's.
        as_on_policy: the loss treats its tokens as the policy's own samples (the clipped
            policy loss, no ``offpolicy_weighting``; NPO's near-future guide, spec §6);
            ``behaviour_logp`` must then hold the current policy's log-probs. The row keeps
            its source tag, so it never counts in the prompt's outcome.
    """

    row: int
    source: str
    text: str | None = None
    token_ids: Sequence[int] | None = None
    behaviour_logp: Sequence[float] | None = None
    temperature: float = 1.0
    reward: float | None = None
    as_on_policy: bool = False

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("A Member needs exactly one of text and token_ids.")
        if self.source == SOURCE_POLICY:
            raise ValueError(f"An off-policy member cannot have the source tag {SOURCE_POLICY!r}.")
        if self.behaviour_logp is not None and (
            self.token_ids is None or len(self.behaviour_logp) != len(self.token_ids)
        ):
            raise ValueError("behaviour_logp needs token_ids of the same length.")
        if self.as_on_policy and self.behaviour_logp is None:
            raise ValueError("An as_on_policy member needs the policy's behaviour_logp.")


def _pad_right(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def replace_rows(
    rollouts: Rollouts,
    rows: Sequence[int],
    token_ids: Sequence[Sequence[int]],
    behaviour_logp: Sequence[Sequence[float] | None],
    sources: Sequence[str],
    temperatures: Sequence[float],
    texts: Sequence[str],
    pad_id: int,
    as_on_policy: Sequence[bool] | None = None,
) -> Rollouts:
    """New rollouts with rows ``rows`` replaced by the given completions, marked off-policy
    in ``offpolicy_mask`` unless ``as_on_policy`` says so for the row.

    The completion width grows when a member is longer than ``T``; prompts are kept. A member
    replacing a multi-turn trajectory is one assistant answer (no environment tokens).
    """
    old_t = rollouts.completion_ids.shape[1]
    width = max([old_t, *(len(t) for t in token_ids)])
    ids = _pad_right(rollouts.completion_ids, width, pad_id).clone()  # [N, T']
    mask = _pad_right(rollouts.completion_mask, width, 0).clone()  # [N, T']
    logp = _pad_right(rollouts.behaviour_logp, width, 0.0).clone()  # [N, T']
    off = (
        torch.zeros_like(mask)
        if rollouts.offpolicy_mask is None
        else _pad_right(rollouts.offpolicy_mask, width, 0).clone()
    )  # [N, T']
    temperature, truncated = rollouts.temperature.clone(), rollouts.truncated.clone()  # [N]
    position = rollouts.position_temperature
    position = None if position is None else _pad_right(position, width, 1.0).clone()  # [N, T']
    tags, completions = list(sources_of(rollouts)), list(rollouts.completions)
    own = [False] * len(rows) if as_on_policy is None else list(as_on_policy)
    for row, tok, lp, src, temp, text, mine in zip(
        rows, token_ids, behaviour_logp, sources, temperatures, texts, own, strict=True
    ):
        n = len(tok)
        ids[row], mask[row], logp[row], off[row] = pad_id, 0, 0.0, 0
        ids[row, :n] = torch.as_tensor(list(tok), dtype=ids.dtype)
        mask[row, :n], off[row, :n] = 1, 0 if mine else 1
        if lp is not None:
            logp[row, :n] = torch.as_tensor(list(lp), dtype=logp.dtype)
        temperature[row], truncated[row] = temp, False
        if position is not None:
            position[row] = temp
        tags[row], completions[row] = src, text
    return dataclasses.replace(
        rollouts,
        completion_ids=ids,
        completion_mask=mask,
        behaviour_logp=logp,
        temperature=temperature,
        truncated=truncated,
        completions=completions,
        sources=tuple(tags),
        offpolicy_mask=off,
        position_temperature=position,
        **_single_turn_members(rollouts, rows, texts, width),
    )


def _single_turn_members(
    rollouts: Rollouts, rows: Sequence[int], texts: Sequence[str], width: int
) -> dict[str, Any]:
    """The multi-turn fields with ``rows`` made single-turn answers ``texts``: no environment
    token, one assistant message, one turn, no tool call, no environment reward."""
    if rollouts.env_mask is None:
        return {}
    env = _pad_right(rollouts.env_mask, width, 0).clone()  # [N, T']
    talks = list(rollouts.conversations or ({},) * rollouts.num_rows)
    stats = {k: v.clone() for k, v in (rollouts.turn_stats or {}).items()}
    for row, text in zip(rows, texts, strict=True):
        env[row] = 0
        talks[row] = ({"role": "assistant", "content": text},)
        for name, values in stats.items():
            values[row] = {"turns": 1.0, "env_reward": float("nan")}.get(name, 0.0)
    return {"env_mask": env, "conversations": tuple(talks), "turn_stats": stats or None}


def select_rows(rollouts: Rollouts, rows: Sequence[int], group_size: int = 1) -> Rollouts:
    """The rollouts of ``rows`` only, regrouped with ``group_size``."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=rollouts.completion_ids.device)
    tags = sources_of(rollouts)
    return dataclasses.replace(
        rollouts,
        prompt_ids=rollouts.prompt_ids[idx],
        prompt_mask=rollouts.prompt_mask[idx],
        completion_ids=rollouts.completion_ids[idx],
        completion_mask=rollouts.completion_mask[idx],
        behaviour_logp=rollouts.behaviour_logp[idx],
        temperature=rollouts.temperature[idx],
        truncated=rollouts.truncated[idx],
        completions=[rollouts.completions[i] for i in rows],
        group_size=group_size,
        sources=tuple(tags[i] for i in rows),
        offpolicy_mask=None if rollouts.offpolicy_mask is None else rollouts.offpolicy_mask[idx],
        position_temperature=None
        if rollouts.position_temperature is None
        else rollouts.position_temperature[idx],
        env_mask=None if rollouts.env_mask is None else rollouts.env_mask[idx],
        conversations=None
        if rollouts.conversations is None
        else tuple(rollouts.conversations[i] for i in rows),
        turn_stats=None
        if rollouts.turn_stats is None
        else {k: v[idx.cpu()] for k, v in rollouts.turn_stats.items()},
    )


def prompt_rows(batch: PromptBatch, groups: Sequence[int]) -> PromptBatch:
    """The prompts of batch rows ``groups`` (repeats allowed), as a new batch."""
    return PromptBatch(
        prompt_ids=[batch.prompt_ids[g] for g in groups],
        messages=[batch.messages[g] for g in groups],
        columns={k: [v[g] for g in groups] for k, v in batch.columns.items()},
        temperatures=None
        if batch.temperatures is None
        else [batch.temperatures[g] for g in groups],
        position_temperatures=batch.position_temperatures,
    )


def scored_batch(module: ScoringModule, seen: PromptBatch | None, scored: Scored) -> PromptBatch:
    """The prompts of ``scored``'s rows: the module's ``step_batch`` (set by ``training_step``,
    which may have added prompts, e.g. dynamic sampling), else ``seen``, the batch a callback
    saw in ``on_before_rollout``."""
    rows, g = scored.rollouts.num_rows, scored.rollouts.group_size
    for batch in (getattr(module, "step_batch", None), seen):
        if batch is not None and len(batch) * g == rows:
            return batch
    raise RuntimeError(
        f"No prompt batch matches the {rows} scored rows (G={g}); a callback that changes the "
        "batch must come before the injecting callback."
    )


def encode(tokenizer, text: str, eos_id: int) -> list[int]:
    """Token ids of a completion text, without special tokens, then EOS."""
    return [*tokenizer(text, add_special_tokens=False).input_ids, eos_id]


def inject(
    module: ScoringModule, batch: PromptBatch, scored: Scored, members: Sequence[Member]
) -> Scored:
    """``scored`` with ``members`` in their rows: tokenised, scored by the module's rewards
    (the prompt's columns, the same verifier as the samples), rewards overridden where asked.

    Adds ``source/<tag>/count``, ``/reward`` and ``/accuracy`` to the scored metrics.
    """
    if not members:
        return _with_source_metrics(scored)
    g = scored.rollouts.group_size
    if len(batch) * g != scored.rollouts.num_rows:
        raise ValueError(
            f"{scored.rollouts.num_rows} scored rows do not match {len(batch)} prompts x G={g}: "
            "a callback that changes the batch must come before the injecting callback."
        )
    eos = module.engine.eos_ids[0] if hasattr(module.engine, "eos_ids") else None
    eos = module.tokenizer.eos_token_id if eos is None else eos
    tokens = [
        list(m.token_ids) if m.token_ids is not None else encode(module.tokenizer, m.text, eos)
        for m in members
    ]
    texts = [
        m.text if m.text is not None else module.tokenizer.decode(t, skip_special_tokens=True)
        for m, t in zip(members, tokens, strict=True)
    ]
    rows = [m.row for m in members]
    rollouts = replace_rows(
        scored.rollouts,
        rows,
        tokens,
        [m.behaviour_logp for m in members],
        [m.source for m in members],
        [m.temperature for m in members],
        texts,
        module.tokenizer.pad_token_id,
        [m.as_on_policy for m in members],
    )
    sub = module.score(prompt_rows(batch, [r // g for r in rows]), select_rows(rollouts, rows))
    idx = torch.as_tensor(rows, device=scored.rewards.device)
    sub = _forced(module, sub, members)
    rewards, correct = scored.rewards.clone(), scored.correct.clone()  # [N]
    rewards[idx] = sub.rewards.to(rewards)
    correct[idx] = sub.correct.to(correct.device)
    per_function = {}
    for name, values in scored.per_function.items():
        values = values.clone()
        values[idx.to(values.device)] = sub.per_function[name].to(values)
        per_function[name] = values
    new = dataclasses.replace(
        scored, rollouts=rollouts, rewards=rewards, per_function=per_function, correct=correct
    )
    return _with_source_metrics(new)


def _forced(module: ScoringModule, sub: Scored, members: Sequence[Member]) -> Scored:
    """The members' scores (``sub``, one row per member) with each ``Member.reward`` floor
    applied to the accuracy reward (``offpolicy.floor_accuracy``): total and ``correct``
    follow."""
    forced = [i for i, m in enumerate(members) if m.reward is not None]
    if not forced:
        return sub
    name = module.accuracy_reward
    weight = {spec.name: spec.weight for spec in module.rewards.specs}[name]
    threshold = module.options.rewards.accuracy_threshold
    idx = torch.as_tensor(forced)  # [n]
    floors = torch.tensor([float(members[i].reward) for i in forced])  # [n]
    rewards, correct = sub.rewards.clone(), sub.correct.clone()  # [k]
    accuracy = sub.per_function[name].clone()  # [k]
    total, value, ok = floor_accuracy(
        rewards.cpu()[idx], accuracy.cpu()[idx], floors, weight, threshold
    )
    rewards[idx.to(rewards.device)] = total.to(rewards)
    accuracy[idx.to(accuracy.device)] = value.to(accuracy)
    correct[idx.to(correct.device)] = ok.to(correct)
    per_function = {**sub.per_function, name: accuracy}
    return dataclasses.replace(sub, rewards=rewards, correct=correct, per_function=per_function)


def _with_source_metrics(scored: Scored) -> Scored:
    tags = sources_of(scored.rollouts)
    metrics = dict(scored.metrics)
    rewards = scored.rewards.detach().float().cpu()  # [N]
    for tag in sorted(set(tags)):
        rows = torch.tensor([t == tag for t in tags])  # [N]
        metrics[f"source/{tag}/count"] = float(rows.sum())
        metrics[f"source/{tag}/reward"] = float(rewards[rows].mean())
        metrics[f"source/{tag}/accuracy"] = float(scored.correct.cpu()[rows].float().mean())
    return dataclasses.replace(scored, metrics=metrics)
