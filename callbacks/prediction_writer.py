"""``PredictionWriter``: ``predict`` results as a JSONL file, one prompt per line."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class PredictionWriter(pl.Callback):
    """Write what ``RLVRModule.predict_step`` returns to ``path``, a record per prompt.

    Each line holds the prompt, its answer, the completions with their total and per-function
    rewards and correctness, and the prompt's ``pass@1`` / ``pass@G``
    (``rlvr_lightning.stages.predictions.prediction_records``). At the end the mean pass@k over the
    prompts and the file's path are printed. The file is replaced at the start of each
    ``predict``; under several processes each rank writes ``<stem>.rank<N>.jsonl``.

    A plain callback rather than Lightning's ``BasePredictionWriter``: that one asks the loop for
    batch indices, which a loader of pre-collated prompt batches does not have (it warns on
    every run), and the records carry their ``prompt_id`` anyway.

    Args:
        path: the JSONL file; the ``predict`` subcommand adds this callback with
            ``<trainer.default_root_dir>/predictions.jsonl`` when none is configured.
    """

    def __init__(self, path: str | Path = "predictions.jsonl") -> None:
        super().__init__()
        self.path = Path(path)
        self._sums: dict[str, float] = {}
        self._count = 0

    def _file(self, trainer: pl.Trainer) -> Path:
        if trainer.world_size == 1:
            return self.path
        return self.path.with_name(f"{self.path.stem}.rank{trainer.global_rank}.jsonl")

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._file(trainer).parent.mkdir(parents=True, exist_ok=True)
        self._file(trainer).write_text("")
        self._sums, self._count = {}, 0

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Sequence[dict[str, Any]],
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        with self._file(trainer).open("a", encoding="utf-8") as f:
            for record in outputs:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                for key, value in record.items():
                    if key.startswith("pass@"):
                        self._sums[key] = self._sums.get(key, 0.0) + value
                self._count += 1

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        means = ", ".join(f"{k} {v / max(self._count, 1):.3f}" for k, v in self._sums.items())
        if trainer.is_global_zero:  # the command's result: printed, not logged
            print(f"Wrote {self._count} prompts to {self._file(trainer)} ({means}).")
