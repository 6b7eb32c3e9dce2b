"""Write the trained policy as a ``from_pretrained`` folder at the end of ``fit``."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from rlvr_lightning.hub import export_pretrained


class ExportModel(pl.Callback):
    """Export the policy and tokenizer (chat template included) when ``fit`` ends.

    Args:
        dirpath: target folder; relative paths are resolved against the trainer's
            ``default_root_dir``.
    """

    def __init__(self, dirpath: str = "model") -> None:
        self.dirpath = dirpath
        self.exported_to: Path | None = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.interrupted or not trainer.is_global_zero:
            return
        path = Path(self.dirpath)
        if not path.is_absolute():
            path = Path(trainer.default_root_dir) / path
        self.exported_to = export_pretrained(pl_module.policy, pl_module.tokenizer, path)
        print(f"Exported the trained model to {self.exported_to}")
