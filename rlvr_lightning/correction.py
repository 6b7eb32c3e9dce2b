"""Rollout correction: when the sampler's numbers are not the trainer's.

An engine that holds its own weights (vLLM) computes the behaviour log-probs with other kernels,
often in another dtype; a temperature schedule samples from a distribution the trainer does not
score. Using those log-probs as ``π_old`` makes the importance ratio start away from 1 and the
clipping act on numerical noise (the vLLM quickstart in bf16 went 0.06 -> 0.02 that way). So,
where they may differ, ``π_old`` is recomputed by the trainer (:func:`trainer_forward`, one
no-grad forward in the update's precision) and the behaviour log-probs serve only to weight
each token by truncated importance sampling, ``ρ = min(π_old / π_behaviour, C)`` (spec §5.2,
verl's TIS), or to mask tokens whose ratio leaves ``[1/C, C]``.

Pure maths on ``[N, T]`` tensors plus one stage helper that takes the model and the rollouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, NamedTuple

import torch
from torch import nn

from rlvr_lightning.chunked_head import DEFAULT_CHUNK_TOKENS
from rlvr_lightning.forward import completion_forward, group_microbatches
from rlvr_lightning.ops import masked_mean
from rlvr_lightning.types import Rollouts

if TYPE_CHECKING:
    from rlvr_lightning.heads.probe_head import ProbeHead

CorrectionMode = Literal["tis", "mask", "none"]
CorrectionLevel = Literal["token", "sequence"]


def log_ratio(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, level: CorrectionLevel, mask: torch.Tensor
) -> torch.Tensor:
    """``[N, T]`` log of ``π_old / π_behaviour`` per token, or per sequence (the sum over its
    tokens, broadcast to every token of the row); 0 on padding."""
    tokens = (old_logp - behaviour_logp) * mask  # [N, T]
    if level == "sequence":
        return tokens.sum(-1, keepdim=True).expand_as(tokens) * mask
    if level != "token":
        raise ValueError(f"correction level must be 'token' or 'sequence', got {level!r}.")
    return tokens


def correction_weights(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: CorrectionMode,
    cap: float,
    level: CorrectionLevel = "token",
) -> torch.Tensor:
    """``[N, T]`` detached per-token weights of the policy loss.

    ``tis``: ``min(exp(log_ratio), cap)``; ``mask``: 1 where ``1/cap <= ratio <= cap``, else 0
    (the token leaves the loss but keeps its place in the normaliser, as a weight of 0 would);
    ``none``: 1. Padding gets 0.
    """
    if cap <= 1:
        raise ValueError(f"rollout_correction_cap must be > 1, got {cap}.")
    lr = log_ratio(old_logp.detach(), behaviour_logp.detach(), level, mask)  # [N, T]
    if mode == "tis":
        return torch.exp(lr).clamp(max=cap) * mask
    if mode == "mask":
        bound = torch.log(torch.tensor(cap, dtype=lr.dtype))
        return (lr.abs() <= bound).to(mask.dtype) * mask
    if mode == "none":
        return mask.clone()
    raise ValueError(f"rollout_correction must be 'tis', 'mask' or 'none', got {mode!r}.")


def mismatch_metrics(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """How far the sampler is from the trainer, over the tokens of ``mask``.

    ``kl``: the k3 estimate of ``KL(π_behaviour || π_old)`` (tokens were drawn from the
    behaviour policy: ``r - 1 - log r`` with ``r = π_old / π_behaviour``, always >= 0);
    ``ratio_min`` / ``ratio_max``: token ratio extremes; ``capped_frac``: share of tokens whose
    ratio exceeds ``cap``.
    """
    m = mask.bool()
    if not bool(m.any()):
        return {}
    lr = (old_logp - behaviour_logp).double()[m]  # [n_tokens]
    r = lr.exp()
    return {
        "kl": float((r - 1 - lr).mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "capped_frac": float((r > cap).double().mean()),
    }


class TrainerPass(NamedTuple):
    """What :func:`trainer_forward` gives: ``π_old`` ``[N, T]``, a value head's ``V_old``
    ``[N, T]`` and a probe head's inputs ``[N, F]`` (each None without that head)."""

    logp: torch.Tensor
    values: torch.Tensor | None
    probe_features: torch.Tensor | None


