"""One optimiser step's loss, accumulated over memory-bounded micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rlvr_lightning.forward import completion_logprobs, group_microbatches
from rlvr_lightning.losses import (
    AggMode,
    OffPolicyWeighting,
    PolicyLossFn,
    agg_loss,
    agg_units,
    kl_estimate,
    mixed_policy_loss,
)
from rlvr_lightning.offpolicy import (
    finish_source_metrics,
    offpolicy_metric_terms,
    source_loss_terms,
    sources_of,
)
from rlvr_lightning.ops import masked_mean
from rlvr_lightning.types import Rollouts


@dataclass(frozen=True)
class PolicyUpdate:
    """The policy objective of one mini-batch: loss fn + KL + entropy, aggregated once.

    Micro-batch losses are weighted by their share of the aggregation units (tokens or rows, see
    ``losses.agg_units``), so the accumulated gradient equals the full mini-batch gradient.
    The old log-probs are the behaviour log-probs recorded at generation time (no extra
    forward): exact for on-policy updates and the correct ``π_old`` for later epochs.
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

    def accumulate(
        self,
        model: nn.Module,
        rollouts: Rollouts,
        advantages: torch.Tensor,
        rows: torch.Tensor,
        reference_logprobs: Callable[[Callable[[nn.Module], torch.Tensor]], torch.Tensor],
        backward: Callable[[torch.Tensor], None],
    ) -> tuple[float, dict[str, float]]:
        """Backpropagate the loss of ``rows`` (``[n]`` indices); return it and its metrics."""
        total_units = agg_units(rollouts.completion_mask[rows], self.agg_mode)
        loss_total, sums = 0.0, {}
        groups = rows // rollouts.group_size  # [n]
        for micro in group_microbatches(groups, self.micro_batch_size):
            idx = rows[micro]  # [m]
            mask = rollouts.completion_mask[idx].float()  # [m, T]
            weight = agg_units(mask, self.agg_mode) / max(total_units, 1)
            if weight == 0:
                continue
            loss, metrics = self._micro_loss(
                model, rollouts, advantages, idx, mask, reference_logprobs
            )
            backward(loss * weight)
            loss_total += float(loss.detach()) * weight
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
        return loss_total, finish_source_metrics(sums, rollouts, advantages, rows)

    def _micro_loss(self, model, rollouts, advantages, idx, mask, reference_logprobs):
        inputs = (
            rollouts.prompt_ids[idx],
            rollouts.prompt_mask[idx],
            rollouts.completion_ids[idx],
            rollouts.completion_mask[idx],
            rollouts.temperature[idx],
        )
        logp, entropy = completion_logprobs(
            model, *inputs, with_entropy=True, entropy_grad=self.entropy_coef > 0
        )  # [m, T]
        old_logp = rollouts.behaviour_logp[idx]  # [m, T]
        clip = {"clip_low": self.clip_low, "clip_high": self.clip_high, "dual_clip": self.dual_clip}
        if rollouts.offpolicy_mask is None:
            loss_mat, metrics = self.loss_fn(logp, old_logp, advantages[idx], mask, **clip)
        else:
            loss_mat, metrics = mixed_policy_loss(
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
            metrics = offpolicy_metric_terms(metrics, rollouts.offpolicy_mask[idx], mask)
            tags = [sources_of(rollouts)[i] for i in idx.tolist()]
            metrics.update(source_loss_terms(loss_mat, mask, tags, self.agg_mode, self.norm_len))
        loss = agg_loss(loss_mat, mask, self.agg_mode, norm_len=self.norm_len)
        metrics = {k: float(v) for k, v in metrics.items()}
        metrics["policy_loss"] = float(loss.detach())
        metrics["entropy"] = float(masked_mean(entropy.detach(), mask))
        if self.kl_coef > 0:
            ref = reference_logprobs(lambda m: completion_logprobs(m, *inputs)[0])  # [m, T]
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
        return loss, metrics
