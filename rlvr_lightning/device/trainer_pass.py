"""The trainer's no-grad pass over rollouts: ``π_old`` as the update computes it, and from the
same forward a value head's ``V_old`` and a probe's features."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import nn

from rlvr_lightning.algorithms.ops import masked_mean
from rlvr_lightning.device.chunked_head import DEFAULT_CHUNK_TOKENS
from rlvr_lightning.device.forward import completion_forward, group_microbatches
from rlvr_lightning.types import Rollouts


class Probe(Protocol):
    """What the pass reads of a probe head (``heads.ProbeHead``)."""

    layer: int
    last_tokens: int
    num_features: int

    def row_features(
        self, prompt_mean: torch.Tensor, response_mean: torch.Tensor, entropy: torch.Tensor
    ) -> torch.Tensor: ...


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
    probe: Probe | None = None,
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


