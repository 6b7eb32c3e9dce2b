"""RLVRModule: the policy, its reference, and a training step that orchestrates pure functions.

``training_step`` = ``rollout`` -> ``score`` -> ``compute_advantages`` -> ``update``; each is a
public method a subclass may override. The math lives in ``losses``, ``advantages`` and ``ops``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torchmetrics import MeanMetric

from rlvr_lightning import advantages as adv_lib
from rlvr_lightning import models
from rlvr_lightning.hooks import RLVRCallback
from rlvr_lightning.metrics import PassAtK
from rlvr_lightning.presets import AlgorithmName, EstimatorName, get_preset
from rlvr_lightning.rewards import OverlongPenalty, RewardCombiner, boxed_accuracy, boxed_format
from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored, StepOutput
from rlvr_lightning.update import PolicyUpdate

log = logging.getLogger(__name__)


def _plain_hparam(value: Any) -> Any:
    """Hyperparameters as plain data, so checkpoints load with ``weights_only=True`` and
    LightningCLI can re-read them: dataclasses become dicts, importable functions and classes
    their import path; other callables (instances) their ``repr``, which is informative only.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return [_plain_hparam(v) for v in value]
    if callable(value):
        qualname = getattr(value, "__qualname__", "")
        if qualname and "<" not in qualname:
            return f"{value.__module__}.{qualname}"
        return repr(value)
    return value


