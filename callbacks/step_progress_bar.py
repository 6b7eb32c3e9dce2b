"""Progress bars that count optimiser steps toward ``max_steps``.

RLVR runs are bounded by ``max_steps`` over an endless prompt stream, so Lightning sets
``max_epochs = -1`` and its bars read ``Epoch 0/-2`` with a per-epoch batch count that restarts
on resume. These show ``Step`` and ``global_step / max_steps`` instead; with ``max_epochs`` set
they behave exactly as Lightning's. ``rlvr-lightning`` adds ``StepProgressBar`` when no progress
bar is configured; YAML can name ``RichStepProgressBar`` in place of ``RichProgressBar``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from typing_extensions import override

DESCRIPTION = "Step"


def counts_steps(trainer: pl.Trainer) -> bool:
    """Whether ``max_steps`` alone bounds the run (``max_epochs`` left unset: -1)."""
    return trainer.max_epochs == -1 and trainer.max_steps > 0


class _StepsTowardMaxSteps:
    """Overrides shared by both bars; placed before the Lightning base in the MRO."""

    trainer: pl.Trainer

    @property
    def total_train_batches(self) -> int | float:
        if counts_steps(self.trainer):
            return self.trainer.max_steps
        return super().total_train_batches  # type: ignore[misc]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        # Both bases display ``batch_idx + 1``: hand them the step count instead.
        i = trainer.global_step - 1 if counts_steps(trainer) else i
        super().on_train_batch_end(trainer, pl_module, outputs, batch, i)  # type: ignore[misc]


class StepProgressBar(_StepsTowardMaxSteps, TQDMProgressBar):
    """``TQDMProgressBar`` reading ``Step: 7/20`` when the run is bounded by ``max_steps``."""

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if counts_steps(trainer):
            self.train_progress_bar.n = trainer.global_step  # resumed runs start where they are
            self.train_progress_bar.set_description(DESCRIPTION)


class RichStepProgressBar(_StepsTowardMaxSteps, RichProgressBar):
    """``RichProgressBar`` reading ``Step 7/20`` when the run is bounded by ``max_steps``."""

    def _get_train_description(self, current_epoch: int) -> str:
        if not counts_steps(self.trainer):
            return super()._get_train_description(current_epoch)
        # Padded as Lightning pads "Epoch X", so the bar does not shift beside "Validation".
        return f"{DESCRIPTION:{len(self.validation_description)}}"
