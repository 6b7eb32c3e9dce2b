"""Write the trained policy as a ``from_pretrained`` folder with its model card after ``fit``."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from rlvr_lightning.hub import export_pretrained, model_card, module_heads
from rlvr_lightning.hub.card_safety import adapter_base_model
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.types import StepOutput

log = logging.getLogger(__name__)

CARD_FILE = "README.md"
CURVE_FILE = "reward_curve.png"


class ExportModel(RLVRCallback):
    """Export the policy, tokenizer (chat template included), extra heads and a model card.

    The card (``README.md``) records the recipe, the validation before and after training, and
    a reward curve (``reward_curve.png``) from the per-step training reward. A validation that
    runs after ``fit`` (``evaluate_before_after``) re-renders the card with its results.

    Args:
        dirpath: target folder; relative paths are resolved against the trainer's
            ``default_root_dir``.
        adapter_only: with a LoRA policy, export the adapter alone (for
            ``PeftModel.from_pretrained``) instead of merging it into the base weights.
        card: write ``README.md`` and the reward curve next to the weights.
        card_template: a template name from ``rlvr_lightning.hub_cards`` (``default``) or the
            path of a Jinja file.
        license: the license written into the card's metadata.
        repo_id: the Hub repository the card's usage snippet names (None: a local folder).
        base_model: with ``adapter_only``, the base model the adapter records (a Hub id);
            None: the Hub id the policy was named by, else its local folder (with a warning:
            that path resolves on this machine only).
    """

    def __init__(
        self,
        dirpath: str = "model",
        adapter_only: bool = False,
        card: bool = True,
        card_template: str = "default",
        license: str = "apache-2.0",
        repo_id: str | None = None,
        base_model: str | None = None,
    ) -> None:
        self.dirpath = dirpath
        self.adapter_only = adapter_only
        self.card = card
        self.card_template = card_template
        self.license = license
        self.repo_id = repo_id
        self.base_model = base_model
        self.record = model_card.TrainingRecord()
        self.exported_to: Path | None = None
        self._fit_started: float | None = None
        self._elapsed_before = 0.0

    # ---- recording -----------------------------------------------------------------------

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_started = time.monotonic()
        self._elapsed_before = self.record.wall_time_s

    @override
    def on_step_output(self, trainer: pl.Trainer, module: Any, output: StepOutput) -> None:
        self.record.add_step(
            output.step,
            float(output.metrics.get("reward", output.rewards.float().mean())),
            float(output.metrics.get("accuracy", output.correct.float().mean())),
            int(output.lengths.sum()),
        )
        self._update_wall_time()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if metrics:
            self.record.add_validation(trainer.global_step, metrics)
        # A validation after fit (e.g. evaluate_before_after) completes the card.
        if self.exported_to is not None and trainer.state.fn == "validate":
            if trainer.is_global_zero and self.card:
                card = self.write_card(trainer, pl_module, self.exported_to)
                print(f"Updated {card} with the validation after training")
                self.on_card_updated(trainer, self.exported_to)

    def _update_wall_time(self) -> None:
        if self._fit_started is not None:
            self.record.wall_time_s = self._elapsed_before + time.monotonic() - self._fit_started

    # ---- export --------------------------------------------------------------------------

    def export_dir(self, trainer: pl.Trainer) -> Path:
        path = Path(self.dirpath)
        return path if path.is_absolute() else Path(trainer.default_root_dir) / path

    def export(self, trainer: pl.Trainer, pl_module: Any) -> Path:
        """Write weights, tokenizer, heads and (with ``card``) the card; returns the folder."""
        self._update_wall_time()
        path = export_pretrained(
            pl_module.policy,
            pl_module.tokenizer,
            self.export_dir(trainer),
            adapter_only=self.adapter_only,
            heads=module_heads(pl_module),
            base_model=self._adapter_base(str(pl_module.hparams.get("policy", ""))),
        )
        if self.card:
            self.write_card(trainer, pl_module, path)
        self.exported_to = path
        return path

    def _adapter_base(self, policy: str) -> str | None:
        return adapter_base_model(policy, self.base_model) if self.adapter_only else None

    def write_card(self, trainer: pl.Trainer, pl_module: Any, path: Path) -> Path:
        """Render the card (and the reward curve) into ``path``; returns the card file."""
        curve = None
        if self.record.steps:
            model_card.reward_curve_png(
                self.record.steps, self.record.rewards, path / CURVE_FILE, self.record.accuracies
            )
            curve = CURVE_FILE
        context = model_card.card_context(
            model_card.run_facts(trainer, pl_module),
            self.record,
            repo_id=self.repo_id,
            license=self.license,
            adapter_only=self.adapter_only,
            reward_curve=curve,
            base_model=self.base_model,
        )
        text = model_card.render_card(context, self.card_template)
        roots = [path.resolve(), Path(trainer.default_root_dir).resolve()]
        card = path / CARD_FILE
        card.write_text(model_card.scrub(text, roots))
        return card

    def announce(self, path: Path) -> None:
        card = f" with its model card ({CARD_FILE})" if self.card else ""
        print(f"Exported the trained model{card} to {path}")

    def on_card_updated(self, trainer: pl.Trainer, path: Path) -> None:
        """Called after a validation that follows ``fit`` re-rendered the card."""

    def on_final_export(self, trainer: pl.Trainer, path: Path) -> None:
        """Called on global rank zero after the export at the end of ``fit`` (an uninterrupted
        one) was written to ``path`` and announced."""

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.interrupted or not trainer.is_global_zero:
            return
        path = self.export(trainer, pl_module)
        self.announce(path)
        self.on_final_export(trainer, path)

    # ---- resume --------------------------------------------------------------------------

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"record": asdict(self.record)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.record = model_card.record_from_dict(state_dict.get("record", {}))
