"""Named points where callbacks act on a training step.

Subclass ``RLVRCallback`` (a Lightning ``Callback``) and override the hooks you need; the module
calls them in the order the callbacks are listed. A hook returns a new object to replace the
one it was given, or ``None`` to leave it unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl

from rlvr_lightning.types import PromptBatch, Scored, StepOutput

if TYPE_CHECKING:
    from rlvr_lightning.module import RLVRModule


class RLVRCallback(pl.Callback):
    """Base class for callbacks that intervene inside ``RLVRModule.training_step``."""

    def on_before_rollout(
        self, trainer: pl.Trainer, module: RLVRModule, batch: PromptBatch
    ) -> PromptBatch | None:
        """Before generation: choose or change the prompts of this step."""
        return None

    def on_before_generate(
        self, trainer: pl.Trainer, module: RLVRModule, batch: PromptBatch
    ) -> PromptBatch | None:
        """Before each generation round of a training step (the step's prompts, then each
        dynamic-sampling round's): set per-prompt sampling options such as ``temperatures``."""
        return None

    def on_after_score(
        self, trainer: pl.Trainer, module: RLVRModule, scored: Scored
    ) -> Scored | None:
        """After rewards: inject or replace group members, adjust rewards."""
        return None

    def on_step_output(self, trainer: pl.Trainer, module: RLVRModule, output: StepOutput) -> None:
        """After the optimiser steps of a rollout batch: read the step's statistics."""