class RLVRModule(pl.LightningModule):
    """GRPO-style RL with verifiable rewards.

    Args:
        policy: model name: a local folder or Hub id, ``embedded:smollm2-135m-instruct``, or
            ``tiny:<seed>`` for an in-process random model.
        dtype: parameter dtype of the policy (``float32`` or ``bfloat16``).
        algorithm: preset filling the defaults of the loss, clipping, aggregation and advantage
            estimator: ``grpo``, ``dapo``, ``dr_grpo``, ``gspo`` or ``cispo``.
        loss_fn: a custom per-token policy loss (import path in YAML) with the signature of
            ``losses.PolicyLossFn``; overrides the preset's loss.
        estimator: advantage estimator (``grpo``, ``dr_grpo``, ``rloo``); None = the preset's.
        agg_mode: loss aggregation (see ``losses.agg_loss``); None = the preset's.
        clip_low: lower clip range; None = the preset's.
        clip_high: upper clip range; None = the preset's.
        dual_clip: dual-clip constant for negative advantages (None = off).
        filter_zero_variance: drop groups with identical rewards from the update (no refill);
            None = the preset's (on for ``dapo``).
        reward_fns: reward functions ``fn(completions, **columns) -> list[float | None]``; by
            default ``boxed_accuracy`` and ``boxed_format``.
        reward_weights: one weight per reward function (default: all 1).
        reward_timeout_s: seconds a reward function may run before its rows score 0.
        accuracy_reward: name of the reward that defines "correct" (default: the first).
        accuracy_threshold: a row is correct when that reward is >= this value.
        sampling: training sampling (``group_size`` is G).
        val_sampling: validation sampling; temperature 0 is greedy, ``group_size`` > 1 adds
            pass@k with k = group_size (sampled at the given temperature).
        epochs_per_rollout: optimisation passes over each rollout batch.
        minibatches_per_rollout: optimiser steps per pass (each over a share of the rows).
        micro_batch_size: rows per forward/backward; bounds memory, not the maths.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up in optimiser steps, then constant.
        grad_clip: max gradient norm (None = no clipping).
        kl_coef: weight of the KL-to-reference term in the loss; 0 skips the reference model.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (spec §8.6).
        entropy_coef: weight of an entropy bonus in the loss.
        lora_rank: LoRA rank; 0 trains all parameters.
        lora_alpha: LoRA alpha.
        lora_target_modules: modules LoRA wraps (peft names or ``all-linear``).
        max_nonfinite_steps: consecutive skipped non-finite updates before training stops.
        engine: rollout engine; ``hf`` (transformers generate on the policy).
    """

    def __init__(
        self,
        policy: str = models.EMBEDDED_DEFAULT,
        *,
        dtype: Literal["float32", "bfloat16"] = "float32",
        algorithm: AlgorithmName = "grpo",
        loss_fn: Callable | None = None,
        estimator: EstimatorName | None = None,
        agg_mode: Literal[
            "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
        ]
        | None = None,
        clip_low: float | None = None,
        clip_high: float | None = None,
        dual_clip: float | None = None,
        filter_zero_variance: bool | None = None,
        reward_fns: Sequence[Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        reward_timeout_s: float = 30.0,
        accuracy_reward: str | None = None,
        accuracy_threshold: float = 1.0,
        sampling: Sampling = Sampling(max_new_tokens=64, temperature=1.0, group_size=8),
        val_sampling: Sampling = Sampling(max_new_tokens=64, temperature=0.0, group_size=1),
        epochs_per_rollout: int = 1,
        minibatches_per_rollout: int = 1,
        micro_batch_size: int = 8,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        grad_clip: float | None = 1.0,
        kl_coef: float = 0.0,
        kl_estimator: Literal["k1", "k2", "k3"] = "k3",
        entropy_coef: float = 0.0,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | str = "all-linear",
        max_nonfinite_steps: int = 3,
        engine: Literal["hf"] = "hf",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        for key, value in self.hparams.items():
            self.hparams[key] = _plain_hparam(value)
        self.automatic_optimization = False
        preset = get_preset(algorithm)
        self.estimator = estimator or preset.estimator
        self.filter_zero_variance = (
            preset.filter_zero_variance if filter_zero_variance is None else filter_zero_variance
        )
        self.sampling, self.val_sampling = sampling, val_sampling
        self._validate(sampling, epochs_per_rollout, minibatches_per_rollout, micro_batch_size)
        self.policy, self.tokenizer = models.load_policy(policy, dtype)
        self.tokenizer.padding_side = "left"
        self.policy.train()
        if lora_rank > 0:
            self.policy = models.add_lora(
                self.policy, lora_rank, lora_alpha, 0.0, lora_target_modules
            )
        # Not registered as a submodule: the frozen copy never enters checkpoints or optimisers.
        self._reference = (
            (models.frozen_copy(self.policy),) if kl_coef > 0 and lora_rank == 0 else ()
        )
        self.updater = PolicyUpdate(
            loss_fn=loss_fn or preset.loss_fn,
            clip_low=preset.clip_low if clip_low is None else clip_low,
            clip_high=preset.clip_high if clip_high is None else clip_high,
            dual_clip=dual_clip,
            agg_mode=agg_mode or preset.agg_mode,
            norm_len=sampling.max_new_tokens,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator,
            entropy_coef=entropy_coef,
            micro_batch_size=micro_batch_size,
        )
        self.rewards = self._build_rewards(
            reward_fns, reward_weights, reward_timeout_s, preset.overlong_shaping
        )
        self.accuracy_reward = accuracy_reward or self.rewards.names[0]
        if self.accuracy_reward not in self.rewards.names:
            raise ValueError(
                f"accuracy_reward={accuracy_reward!r} is not one of the reward names "
                f"{self.rewards.names}."
            )
        self.engine: RolloutEngine = HFEngine(self.policy, self.tokenizer)
        self.val_accuracy, self.val_reward = MeanMetric(), MeanMetric()
        self.val_pass_at_k = (
            PassAtK(val_sampling.group_size) if val_sampling.group_size > 1 else None
        )
        self.last_step: StepOutput | None = None
        self._rollout_step = 0
        self._nonfinite_streak = 0

    @staticmethod
    def _validate(sampling: Sampling, epochs: int, minibatches: int, micro: int) -> None:
        if sampling.group_size < 2:
            raise ValueError(
                f"sampling.group_size must be >= 2 for group advantages, got {sampling.group_size}."
            )
        if min(epochs, minibatches, micro) < 1:
            raise ValueError(
                "epochs_per_rollout, minibatches_per_rollout and micro_batch_size must all be >= 1."
            )

    def _build_rewards(
        self,
        fns: Sequence[Callable] | None,
        weights: Sequence[float] | None,
        timeout_s: float,
        overlong: bool,
    ) -> RewardCombiner:
        fns = list(fns) if fns is not None else [boxed_accuracy, boxed_format]
        weights = list(weights) if weights is not None else [1.0] * len(fns)
        if overlong:
            # DAPO's soft punishment; the buffer is a quarter of the budget (this project's choice).
            budget = self.sampling.max_new_tokens
            fns.append(OverlongPenalty(max_len=budget, buffer_len=max(budget // 4, 1)))
            weights.append(1.0)
        return RewardCombiner(fns, weights, timeout_s=timeout_s)

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference policy (None when KL is off or LoRA provides it)."""
        return self._reference[0] if self._reference else None

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)

    # ---- the four stages -------------------------------------------------------------------

    def encode_prompts(self, batch: PromptBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the chat template and left-pad: ``([B, P] ids, [B, P] mask)``."""
        texts = [
            self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            for m in batch.messages
        ]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return enc.input_ids.to(self.device), enc.attention_mask.to(self.device)

    def rollout(
        self,
        batch: PromptBatch,
        sampling: Sampling | None = None,
        temperatures: torch.Tensor | None = None,
    ) -> Rollouts:
        """Generate ``G`` completions per prompt (``temperatures``: optional ``[B * G]``)."""
        ids, mask = self.encode_prompts(batch)
        return self.engine.generate(ids, mask, sampling or self.sampling, temperatures)

    def score(self, batch: PromptBatch, rollouts: Rollouts) -> Scored:
        """Run the reward functions; columns are repeated ``G`` times to align with rows."""
        g = rollouts.group_size
        columns = {k: [v for v in vals for _ in range(g)] for k, vals in batch.columns.items()}
        columns["completion_length"] = rollouts.lengths.tolist()
        result = self.rewards(rollouts.completions, columns)
        acc = result.per_function[self.accuracy_reward].nan_to_num(0.0)  # [N]
        return Scored(
            rollouts=rollouts,
            rewards=result.total.to(self.device),
            per_function=result.per_function,
            correct=acc >= self.hparams.accuracy_threshold,
            metrics=result.metrics,
        )

    def compute_advantages(self, scored: Scored) -> torch.Tensor:
        """Advantages ``[N]`` (or ``[N, T]``) from the rewards; override to change the estimator."""
        return adv_lib.compute_advantages(
            scored.rewards, scored.rollouts.group_size, self.estimator
        )

    def update(self, scored: Scored, advantages: torch.Tensor) -> dict[str, float]:
        """Optimise the policy on the scored rollouts; returns the step's loss metrics."""
        rows = torch.arange(scored.rollouts.num_rows, device=self.device)  # [N]
        if self.filter_zero_variance:
            _, var = adv_lib.group_stats(scored.rewards, scored.rollouts.group_size)  # [B]
            keep = (var > 0).repeat_interleave(scored.rollouts.group_size)  # [N]
            rows = rows[keep]
        if rows.numel() == 0:
            return {"update/skipped_empty": 1.0}
        opt, sched = self.optimizers(), self.lr_schedulers()
        metrics: dict[str, float] = {}
        h = self.hparams
        for _ in range(h.epochs_per_rollout):
            perm = rows[torch.randperm(rows.numel(), device=rows.device)]
            for mb in torch.tensor_split(perm, min(h.minibatches_per_rollout, rows.numel())):
                opt.zero_grad(set_to_none=True)
                loss, m = self.updater.accumulate(
                    self.policy,
                    scored.rollouts,
                    advantages,
                    mb,
                    self.reference_logprobs,
                    self.manual_backward,
                )
                metrics = {**m, "loss": loss}
                if not math.isfinite(loss):
                    self._skip_nonfinite(loss)
                    opt.zero_grad(set_to_none=True)
                    continue
                self._nonfinite_streak = 0
                if h.grad_clip is not None:
                    self.clip_gradients(
                        opt, gradient_clip_val=h.grad_clip, gradient_clip_algorithm="norm"
                    )
                metrics["grad_norm"] = self._grad_norm()
                opt.step()
                sched.step()
        return metrics

    # ---- helpers the stages use ------------------------------------------------------------

    def reference_logprobs(
        self, compute: Callable[[torch.nn.Module], torch.Tensor]
    ) -> torch.Tensor:
        """Run ``compute`` under the reference policy (LoRA: the adapter disabled)."""
        with torch.no_grad():
            if self.reference is not None:
                return compute(self.reference)
            with self.policy.disable_adapter():
                return compute(self.policy)

    def _grad_norm(self) -> float:
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )

    def _skip_nonfinite(self, loss: float) -> None:
        self._nonfinite_streak += 1
        log.warning(
            "Non-finite loss (%s) at rollout step %d: skipped this optimiser step (%d in a row).",
            loss,
            self._rollout_step,
            self._nonfinite_streak,
        )
        if self._nonfinite_streak >= self.hparams.max_nonfinite_steps:
            raise FloatingPointError(
                f"The loss was non-finite for {self._nonfinite_streak} optimiser steps in a row. "
                "Lower `model.lr`, check the reward functions for inf/NaN, or use float32; the "
                "last checkpoint (and OnExceptionCheckpoint, if configured) holds the state "
                "before the failure."
            )

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        batch = self._run_hooks("on_before_rollout", batch)
        rollouts = self.rollout(batch)
        gen_s = lap()
        scored = self._run_hooks("on_after_score", self.score(batch, rollouts))
        score_s = lap()
        advantages = self.compute_advantages(scored)
        update_metrics = self.update(scored, advantages)
        update_s = lap()
        output = self.step_output(batch, scored, advantages, update_metrics)
        output.metrics.update(
            gen_tokens_per_s=float(rollouts.lengths.sum()) / max(gen_s, 1e-9),
            gen_time_s=gen_s,
            score_time_s=score_s,
            update_time_s=update_s,
            step_time_s=clock[-1] - clock[0],
        )
        self.publish(output)
        self._rollout_step += 1

    def step_output(
        self,
        batch: PromptBatch,
        scored: Scored,
        advantages: torch.Tensor,
        update_metrics: dict[str, float],
    ) -> StepOutput:
        """Summarise the step for logging, the data module and callbacks."""
        from rlvr_lightning.summary import summarise_step

        return summarise_step(
            self._rollout_step,
            batch,
            scored,
            advantages,
            update_metrics,
            lr=self.optimizers().param_groups[0]["lr"],
        )

    def publish(self, output: StepOutput) -> None:
        """Log the step and hand it to the data module and the callbacks."""
        self.last_step = output
        bar = {"train/reward", "train/accuracy"}
        for key, value in output.metrics.items():
            self.log(
                f"train/{key}",
                value,
                prog_bar=f"train/{key}" in bar,
                batch_size=len(output.prompt_ids),
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "on_step_output"):
            datamodule.on_step_output(output)
        for cb in self._rlvr_callbacks():
            cb.on_step_output(self.trainer, self, output)

    def _rlvr_callbacks(self) -> list[RLVRCallback]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, RLVRCallback)]

    def _run_hooks(self, name: str, value: Any) -> Any:
        for cb in self._rlvr_callbacks():
            new = getattr(cb, name)(self.trainer, self, value)
            value = value if new is None else new
        return value

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        # Prompt batches hold text; tokens are created on the right device in `encode_prompts`.
        if isinstance(batch, PromptBatch):
            return batch
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    # ---- validation ------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int) -> None:
        greedy = Sampling(
            max_new_tokens=self.val_sampling.max_new_tokens, temperature=0.0, group_size=1
        )
        scored = self.score(batch, self.rollout(batch, greedy))
        self.val_accuracy.update(scored.correct.float())
        self.val_reward.update(scored.rewards)
        self.log("val/accuracy", self.val_accuracy, prog_bar=True, batch_size=len(batch))
        self.log("val/reward", self.val_reward, batch_size=len(batch))
        if self.val_pass_at_k is not None:
            sampled = self.score(batch, self.rollout(batch, self.val_sampling))
            self.val_pass_at_k.update(sampled.correct.view(len(batch), -1))
            self.log(f"val/pass@{self.val_pass_at_k.k}", self.val_pass_at_k, batch_size=len(batch))

    def test_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: PromptBatch, batch_idx: int) -> list[dict[str, Any]]:
        rollouts = self.rollout(batch, self.val_sampling)
        g = rollouts.group_size
        return [
            {"prompt_id": batch.prompt_ids[i // g], "completion": text}
            for i, text in enumerate(rollouts.completions)
        ]

    # ---- optimisation ----------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        warmup = self.hparams.warmup_steps
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rlvr_rollout_step"] = self._rollout_step

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rollout_step = checkpoint.get("rlvr_rollout_step", 0)
