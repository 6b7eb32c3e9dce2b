"""The parts of ``RLVRModule`` around the training step: validation, prediction, the
optimiser, checkpoint hooks and the non-finite-loss guard. A mixin, so the module file keeps
only the step's orchestration; it reads the module's attributes (``policy``, ``score``, ...).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import lightning.pytorch as pl
import torch

from rlvr_lightning.types import PromptBatch, Sampling

log = logging.getLogger("rlvr_lightning.module")


def plain_hparam(value: Any) -> Any:
    """Hyperparameters as plain data, so checkpoints load with ``weights_only=True`` and
    LightningCLI can re-read them: dataclasses become dicts, importable functions and classes
    their import path; other callables (instances) their ``repr``, which is informative only.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return [plain_hparam(v) for v in value]
    if callable(value):
        qualname = getattr(value, "__qualname__", "")
        if qualname and "<" not in qualname:
            return f"{value.__module__}.{qualname}"
        return repr(value)
    return value


class StepLifecycle(pl.LightningModule):
    """Validation, prediction, optimisation and checkpoint hooks of ``RLVRModule``."""

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
        # Sampling RNG, so a resumed single-device run draws the rollouts an uninterrupted one
        # would have drawn (Lightning does not save it).
        checkpoint["rlvr_rng"] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            checkpoint["rlvr_rng"]["cuda"] = torch.cuda.get_rng_state(self.device)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._rollout_step = checkpoint.get("rlvr_rollout_step", 0)
        rng = checkpoint.get("rlvr_rng", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
