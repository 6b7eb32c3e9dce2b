"""Dynamic sampling (DAPO, spec §8.2): generate more groups until enough are informative.

A group is informative when the module's ``select_groups`` keeps it (its accuracy outcome
varies, by default, and the data module's curriculum, if any, lets it train). When fewer than
the step's prompt count are informative, more prompts are drawn from the data module and
generated, for at most ``max_rounds`` extra rounds; the update then uses exactly the target
number of informative groups (uninformative and surplus groups stay in the batch for
statistics, with no gradient).

Order within a step: each round is generated, scored and passed through the ``on_after_score``
hooks (``RLVRModule.generate_round``) before ``select_groups`` judges it, so a group that a hook
rescues (ground-truth injection into an all-wrong group) counts as informative and is not
replaced by an extra prompt. The hooks therefore run once per round, each time on that round's
prompts (``module.step_batch``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from rlvr_lightning.algorithms.outcomes import sampled_rows
from rlvr_lightning.types import PromptBatch, Rollouts, Scored


def _pad_to(x: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    """``[N, W]`` padded with ``value`` to ``[N, width]`` on the left or right."""
    pad = width - x.shape[1]
    if pad <= 0:
        return x
    filler = torch.full((x.shape[0], pad), value, dtype=x.dtype, device=x.device)
    return torch.cat([filler, x] if left else [x, filler], dim=1)


def concat_prompt_batches(a: PromptBatch, b: PromptBatch) -> PromptBatch:
    """Prompts of ``a`` then ``b``; a column missing on one side is ``None`` there."""
    names = list(dict.fromkeys([*a.columns, *b.columns]))
    columns = {
        n: list(a.columns.get(n, [None] * len(a))) + list(b.columns.get(n, [None] * len(b)))
        for n in names
    }
    temps = None
    if a.temperatures is not None or b.temperatures is not None:
        temps = [*(a.temperatures or [None] * len(a)), *(b.temperatures or [None] * len(b))]
    schedule = a.position_temperatures
    return PromptBatch(
        [*a.prompt_ids, *b.prompt_ids],
        [*a.messages, *b.messages],
        columns=columns,
        temperatures=temps,
        position_temperatures=b.position_temperatures if schedule is None else schedule,
    )


def concat_rollouts(a: Rollouts, b: Rollouts, pad_id: int) -> Rollouts:
    """Rows of ``a`` then ``b``: prompts re-left-padded, completions re-right-padded."""
    if a.group_size != b.group_size:
        raise ValueError(f"Group sizes differ: {a.group_size} vs {b.group_size}.")
    p = max(a.prompt_ids.shape[1], b.prompt_ids.shape[1])
    t = max(a.completion_ids.shape[1], b.completion_ids.shape[1])

    def cat(name: str, width: int, value: float, left: bool) -> torch.Tensor:
        xs = [_pad_to(getattr(r, name), width, value, left) for r in (a, b)]
        return torch.cat(xs, dim=0)

    offpolicy = None
    if a.offpolicy_mask is not None or b.offpolicy_mask is not None:
        masks = [
            _pad_to(
                r.offpolicy_mask
                if r.offpolicy_mask is not None
                else torch.zeros_like(r.completion_mask),
                t,
                0,
                left=False,
            )
            for r in (a, b)
        ]
        offpolicy = torch.cat(masks, dim=0)  # [Na + Nb, T]
    env = None
    if a.env_mask is not None or b.env_mask is not None:
        envs = [
            _pad_to(
                r.env_mask if r.env_mask is not None else torch.zeros_like(r.completion_mask),
                t,
                0,
                left=False,
            )
            for r in (a, b)
        ]
        env = torch.cat(envs, dim=0)  # [Na + Nb, T]
    position = None
    if a.position_temperature is not None or b.position_temperature is not None:
        temps = [_pad_to(r.token_temperature, t, 1.0, left=False) for r in (a, b)]
        position = torch.cat(temps, dim=0)  # [Na + Nb, T]
    sources = (a.sources or ("policy",) * a.num_rows) + (b.sources or ("policy",) * b.num_rows)
    return Rollouts(
        prompt_ids=cat("prompt_ids", p, pad_id, left=True),  # [Na + Nb, P]
        prompt_mask=cat("prompt_mask", p, 0, left=True),
        completion_ids=cat("completion_ids", t, pad_id, left=False),  # [Na + Nb, T]
        completion_mask=cat("completion_mask", t, 0, left=False),
        behaviour_logp=cat("behaviour_logp", t, 0.0, left=False),
        temperature=torch.cat([a.temperature, b.temperature]),
        truncated=torch.cat([a.truncated, b.truncated]),
        completions=[*a.completions, *b.completions],
        group_size=a.group_size,
        sources=sources if (a.sources or b.sources) else (),
        offpolicy_mask=offpolicy,
        position_temperature=position,
        env_mask=env,
        conversations=_conversations(a, b),
        turn_stats=_turn_stats(a, b),
    )


def _turn_stats(a: Rollouts, b: Rollouts) -> dict[str, torch.Tensor] | None:
    """The per-trajectory counts of ``a`` then ``b`` (a single-turn row: one turn, no tools)."""
    if a.turn_stats is None and b.turn_stats is None:
        return None
    names = set(a.turn_stats or {}) | set(b.turn_stats or {})

    def col(r: Rollouts, name: str) -> torch.Tensor:
        if r.turn_stats is not None and name in r.turn_stats:
            return r.turn_stats[name]
        fill = {"turns": 1.0, "env_reward": float("nan")}.get(name, 0.0)
        return torch.full((r.num_rows,), fill)

    return {name: torch.cat([col(a, name), col(b, name)]) for name in sorted(names)}


def _conversations(a: Rollouts, b: Rollouts) -> tuple | None:
    """The multi-turn conversations of ``a`` then ``b`` (a single-turn row: its one answer)."""
    if a.conversations is None and b.conversations is None:
        return None

    def rows(r: Rollouts) -> tuple:
        if r.conversations is not None:
            return r.conversations
        return tuple(({"role": "assistant", "content": c},) for c in r.completions)

    return rows(a) + rows(b)


def _row_values(s: Scored, name: str, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """``[N]`` optional per-row field of ``s``, ``fill`` where it is unset."""
    value = getattr(s, name)
    if value is None:
        return torch.full((s.rollouts.num_rows,), fill, dtype=dtype, device=s.rewards.device)
    return value


def concat_scored(a: Scored, b: Scored, pad_id: int) -> Scored:
    """Scored rows of ``a`` then ``b``; per-step metrics are averaged.

    The sampled snapshot, the baseline mask and the advantage cap (set by hooks) are carried:
    a side without one gets its own rows, all-True, and no cap.
    """
    names = list(dict.fromkeys([*a.per_function, *b.per_function]))

    def per_fn(s: Scored, name: str) -> torch.Tensor:
        return s.per_function.get(name, torch.full((s.rollouts.num_rows,), float("nan")))

    def cat_optional(name: str, fill: float, dtype: torch.dtype) -> torch.Tensor | None:
        if getattr(a, name) is None and getattr(b, name) is None:
            return None
        parts = [_row_values(s, name, fill, dtype) for s in (a, b)]
        return torch.cat([parts[0], parts[1].to(parts[0].device)])

    keys = set(a.metrics) | set(b.metrics)
    sampled = [sampled_rows(s) for s in (a, b)]
    return Scored(
        rollouts=concat_rollouts(a.rollouts, b.rollouts, pad_id),
        rewards=torch.cat([a.rewards, b.rewards.to(a.rewards.device)]),
        per_function={n: torch.cat([per_fn(a, n), per_fn(b, n)]) for n in names},
        correct=torch.cat([a.correct, b.correct.to(a.correct.device)]),
        metrics={k: (a.metrics.get(k, 0.0) + b.metrics.get(k, 0.0)) / 2 for k in keys},
        baseline_mask=cat_optional("baseline_mask", 1, torch.bool),
        advantage_cap=cat_optional("advantage_cap", float("inf"), torch.float32),
        sampled_correct=torch.cat([sampled[0][0], sampled[1][0].to(sampled[0][0].device)]),
        sampled_rewards=torch.cat([sampled[0][1], sampled[1][1].to(sampled[0][1].device)]),
    )


def keep_first(mask: torch.Tensor, target: int) -> torch.Tensor:
    """``mask`` with only its first ``target`` True entries kept (DAPO's truncation)."""
    return mask & (mask.long().cumsum(0) <= target)


def prompts_to_draw(missing: int, informative_rate: float, cap: int) -> int:
    """Prompts for the next round: ``ceil(missing / rate)``, at most ``cap``, at least 1.

    The rate is the informative share seen so far in this step (floored at ``1 / cap`` so a
    step with no informative group draws ``cap``); this project's choice, to waste little
    generation once most groups are informative.
    """
    rate = max(informative_rate, 1.0 / cap)
    return max(1, min(cap, math.ceil(missing / rate)))


@dataclass
class Refill:
    batch: PromptBatch  # [B'] the step's prompts and the extra rounds' prompts
    scored: Scored  # [B' * G]
    metrics: dict[str, float]


def refill(
    batch: PromptBatch,
    scored: Scored,
    select: Callable[[PromptBatch, Scored], torch.Tensor],
    draw: Callable[[int, list[str]], PromptBatch],
    generate: Callable[[PromptBatch], Scored],
    max_rounds: int,
    pad_id: int,
    agree: Callable[[int], int] = lambda n: n,
) -> Refill:
    """Generate extra rounds until ``len(batch)`` groups are informative or rounds run out.

    ``scored`` and every round ``generate`` returns have been through the hooks already; the
    caller keeps the first ``len(batch)`` informative groups (``keep_first``).

    Args:
        select: ``[B]`` bool informative groups of a batch.
        draw: ``n`` more prompts, excluding the given ids.
        generate: rollout, score and run the ``on_after_score`` hooks on a prompt batch.
        max_rounds: extra generation rounds at most.
        pad_id: padding token of the re-padded tensors.
        agree: the maximum of a count over ranks under DDP (identity otherwise), so all ranks
            run the same rounds and draw the same number of prompts.
    """
    target = len(batch)
    groups = select(batch, scored)  # [B]
    rounds, drawn = 0, 0
    while rounds < max_rounds:
        missing = agree(max(target - int(groups.sum()), 0))
        if missing == 0:
            break
        n = agree(prompts_to_draw(missing, float(groups.float().mean()), target))
        extra = draw(n, list(batch.prompt_ids))
        extra_scored = generate(extra)
        batch = concat_prompt_batches(batch, extra)
        scored = concat_scored(scored, extra_scored, pad_id)
        groups = torch.cat([groups, select(extra, extra_scored)])
        rounds, drawn = rounds + 1, drawn + n
    informative = int(groups.sum())
    metrics = {
        "dynamic/rounds": float(rounds),
        "dynamic/prompts": float(len(batch)),
        "dynamic/extra_prompts": float(drawn),
        "dynamic/informative": float(informative),
        "dynamic/shortfall": float(max(target - informative, 0)),
    }
    return Refill(batch, scored, metrics)


def refill_step(
    trainer: pl.Trainer,
    batch: PromptBatch,
    scored: Scored,
    select: Callable[[PromptBatch, Scored], torch.Tensor],
    generate: Callable[[PromptBatch], Scored],
    max_rounds: int,
    pad_id: int,
) -> tuple[PromptBatch, Scored, dict[str, float]]:
    """``refill`` for a training step: prompts from the trainer's data module's
    ``draw_prompts``, counts agreed across ranks; ``select`` and ``generate`` are the module's
    ``select_groups`` and ``generate_round``."""
    datamodule = getattr(trainer, "datamodule", None)
    if not hasattr(datamodule, "draw_prompts"):
        raise ValueError("dynamic_sampling needs a data module with draw_prompts (RLVRDataModule).")

    def agree(n: int) -> int:  # the same count on every rank
        return int(trainer.strategy.reduce(torch.tensor(float(n)), reduce_op="max"))

    result = refill(
        batch, scored, select, datamodule.draw_prompts, generate, max_rounds, pad_id, agree
    )
    return result.batch, result.scored, result.metrics


class DynamicStage(pl.LightningModule):
    """Dynamic sampling's extra rounds as ``RLVRModule``'s own method (a mixin)."""

    def _refill(self, batch: PromptBatch, scored: Scored) -> tuple[PromptBatch, Scored, dict]:
        """``refill_step`` with the module's ``select_groups`` and ``generate_round``."""
        max_rounds, pad = self.options.selection.max_gen_rounds, self.tokenizer.pad_token_id
        batch, scored, metrics = refill_step(
            self.trainer, batch, scored, self.select_groups, self.generate_round, max_rounds, pad
        )
        self.step_batch = batch
        return batch, scored, metrics
