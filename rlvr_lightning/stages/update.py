"""One optimiser step's loss, accumulated over memory-bounded micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlvr_lightning.algorithms.correction import (
    CorrectionLevel,
    CorrectionMode,
    correction_weights,
    mismatch_metrics,
)
from rlvr_lightning.algorithms.losses import (
    AggMode,
    PolicyLossFn,
    agg_loss,
    agg_units,
    kl_estimate,
    value_loss,
)
from rlvr_lightning.algorithms.offpolicy import (
    finish_source_metrics,
    offpolicy_metric_terms,
    source_loss_terms,
    sources_of,
)
from rlvr_lightning.algorithms.offpolicy_losses import OffPolicyWeighting, mixed_policy_loss
from rlvr_lightning.algorithms.ops import masked_mean
from rlvr_lightning.device import (
    DEFAULT_CHUNK_TOKENS,
    completion_forward,
    completion_logprobs,
    group_microbatches,
)
from rlvr_lightning.types import Rollouts

if TYPE_CHECKING:
    from rlvr_lightning.heads import ValueBatch


def zero_loss(*modules: nn.Module) -> torch.Tensor:
    """A loss of exactly 0 that reaches every trainable parameter: its backward adds zero
    gradients and fires DDP's all-reduce hooks, without a forward that could be non-finite."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    return torch.stack([p.sum() for p in params]).sum() * 0.0


