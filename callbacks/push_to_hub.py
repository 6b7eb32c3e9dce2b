"""Push the exported model and its card to the Hugging Face Hub during and after ``fit``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from rlvr_lightning.callbacks.export_model import CARD_FILE, CURVE_FILE, ExportModel
from typing_extensions import override

from rlvr_lightning.hub import push_folder

log = logging.getLogger(__name__)


def push_due(step: int, last_pushed: int, every_n_steps: int) -> bool:
    """True when ``step`` has crossed a multiple of ``every_n_steps`` since ``last_pushed``.

    Optimiser steps may advance by more than one per batch (``epochs_per_rollout``), so a
    multiple can be skipped over: every 10 steps, advancing by 3 from step 9 to 12 is due.
    """
    return every_n_steps > 0 and step // every_n_steps > last_pushed // every_n_steps


class PushToHub(ExportModel):
    """Export like ``ExportModel``, then upload the folder to a Hub repository.

    Every ``every_n_steps`` optimiser steps the current policy is exported and pushed (to the
    branch ``checkpoint_branch``, or as a commit on ``revision``); at the end of ``fit`` the
    final export is pushed to ``revision``. Only global rank zero pushes. The token comes from
    ``HF_TOKEN`` or the ``huggingface_hub`` login (``hf auth login``), never from the config.
    A push that still fails after ``retries`` retries logs a warning: the local export stays
    and training continues.

    Args:
        repo_id: the Hub repository, ``org/name``; created when missing.
        private: create the repository private (ignored when it exists).
        revision: branch that receives the final model (None: the default branch).
        every_n_steps: push during training every this many optimiser steps (0: only at the end).
        checkpoint_branch: branch for the pushes during training (None: commits on ``revision``).
        retries: retries after a failed push, with exponential backoff.
        backoff_s: wait before the first retry; doubles each time.
        endpoint: Hub URL (None: ``HF_ENDPOINT`` or huggingface.co).
        dirpath: the local export folder (see ``ExportModel``).
        adapter_only: push the LoRA adapter alone (see ``ExportModel``).
        card: write and push ``README.md`` with the reward curve.
        card_template: card template name or path (see ``ExportModel``).
        license: the license in the card's metadata.
        base_model: the base model an adapter-only export records (see ``ExportModel``).
    """

    def __init__(
        self,
        repo_id: str,
        private: bool = True,
        revision: str | None = None,
        every_n_steps: int = 0,
        checkpoint_branch: str | None = None,
        retries: int = 3,
        backoff_s: float = 2.0,
        endpoint: str | None = None,
        dirpath: str = "model",
        adapter_only: bool = False,
        card: bool = True,
        card_template: str = "default",
        license: str = "apache-2.0",
        base_model: str | None = None,
    ) -> None:
        super().__init__(
            dirpath,
            adapter_only,
            card,
            card_template,
            license,
            repo_id=repo_id,
            base_model=base_model,
        )
        if every_n_steps < 0 or retries < 0:
            raise ValueError("every_n_steps and retries must be >= 0.")
        self.private = private
        self.revision = revision
        self.every_n_steps = every_n_steps
        self.checkpoint_branch = checkpoint_branch
        self.retries = retries
        self.backoff_s = backoff_s
        self.endpoint = endpoint
        self.pushed: list[str] = []  # commit URLs of successful pushes
        self.failed_pushes = 0
        self._sleep: Callable[[float], None] = time.sleep
        self._last_pushed_step = 0

    def push(
        self,
        path: Path,
        revision: str | None,
        message: str,
        only: list[str] | None = None,
    ) -> str | None:
        """Upload ``path`` (or the files in ``only``); a failure is logged, never raised."""
        try:
            url = push_folder(
                path,
                self.repo_id or "",
                revision=revision,
                private=self.private,
                commit_message=message,
                only=only,
                endpoint=self.endpoint,
                attempts=self.retries + 1,
                backoff_s=self.backoff_s,
                sleep=self._sleep,
            )
        except Exception as err:
            self.failed_pushes += 1
            log.warning(
                "Push to %s failed after %d attempts (%s: %s). The export in %s is kept; "
                "push it later with `rlvr-lightning push %s --repo-id %s`.",
                self.repo_id,
                self.retries + 1,
                type(err).__name__,
                err,
                path,
                path,
                self.repo_id,
            )
            return None
        self.pushed.append(url)
        return url

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_pushed_step = trainer.global_step  # after a resume: count from there

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any
    ) -> None:
        step = trainer.global_step
        if not push_due(step, self._last_pushed_step, self.every_n_steps):
            return
        self._last_pushed_step = step
        if not trainer.is_global_zero:
            return
        if trainer.max_steps > 0 and step >= trainer.max_steps:
            return  # the end-of-fit push follows
        path = self.export(trainer, pl_module)
        self.push(path, self.checkpoint_branch or self.revision, f"Training step {step}")

    @override
    def on_final_export(self, trainer: pl.Trainer, path: Path) -> None:
        self.push(path, self.revision, f"Final model after {trainer.global_step} steps")

    @override
    def on_card_updated(self, trainer: pl.Trainer, path: Path) -> None:
        self.push(
            path, self.revision, "Model card: validation after training", [CARD_FILE, CURVE_FILE]
        )
