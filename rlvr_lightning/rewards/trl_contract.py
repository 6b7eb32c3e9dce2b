"""The parts of TRL's reward contract beyond ``fn(completions, **columns)``.

TRL's ``GRPOTrainer`` hands a reward function the completions as message lists
(``[{"role": "assistant", "content": text}]``) when the prompt is conversational and as strings
otherwise, and passes three non-row arguments: ``trainer_state`` (the training progress),
``log_extra(column, values)`` (extra columns for the completions table) and
``log_metric(name, value)`` (a scalar metric). This module builds those; the combiner passes each
to the functions whose signature names it or takes ``**kwargs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Completion = str | list[dict[str, str]]

CONTEXT_ARGS = ("trainer_state", "log_extra", "log_metric")
"""Arguments every reward may take that are not per-row columns (TRL passes them to all)."""


@dataclass(frozen=True)
class RewardState:
    """What ``trainer_state`` holds: the training progress, as TRL's ``TrainerState`` names it.

    Args:
        global_step: optimiser steps taken so far.
        max_steps: the trainer's ``max_steps``; -1 when the run is not limited by steps
            (Lightning's convention, where TRL would have computed a number).
        epoch: the current epoch, counted from 0.

    >>> state = RewardState(global_step=5, max_steps=20)
    >>> state.global_step / state.max_steps
    0.25
    """

    global_step: int = 0
    max_steps: int = -1
    epoch: int = 0

    @classmethod
    def of(cls, trainer: Any) -> RewardState:
        """The state of a Lightning ``Trainer`` (or None: a module used without one)."""
        if trainer is None:
            return cls()
        return cls(int(trainer.global_step), int(trainer.max_steps), int(trainer.current_epoch))


@dataclass
class RewardLog:
    """What one reward function passed to ``log_extra`` and ``log_metric`` during one call.

    Plain data, so it travels back from a worker process with the return value.
    """

    extra: dict[str, list[Any]] = field(default_factory=dict)  # column -> one value per row
    metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> values logged

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        """TRL's ``log_extra``: a column of the completions table, one value per completion."""
        self.extra.setdefault(str(column), []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar, averaged with the other values of the batch."""
        self.metrics.setdefault(str(name), []).append(float(value))

    @staticmethod
    def merge_rows(logs: Sequence[RewardLog | None]) -> RewardLog:
        """One log from the logs of row-by-row calls (None: the row raised). Each row's column
        value is the single value it logged, else None; metrics keep every value."""
        merged = RewardLog()
        columns = dict.fromkeys(c for log in logs if log is not None for c in log.extra)
        for column in columns:
            merged.extra[column] = [
                log.extra[column][0]
                if log is not None and len(log.extra.get(column, ())) == 1
                else None
                for log in logs
            ]
        for log in logs:
            for name, values in (log.metrics if log is not None else {}).items():
                merged.metrics.setdefault(name, []).extend(values)
        return merged

    def means(self) -> dict[str, float]:
        """Each metric's mean over the values logged (non-finite values are skipped)."""
        out = {}
        for name, values in self.metrics.items():
            finite = [v for v in values if math.isfinite(v)]
            if finite:
                out[name] = sum(finite) / len(finite)
        return out


def context_kwargs(
    wanted: Sequence[str], state: RewardState | None, log: RewardLog
) -> dict[str, Any]:
    """The non-row arguments a function takes (``wanted``, from ``CONTEXT_ARGS``)."""
    values = {"trainer_state": state, "log_extra": log.log_extra, "log_metric": log.log_metric}
    return {name: values[name] for name in wanted}


def conversational_rows(prompts: Sequence[object] | None, n: int) -> list[bool]:
    """Which of ``n`` rows have a conversational prompt: those whose ``prompts`` entry is a
    message list (as in TRL, where ``is_conversational`` looks at the prompt). Without a
    ``prompts`` column every row is plain text."""
    if prompts is None:
        return [False] * n
    return [isinstance(p, list) for p in prompts]


def as_completions(texts: Sequence[Completion], conversational: Sequence[bool]) -> list[Completion]:
    """The completions as a reward receives them: TRL's one-message list for a conversational
    row, the text itself otherwise; a multi-turn trajectory (already a message list) stays
    one, whatever the prompt."""
    return [
        text
        if isinstance(text, list)
        else [{"role": "assistant", "content": text}]
        if chat
        else text
        for text, chat in zip(texts, conversational, strict=True)
    ]


def completion_text(completion: Completion) -> str:
    """The text of a completion in either form (for rewards that read text).

    >>> completion_text([{"role": "assistant", "content": "4"}]), completion_text("4")
    ('4', '4')
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(
        f"A completion must be a string or a message list [{{'role': 'assistant', 'content': "
        f"...}}]; got {type(completion).__name__} {completion!r:.60}."
    )


def logged_columns(
    logs: dict[str, RewardLog], n: int, warn_once: Callable[..., None]
) -> dict[str, list[Any]]:
    """The ``log_extra`` columns of each function's log (name -> log) that have ``n`` values; a
    column a second function logs too is kept as ``{name}/{column}``."""
    columns: dict[str, list[Any]] = {}
    for name, log in logs.items():
        for column, values in log.extra.items():
            if len(values) != n:
                warn_once(
                    name,
                    f"log_extra {column}",
                    "Reward function %r logged %d values for column %r of %d completions; the "
                    "column is left out (log_extra takes one value per completion).",
                    len(values),
                    column,
                    n,
                )
                continue
            columns[f"{name}/{column}" if column in columns else column] = list(values)
    return columns