@torch.no_grad()
def trainer_forward(
    model: nn.Module,
    rollouts: Rollouts,
    micro_batch_size: int,
    value_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    probe: ProbeHead | None = None,
) -> TrainerPass:
    """``[N, T]`` log-probs of the sampled tokens under ``model`` as the update computes them
    (same forward, same temperatures, same LM-head path ``head_chunk_tokens``, whatever
    autocast is active), in micro-batches of whole groups; from the same forward, the
    ``[N, T]`` values of ``value_head`` and, with a ``probe``, its ``[N, F]`` inputs (the
    hidden-state means at ``probe.layer`` and the mean token entropy,
    ``ProbeHead.row_features``); 0 on padding."""
    out = torch.zeros_like(rollouts.behaviour_logp, dtype=torch.float32)  # [N, T]
    values = None if value_head is None else torch.zeros_like(out)  # [N, T]
    features = None if probe is None else out.new_zeros(len(out), probe.num_features)  # [N, F]
    groups = torch.arange(rollouts.num_rows, device=out.device) // rollouts.group_size  # [N]
    was_training = model.training
    model.eval()
    try:
        for idx in group_microbatches(groups, micro_batch_size):
            mask = rollouts.completion_mask[idx]  # [m, T]
            fwd = completion_forward(
                model,
                rollouts.prompt_ids[idx],
                rollouts.prompt_mask[idx],
                rollouts.completion_ids[idx],
                mask,
                rollouts.temperature[idx],
                with_entropy=probe is not None,
                value_head=value_head,
                head_chunk_tokens=head_chunk_tokens,
                layer_means=None if probe is None else (probe.layer, probe.last_tokens),
            )
            out[idx] = fwd.logp.float() * mask
            if values is not None:
                values[idx] = torch.where(mask.bool(), fwd.values, 0.0)
            if features is not None:
                entropy = masked_mean(fwd.entropy.float(), mask, dim=-1)  # [m]
                features[idx] = probe.row_features(*fwd.layer_means, entropy)
    finally:
        model.train(was_training)
    return TrainerPass(out, values, features)


def needs_trainer_logprobs(
    choice: str, engine_shares_policy: bool, rollouts: Rollouts, base_temperature: float
) -> bool:
    """Whether ``π_old`` must come from the trainer: ``choice`` is ``trainer``, or ``auto``
    and the sampler differs from the trainer (an engine with its own weights, or sampled
    tokens of on-policy rows drawn at a temperature other than ``base_temperature``: a
    per-row temperature, or a per-position schedule such as EAD's)."""
    if choice in ("trainer", "engine"):
        return choice == "trainer"
    if choice != "auto":
        raise ValueError(f"old_logprobs must be 'auto', 'engine' or 'trainer', got {choice!r}.")
    on = _on_policy(rollouts)  # [N]
    sampled = rollouts.completion_mask.bool() & on[:, None]  # [N, T]
    retempered = bool((rollouts.token_temperature[sampled] != base_temperature).any())
    return not engine_shares_policy or retempered


def _on_policy(rollouts: Rollouts) -> torch.Tensor:
    if rollouts.offpolicy_mask is None:
        return torch.ones(rollouts.num_rows, dtype=torch.bool, device=rollouts.temperature.device)
    return ~rollouts.offpolicy_mask.bool().any(-1)


def with_trainer_logprobs(
    model: nn.Module,
    rollouts: Rollouts,
    micro_batch_size: int,
    base_temperature: float,
    cap: float,
    value_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    probe: ProbeHead | None = None,
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
    sampled = rollouts.completion_mask.float() * on[:, None]  # [N, T]
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
    trainer_tokens = valid  # the tokens with_trainer_logprobs would fill from its forward
    if rollouts.offpolicy_mask is not None:
        trainer_tokens = valid & ~rollouts.offpolicy_mask.bool()
    stored = torch.where(trainer_tokens, torch.nan, rollouts.behaviour_logp.float())  # [N, T]
    return dataclasses.replace(r, old_logp=torch.where(valid, stored, 0.0))


def _at_base_temperature(
    rollouts: Rollouts, base_temperature: float
) -> tuple[Rollouts, torch.Tensor]:
    """The on-policy rows' temperature set to ``base_temperature`` (per-position schedules
    dropped), and the ``[N]`` on-policy mask."""
    on = _on_policy(rollouts)  # [N]
    base = torch.full_like(rollouts.temperature, base_temperature)
    r = dataclasses.replace(
        rollouts,
        temperature=torch.where(on, base, rollouts.temperature),
        position_temperature=None,
    )
    return r, on
