"""``CompletionsTable``: sample completions with their rewards, every N rollout steps.

Aggregate rewards say *that* training moves, not *what* the policy writes. Like TRL's and
verl's completion logging, this writes up to ``max_rows`` rows of a step (whole groups first,
in batch order) with each reward function's value, the total, the advantage and the source:

- always to a JSONL file, one object per row, appended and closed after each write (rank zero);
- to each logger that can show a table, found by what it offers, never by importing it:
  ``log_table`` (Lightning's ``WandbLogger``) gets the columns and rows, an ``experiment`` with
  ``add_text`` (TensorBoard's ``SummaryWriter``) a markdown table; others (CSV) are skipped.

The rows are the group *as trained* (``StepOutput.completions`` ...): an injected member
(``source`` other than ``policy``) shows its own text, rewards and advantage. ``sampled_reward``
and ``sampled_correct`` are the snapshot of the slot taken before any hook, the outcome that
``train/accuracy``, replay and the curriculum count; for an injected row they belong to the
sample it replaced, not to the text shown. Under DDP each rank trains its own slice of the
prompts and rank zero writes its slice.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.types import SOURCE_POLICY, StepOutput

TABLE_KEY = "train/completions"
FILE_NAME = "completions.jsonl"


def _number(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 6)


def completion_rows(output: StepOutput, max_rows: int) -> list[dict[str, Any]]:
    """The first ``max_rows`` rows of a step as flat dicts (the JSONL objects, table columns).

    ``reward/<name>`` is None where the function does not apply (NaN).
    """
    totals, correct, advantages = output.row_rewards, output.row_correct, output.advantages
    if totals is None or correct is None or advantages is None:
        return []  # a StepOutput built without its per-row fields
    g, n = output.group_size, min(max_rows, len(output.completions))
    sampled_reward, sampled_correct = output.rewards.flatten(), output.correct.flatten()  # [N]
    rows = []
    for i in range(n):
        b = i // g
        row: dict[str, Any] = {
            "step": output.step,
            "prompt_id": output.prompt_ids[b],
            "prompt": output.prompts[b] if output.prompts else "",
            "completion": output.completions[i],
        }
        for name, values in output.per_function.items():
            row[f"reward/{name}"] = _number(float(values[i]))
        row["reward"] = _number(float(totals[i]))
        row["advantage"] = _number(float(advantages[i]))
        row["source"] = output.sources[i] if output.sources else SOURCE_POLICY
        row["correct"] = bool(correct[i])
        row["sampled_reward"] = _number(float(sampled_reward[i]))
        row["sampled_correct"] = bool(sampled_correct[i])
        row["trained"] = True if output.trained is None else bool(output.trained[b])
        rows.append(row)
    return rows


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = "" if value is None else str(value)
    # TensorBoard sanitises HTML: escape it (`<think>` would vanish) and keep one line per row.
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace("|", "\\|")
    return text.replace("\n", "<br>")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """``rows`` as a GitHub-flavoured markdown table (TensorBoard's text plugin renders it)."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def log_rows(loggers: list[Any], rows: list[dict[str, Any]], step: int) -> None:
    """Send ``rows`` to every logger that can show a table; skip the others."""
    columns = list(rows[0])
    for logger in loggers:
        if callable(getattr(logger, "log_table", None)):
            data = [[r[c] for c in columns] for r in rows]
            logger.log_table(key=TABLE_KEY, columns=columns, data=data, step=step)
            continue
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):
            add_text(TABLE_KEY, markdown_table(rows), global_step=step)


class CompletionsTable(RLVRCallback):
    """Log a table of sample completions and their rewards every ``every_n_steps`` steps.

    Args:
        every_n_steps: write after rollout steps ``N - 1, 2N - 1, ...`` (counted from 0, so
            with ``max_steps`` a multiple of ``N`` the last step is included).
        max_rows: rows per logged step, the first ones of the batch (whole groups first).
        path: the JSONL file; None = ``completions.jsonl`` in the trainer's ``log_dir`` (beside
            the metrics) or ``default_root_dir`` without a logger; relative paths are resolved
            against ``default_root_dir``.
    """

    def __init__(self, every_n_steps: int = 10, max_rows: int = 16, path: str | None = None):
        if every_n_steps < 1 or max_rows < 1:
            raise ValueError(
                f"CompletionsTable needs every_n_steps >= 1 and max_rows >= 1; got "
                f"every_n_steps={every_n_steps}, max_rows={max_rows}."
            )
        self.every_n_steps, self.max_rows, self.path = every_n_steps, max_rows, path
        self.file: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        root = Path(trainer.default_root_dir)
        # trainer.log_dir broadcasts from rank zero: every rank must ask, so ask here.
        default = Path(trainer.log_dir or root) / FILE_NAME
        self.file = default if self.path is None else root / Path(self.path).expanduser()

    @override
    def on_step_output(self, trainer: pl.Trainer, module: Any, output: StepOutput) -> None:
        if (output.step + 1) % self.every_n_steps or not trainer.is_global_zero:
            return
        rows = completion_rows(output, self.max_rows)
        if not rows or self.file is None:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        with self.file.open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        log_rows(trainer.loggers, rows, trainer.global_step)