@dataclass(frozen=True)
class PolicyUpdate:
    """The policy objective of one mini-batch: loss fn + KL + entropy, aggregated once.

    Micro-batch losses are weighted by their share of the aggregation units (tokens or rows, see
    ``losses.agg_units``), so the accumulated gradient equals the full mini-batch gradient.
    The old log-probs are the behaviour log-probs recorded at generation time (no extra
    forward): exact for on-policy updates and the correct ``π_old`` for later epochs. When the
    module recomputed ``π_old`` with the trainer (``Rollouts.old_logp``, see ``correction.py``),
    that is ``π_old`` and each token's loss is weighted by ``rollout_correction`` (``tis``:
    ``min(π_old / π_behaviour, correction_cap)``; ``mask``; ``none``); a NaN there means "this
    forward's own detached log-probs" (``correction.deferred_trainer_logprobs``, for an update
    that takes one optimiser step over the batch), and the mismatch metrics are then measured
    here (``mismatch/*``). With a value head
    (``value``), the same forward gives ``V_θ`` and ``head.loss_coef`` times the value loss
    (a token-mean, so each micro-batch weighs by its share of the tokens) joins the objective.
    ``head_chunk_tokens``: tokens per chunk of the fused LM head in every forward (policy and
    reference), None for the model's full logits (see ``forward.completion_forward``).
    """

    loss_fn: PolicyLossFn
    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg_mode: AggMode
    norm_len: int
    kl_coef: float
    kl_estimator: str
    entropy_coef: float
    micro_batch_size: int
    offpolicy_weighting: OffPolicyWeighting = "shaping"
    offpolicy_gamma: float = 0.1
    offpolicy_exploration: float = 0.5
    rollout_correction: CorrectionMode = "tis"
    correction_cap: float = 2.0
    correction_level: CorrectionLevel = "token"
    head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS

    def accumulate(
        self,
        model: nn.Module,
        rollouts: Rollouts,
        advantages: torch.Tensor,
        rows: torch.Tensor,
        reference_logprobs: Callable[[Callable[[nn.Module], torch.Tensor]], torch.Tensor],
        backward: Callable[[torch.Tensor], None],
        mean_over_ranks: Callable[[float], float] | None = None,
        no_sync: Callable[[], AbstractContextManager] | None = None,
        value: ValueBatch | None = None,
    ) -> tuple[float, dict[str, float]]:
        """Backpropagate the loss of ``rows`` (``[n]`` indices); return it and its metrics.

        Under data parallelism ``mean_over_ranks`` is the mean of a number over the ranks whose
        gradients DDP averages and ``no_sync`` a context in which a backward does not all-reduce.
        Micro-batches are then weighted by their units over the ranks' mean unit count, so
        DDP's mean gradient is the union batch's (one token-mean over all ranks' tokens, not a
        mean of per-rank means); every rank, one without rows included, runs exactly one
        synchronising backward, and the returned loss is the union batch's on every rank, so a
        decision on it is the same everywhere. Metrics stay this rank's own means; with a
        value head they include ``value_loss`` (the union batch's, like the loss).
        """
        masks = rollouts.loss_mask  # [N, T] model tokens (no environment tokens)
        local_units = agg_units(masks[rows], self.agg_mode)
        reduce = mean_over_ranks or float
        mean_units = reduce(local_units)
        local_tokens = agg_units(masks[rows], "token-mean")
        mean_tokens = reduce(local_tokens) if value is not None else 0.0
        groups = rows // rollouts.group_size  # [n]
        micros = [rows[m] for m in group_microbatches(groups, self.micro_batch_size)]
        micros = [idx for idx in micros if agg_units(masks[idx], self.agg_mode) > 0]
        loss_share, value_share, sums, pairs = 0.0, 0.0, {}, []
        for i, idx in enumerate(micros):
            mask = masks[idx].float()  # [m, T]
            units, tokens = agg_units(mask, self.agg_mode), agg_units(mask, "token-mean")
            loss, v_loss, metrics, pair = self._micro_loss(
                model, rollouts, advantages, idx, mask, reference_logprobs, value
            )
            pairs += [] if pair is None else [pair]
            objective = loss * (units / mean_units)
            if v_loss is not None:
                objective = objective + value.head.loss_coef * v_loss * (tokens / mean_tokens)
                value_share += float(v_loss.detach()) * tokens / mean_tokens
            defer = no_sync is not None and i < len(micros) - 1
            with no_sync() if defer else nullcontext():
                backward(objective)
            loss_share += float(loss.detach()) * units / mean_units
            for k, v in metrics.items():
                share = tokens / local_tokens if k.startswith("value_") else units / local_units
                sums[k] = sums.get(k, 0.0) + float(v) * share
        if not micros and mean_over_ranks is not None and mean_units > 0:
            heads = () if value is None else (value.head,)
            backward(zero_loss(model, *heads))  # other ranks train: take part in their all-reduce
        loss_total = reduce(loss_share) if mean_units > 0 else 0.0
        metrics = finish_source_metrics(sums, rollouts, advantages, rows)
        if value is not None:
            metrics["value_loss"] = reduce(value_share) if mean_tokens > 0 else 0.0
        metrics.update(self._mismatch(pairs))
        return loss_total, metrics

    def _mismatch(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """With ``π_old`` from this update's forwards, the sampler mismatch is measured here."""
        if not pairs:
            return {}
        old, behaviour = (torch.cat(x) for x in zip(*pairs, strict=True))
        stats = mismatch_metrics(old, behaviour, torch.ones_like(old), self.correction_cap)
        return {f"mismatch/{k}": v for k, v in stats.items()}

    def _logprobs_of(self, inputs: tuple) -> Callable[[nn.Module], torch.Tensor]:
        """``model -> [m, T]`` log-probs of ``inputs``' completions, as the update computes them."""

        def logprobs(model: nn.Module) -> torch.Tensor:
            return completion_logprobs(model, *inputs, head_chunk_tokens=self.head_chunk_tokens)[0]

        return logprobs

    def _micro_loss(self, model, rollouts, advantages, idx, mask, reference_logprobs, value):
        inputs = (
            rollouts.prompt_ids[idx],
            rollouts.prompt_mask[idx],
            rollouts.completion_ids[idx],
            rollouts.completion_mask[idx],
            rollouts.temperature[idx],
        )
        logp, entropy, values, _ = completion_forward(
            model,
            *inputs,
            with_entropy=True,
            entropy_grad=self.entropy_coef > 0,
            value_head=None if value is None else value.head,
            head_chunk_tokens=self.head_chunk_tokens,
        )  # [m, T] each (values: None without a value head)
        old_logp, weights, deferred = self._old_logp(rollouts, idx, logp, mask)
        loss_mat, metrics = self._loss_matrix(rollouts, idx, logp, old_logp, advantages, mask)
        loss_mat = loss_mat if weights is None else loss_mat * weights
        if rollouts.offpolicy_mask is not None:
            metrics = offpolicy_metric_terms(metrics, rollouts.offpolicy_mask[idx], mask)
            tags = [sources_of(rollouts)[i] for i in idx.tolist()]
            metrics.update(source_loss_terms(loss_mat, mask, tags, self.agg_mode, self.norm_len))
        loss = agg_loss(loss_mat, mask, self.agg_mode, norm_len=self.norm_len)
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["policy_loss"] = float(loss.detach())
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        loss = self._regularised(loss, metrics, inputs, logp, entropy, mask, reference_logprobs)
        pairs = None  # π_old and π_behaviour of the tokens whose π_old this forward gave
        if deferred is not None and bool(deferred.any()):
            pairs = (old_logp[deferred].cpu(), rollouts.behaviour_logp[idx][deferred].float().cpu())
        if value is None:
            return loss, None, metrics, pairs
        v_loss, v_metrics = value_loss(
            values, value.old_values[idx], value.returns[idx], mask, value.head.clip_range
        )
        return loss, v_loss, {**metrics, **{k: float(v) for k, v in v_metrics.items()}}, pairs

    def _old_logp(
        self, rollouts: Rollouts, idx: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``π_old`` ``[m, T]`` of the micro-batch (NaN in ``Rollouts.old_logp``: this forward's
        own, detached), the correction weights of ``π_old / π_behaviour`` and the ``[m, T]``
        tokens whose ``π_old`` came from this forward (None: the engine's log-probs)."""
        old_logp = rollouts.behaviour_logp[idx]  # [m, T]
        if rollouts.old_logp is None:
            return old_logp, None, None
        stored = rollouts.old_logp[idx]  # [m, T]; NaN: this forward's own
        deferred = stored.isnan() & (mask > 0)  # [m, T]
        old_logp = torch.where(stored.isnan(), logp.detach().float(), stored)  # [m, T]
        weights = correction_weights(
            old_logp,
            rollouts.behaviour_logp[idx],
            mask,
            self.rollout_correction,
            self.correction_cap,
            self.correction_level,
        )  # [m, T]
        return old_logp, weights, deferred

    def _loss_matrix(self, rollouts, idx, logp, old_logp, advantages, mask):
        """The ``[m, T]`` policy loss and its metrics: the loss function, or with injected rows
        the mixed loss (``offpolicy_losses.mixed_policy_loss``)."""
        clip = {"clip_low": self.clip_low, "clip_high": self.clip_high, "dual_clip": self.dual_clip}
        if rollouts.offpolicy_mask is None:
            return self.loss_fn(logp, old_logp, advantages[idx], mask, **clip)
        return mixed_policy_loss(
            self.loss_fn,
            logp,
            old_logp,
            advantages[idx],
            mask,
            rollouts.offpolicy_mask[idx],
            weighting=self.offpolicy_weighting,
            gamma=self.offpolicy_gamma,
            exploration=self.offpolicy_exploration,
            **clip,
        )

    def _regularised(self, loss, metrics, inputs, logp, entropy, mask, reference_logprobs):
        """``loss`` plus the KL-to-reference term and minus the entropy bonus, where on."""
        if self.kl_coef > 0:
            ref = reference_logprobs(self._logprobs_of(inputs))  # [m, T]
            kl = agg_loss(
                kl_estimate(logp, ref, self.kl_estimator),
                mask,
                self.agg_mode,
                norm_len=self.norm_len,
            )
            loss = loss + self.kl_coef * kl
            metrics["kl"] = float(kl.detach())
        if self.entropy_coef > 0:
            loss = loss - self.entropy_coef * agg_loss(
                entropy, mask, self.agg_mode, norm_len=self.norm_len
            )
        return loss
