"""``π_old`` for a step: the trainer's pass (``device.trainer_pass``) at the base temperature,
or its deferral to the update's own forward, with the mismatch metrics against the sampler."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from rlvr_lightning.algorithms.correction import mismatch_metrics, rows_without_injected_tokens
from rlvr_lightning.device import DEFAULT_CHUNK_TOKENS, Probe, trainer_forward
from rlvr_lightning.types import Rollouts


def with_trainer_logprobs(
    model: nn.Module,
    rollouts: Rollouts,
    micro_batch_size: int,
    base_temperature: float,
    cap: float,
    value_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    probe: Probe | None = None,
) -> tuple[Rollouts, dict[str, float]]:
    """``rollouts`` with ``old_logp`` from the trainer and the on-policy rows' temperature set
    to ``base_temperature`` (the loss then sees the policy the trainer optimises, whatever
    temperature each row or token was sampled at; the per-position temperatures are dropped);
    injected rows keep their stored log-probs and temperatures. Also returns the mismatch
    metrics over the sampled tokens. With a ``value_head``, the same forward fills
    ``old_values``, with a ``probe`` ``probe_features``; ``head_chunk_tokens`` as in
    :func:`trainer_forward`."""
    r, on = _at_base_temperature(rollouts, base_temperature)
    old, values, features = trainer_forward(
        model, r, micro_batch_size, value_head, head_chunk_tokens, probe
    )  # [N, T], [N, T], [N, F]
    sampled = rollouts.loss_mask.float() * on[:, None]  # [N, T]
    if rollouts.offpolicy_mask is not None:
        old = torch.where(rollouts.offpolicy_mask.bool(), rollouts.behaviour_logp.float(), old)
    stats = mismatch_metrics(old, rollouts.behaviour_logp, sampled, cap)
    return dataclasses.replace(r, old_logp=old, old_values=values, probe_features=features), stats


def deferred_trainer_logprobs(rollouts: Rollouts, base_temperature: float) -> Rollouts:
    """``rollouts`` as :func:`with_trainer_logprobs` prepares them, without its forward: the
    tokens :func:`with_trainer_logprobs` would take from its forward get ``old_logp = NaN``,
    which the update reads as "this forward's own detached log-probs" (``update.PolicyUpdate``);
    injected tokens keep their stored log-probs, padding 0.

    Exact when the update takes one optimiser step over the whole batch: every micro-batch's
    forward then runs on the weights that were ``π_old`` (no step has happened yet), so the
    separate no-grad pass would compute the same numbers. The mismatch metrics come from the
    update then."""
    r, _ = _at_base_temperature(rollouts, base_temperature)
    valid = rollouts.completion_mask.bool()  # [N, T]
    # the tokens with_trainer_logprobs would fill from its forward (environment tokens keep 0)
    trainer_tokens = rollouts.loss_mask.bool()
    if rollouts.offpolicy_mask is not None:
        trainer_tokens = valid & ~rollouts.offpolicy_mask.bool()
    stored = torch.where(trainer_tokens, torch.nan, rollouts.behaviour_logp.float())  # [N, T]
    return dataclasses.replace(r, old_logp=torch.where(valid, stored, 0.0))


def _at_base_temperature(
    rollouts: Rollouts, base_temperature: float
) -> tuple[Rollouts, torch.Tensor]:
    """The on-policy rows' temperature set to ``base_temperature`` (per-position schedules
    dropped), and the ``[N]`` on-policy mask."""
    on = rows_without_injected_tokens(rollouts)  # [N]
    base = torch.full_like(rollouts.temperature, base_temperature)
    r = dataclasses.replace(
        rollouts,
        temperature=torch.where(on, base, rollouts.temperature),
        position_temperature=None,
    )
    return r, on
