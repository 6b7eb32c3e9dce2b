"""Named points where callbacks act on a training step.

Subclass ``RLVRCallback`` (a Lightning ``Callback``) and override the hooks you need; the module
calls them in the order the callbacks are listed. A hook returns a new object to replace the
one it was given, or ``None`` to leave it unchanged.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from rlvr_lightning.types import PromptBatch, Scored, StepOutput


class RLVRCallback(pl.Callback):
    """Base class for callbacks that intervene inside ``RLVRModule.training_step``.

    ``module`` is the ``RLVRModule`` (typed as a LightningModule: this layer sits below it).
    """

    def on_before_rollout(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: PromptBatch
    ) -> PromptBatch | None:
        """Before generation: choose or change the prompts of this step."""
        return None

    def on_before_generate(
        self, trainer: pl.Trainer, module: pl.LightningModule, batch: PromptBatch
    ) -> PromptBatch | None:
        """Before each generation round of a training step (the step's prompts, then each
        dynamic-sampling round's): set per-prompt sampling options such as ``temperatures``."""
        return None

    def on_after_score(
        self, trainer: pl.Trainer, module: pl.LightningModule, scored: Scored
    ) -> Scored | None:
        """After rewards: inject or replace group members, adjust rewards."""
        return None

    def on_step_output(
        self, trainer: pl.Trainer, module: pl.LightningModule, output: StepOutput
    ) -> None:
        """After the optimiser steps of a rollout batch: read the step's statistics."""


def rlvr_callbacks(trainer: pl.Trainer) -> list[RLVRCallback]:
    """The trainer's callbacks that act inside the step, in their listed order."""
    return [cb for cb in trainer.callbacks if isinstance(cb, RLVRCallback)]


def run_hooks(trainer: pl.Trainer, module: pl.LightningModule, name: str, value: Any) -> Any:
    """Call hook ``name`` of every ``RLVRCallback`` in order; each may replace ``value``."""
    for cb in rlvr_callbacks(trainer):
        new = getattr(cb, name)(trainer, module, value)
        value = value if new is None else new
    return value
