"""The one place where reward functions are weighted, isolated from each other and timed out.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``. The
combiner hands each function only the columns its signature names (all of them when it takes
``**kwargs``) and turns ``None`` into NaN. The completions go first, or by keyword to a
parameter named ``completions`` (TRL's ``fn(prompts, completions, **kwargs)``); an ``async def``
function is awaited. A function that raises on some rows costs those rows
their reward; one that hangs costs the batch's rows their reward (and, when it runs in a worker
process, nothing later: the worker is killed). A function that breaks the contract (wrong length,
wrong type, NaN) stops training with a ``RewardContractError`` naming it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Literal

import pebble
import torch

from rlvr_lightning.rewards.contract import (
    Outcome,
    RewardContractError,
    RewardFn,
    call_isolated,
    coerce,
)
from rlvr_lightning.rewards.isolation import (
    LoadError,
    RewardWorkers,
    isolated_names,
    preload_modules,
)
from rlvr_lightning.rewards.signature import dedupe, default_name, inspect_columns

logger = logging.getLogger(__name__)

NanPolicy = Literal["error", "fail"]

ROLLOUT_COLUMNS = ("prompts", "completion_ids", "completion_length")
"""Per-row inputs ``RLVRModule.score`` adds to the dataset's columns (see its docstring)."""


@dataclass(frozen=True)
class RewardResult:
    """Scores of one batch of completions.

    Args:
        total: ``[N]`` float32 weighted sum over functions, skipping not-applicable values; 0 for
            a row no function applies to.
        per_function: name -> ``[N]`` float32 raw value of each function, NaN where it returned
            None; failed or timed-out rows hold 0.0.
        metrics: ``reward/{name}/mean`` for this batch (omitted when no row applies), and since
            the combiner was built: ``reward/{name}/failures`` (rows that raised, lost their
            worker process, or returned NaN under ``nan_policy="fail"``) and
            ``reward/{name}/timeouts`` (calls that ran out of time).
    """

    total: torch.Tensor  # [N]
    per_function: dict[str, torch.Tensor]  # name -> [N]
    metrics: dict[str, float]


@dataclass(frozen=True)
class _Spec:
    """A reward function with what the combiner learned about it at construction."""

    fn: RewardFn
    name: str
    weight: float
    columns: frozenset[str] | None  # names it accepts; None means all (it takes **kwargs)
    required: tuple[str, ...]  # columns without a default
    first: str  # name of its completions parameter, never passed as a column
    by_name: bool = False  # the completions go by keyword, under ``first``
    isolated: bool = False  # runs in a worker process


def _wait(future: Future) -> Outcome:
    """The future's result. Waiting in slices keeps the main thread where a signal handler
    that raises (SIGINT, a SIGTERM stop) interrupts it at once."""
    while not future.done():
        wait([future], timeout=0.5)
    return future.result()


def _run_with_timeout(task: Callable[[], Outcome], timeout_s: float, name: str) -> Outcome | None:
    """Run ``task`` in a daemon thread; None if it has not finished after ``timeout_s``.

    Python cannot kill a thread, so a stuck task is abandoned: it keeps its thread (and any CPU
    it burns) until it returns or the process exits. Daemon threads never block that exit.
    """
    box: list[Outcome | BaseException] = []

    def work() -> None:
        try:
            box.append(task())
        except BaseException as exc:  # SystemExit and the like: re-raised below, as inline
            box.append(exc)

    thread = threading.Thread(target=work, name=f"reward-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class RewardCombiner:
    """Weighted sum of reward functions with per-row isolation and per-call timeouts.

    Args:
        functions: reward functions ``fn(completions, **columns) -> list[float | None]``.
        weights: one weight per function; all 1.0 when omitted.
        names: metric names; default ``fn.__name__``, else ``fn.name``, else the snake_case
            class name, with ``_2``, ``_3``, ... appended to repeats.
        timeout_s: seconds one function may take on one batch before its rows score 0.0;
            ``None`` or ``0``: no timeout (functions in the trainer's process then run inline,
            without a thread).
        isolate: which functions run in worker processes that are killed and replaced on
            timeout: ``None`` = those marked with ``rewards.run_in_process`` (the built-in
            ``boxed_accuracy`` and ``answer_accuracy``); ``True`` / ``False`` = all / none; a
            list of names = exactly those. They must be importable (module level). The others
            run in a thread of the trainer's process, which is abandoned on timeout.
        nan_policy: a NaN or infinite value is ``error`` (raise ``RewardContractError``) or
            ``fail`` (the row scores 0.0 and counts in ``reward/{name}/failures``).
        workers: the process pool isolated functions run in; by default one is started on
            first use, with one process per isolated function, and stopped by :meth:`close`.

    Process functions start first and run while the others run, one after another. A function
    that raises on the batch is retried row by row; rows that still raise score 0.0 and are
    counted. A return value of the wrong type or length raises ``RewardContractError``.

    >>> def short(completions: list[str]) -> list[float]:
    ...     return [float(len(c) < 4) for c in completions]
    >>> def exact(completions: list[str], answer: list[str | None]) -> list[float | None]:
    ...     return [None if a is None else float(c == a) for c, a in zip(completions, answer)]
    >>> combiner = RewardCombiner([exact, short], weights=[1.0, 0.5])
    >>> result = combiner(["42", "forty-two"], {"answer": [None, "forty-two"], "id": [0, 1]})
    >>> result.total, result.per_function["exact"]
    (tensor([0.5000, 1.0000]), tensor([nan, 1.]))
    >>> result.metrics["reward/short/mean"], result.metrics["reward/exact/failures"]
    (0.5, 0.0)
    """

    def __init__(
        self,
        functions: Sequence[RewardFn],
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
        timeout_s: float | None = 30.0,
        isolate: bool | Sequence[str] | None = None,
        nan_policy: NanPolicy = "error",
        workers: RewardWorkers | None = None,
    ) -> None:
        functions = list(functions)
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        names = self._resolve_names(functions, names)
        self._check_args(functions, weights, timeout_s, nan_policy)
        isolated = isolated_names(functions, names, isolate)
        self.timeout_s = timeout_s or None
        self.nan_policy = nan_policy
        self.specs = tuple(
            _Spec(fn, name, weight, *inspect_columns(fn, name), isolated=name in isolated)
            for fn, name, weight in zip(functions, names, weights, strict=True)
        )
        self._own_workers = workers is None
        self._workers = workers
        self._failures = dict.fromkeys(names, 0)
        self._timeouts = dict.fromkeys(names, 0)
        self._warned: set[tuple[str, str]] = set()

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @property
    def isolated(self) -> list[str]:
        """Names of the functions that run in worker processes."""
        return [spec.name for spec in self.specs if spec.isolated]

    def close(self) -> None:
        """Stop the worker processes this combiner started (a later call starts new ones)."""
        if self._own_workers and self._workers is not None:
            self._workers.close()
            self._workers = None

    @staticmethod
    def _resolve_names(functions: list[RewardFn], names: Sequence[str] | None) -> list[str]:
        if names is None:
            return dedupe([default_name(fn) for fn in functions])
        names = list(names)
        if len(names) != len(functions) or len(set(names)) != len(names):
            raise ValueError(
                f"RewardCombiner got {len(names)} names {names} for {len(functions)} functions; "
                "give one distinct name per function, or omit names to derive them."
            )
        return names

    @staticmethod
    def _check_args(
        functions: list[RewardFn], weights: list[float], timeout_s: float | None, nan_policy: str
    ) -> None:
        if not functions:
            raise ValueError("RewardCombiner needs at least one reward function.")
        if not all(callable(fn) for fn in functions):
            bad = [repr(fn) for fn in functions if not callable(fn)]
            raise ValueError(f"RewardCombiner functions must be callable; got {bad}.")
        if len(weights) != len(functions):
            raise ValueError(
                f"RewardCombiner got {len(weights)} weights for {len(functions)} functions; "
                "give one weight per function, or omit weights to weight them all 1.0."
            )
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (0 or None disables it); got {timeout_s}.")
        if nan_policy not in ("error", "fail"):
            raise ValueError(f"nan_policy must be 'error' or 'fail'; got {nan_policy!r}.")

    def __call__(self, completions: list[str], columns: dict[str, list[Any]]) -> RewardResult:
        self._check_columns(len(completions), columns)
        futures = {
            spec.name: self._submit(spec, completions, columns)
            for spec in self.specs
            if spec.isolated
        }
        try:
            per_function = {
                spec.name: self._score(spec, completions, columns, futures.get(spec.name))
                for spec in self.specs
            }  # name -> [N]
        except BaseException:  # a contract error, or a signal stopping the run: kill the rest
            for future in futures.values():
                future.cancel()
            raise
        weighted = torch.stack(
            [spec.weight * per_function[spec.name] for spec in self.specs]
        )  # [F, N]
        total = torch.nansum(weighted, dim=0)  # [N]; all-NaN rows sum to 0
        return RewardResult(total, per_function, self._metrics(per_function))

    def required_columns(self) -> dict[str, tuple[str, ...]]:
        """name -> the columns that function needs (parameters without a default)."""
        return {spec.name: spec.required for spec in self.specs if spec.required}

    def check_available(
        self, columns: Sequence[str], where: str, supplied: Sequence[str] = ROLLOUT_COLUMNS
    ) -> None:
        """Raise naming the reward, the column and the columns there are when a required
        column is neither in ``columns`` (``where`` says whose: a data source) nor ``supplied``
        (the per-row inputs the module adds)."""
        for spec in self.specs:
            missing = [c for c in spec.required if c not in (*columns, *supplied)]
            if missing:
                raise ValueError(
                    f"Reward function {spec.name!r} needs column {missing[0]!r}, but {where} has "
                    f"only {sorted(columns)} (plus {', '.join(supplied)}). Add the column to the "
                    "data (or map one to it with data.columns), give the parameter a default, or "
                    "drop the reward."
                )

    def _check_columns(self, n: int, columns: dict[str, list[Any]]) -> None:
        wrong = {k: len(v) for k, v in columns.items() if len(v) != n}
        if wrong:
            raise ValueError(
                f"Reward columns must have one entry per completion ({n}); got {wrong}."
            )
        for spec in self.specs:
            missing = [c for c in spec.required if c not in columns]
            if missing:
                raise ValueError(
                    f"Reward function {spec.name!r} needs column(s) {missing}, but the batch only "
                    f"has {sorted(columns)}. Add them to the dataset or give them defaults."
                )

    def _kwargs_for(self, spec: _Spec, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {
            k: v
            for k, v in columns.items()
            if k != spec.first and (spec.columns is None or k in spec.columns)
        }

    def _submit(self, spec: _Spec, completions: list[str], columns: dict[str, list[Any]]) -> Future:
        if self._workers is None:
            isolated = [s.fn for s in self.specs if s.isolated]
            processes = max(1, min(len(isolated), os.cpu_count() or 1))
            self._workers = RewardWorkers(processes, preload_modules(isolated))
        kwargs = self._kwargs_for(spec, columns)
        by_name = spec.first if spec.by_name else ""
        return self._workers.submit(
            spec.fn, call_isolated, completions, kwargs, by_name, timeout=self.timeout_s
        )

    def _score(
        self,
        spec: _Spec,
        completions: list[str],
        columns: dict[str, list[Any]],
        future: Future | None,
    ) -> torch.Tensor:
        n = len(completions)
        outcome = (
            self._collect(spec, future, n)
            if future is not None
            else self._run_here(spec, completions, columns)
        )
        values = [0.0] * n if outcome is None else self._check(spec, outcome, n)
        return torch.tensor(
            [math.nan if v is None else v for v in values], dtype=torch.float32
        )  # [N]

    def _run_here(
        self, spec: _Spec, completions: list[str], columns: dict[str, list[Any]]
    ) -> Outcome | None:
        kwargs = self._kwargs_for(spec, columns)
        by_name = spec.first if spec.by_name else ""

        def task() -> Outcome:
            return call_isolated(spec.fn, completions, kwargs, by_name)

        if self.timeout_s is None:
            return task()
        outcome = _run_with_timeout(task, self.timeout_s, spec.name)
        if outcome is None:
            self._record_timeout(spec.name, "the thread is abandoned (Python cannot kill threads)")
        return outcome

    def _collect(self, spec: _Spec, future: Future, n: int) -> Outcome | None:
        try:
            return _wait(future)
        except TimeoutError:
            self._record_timeout(spec.name, "its worker process was killed and replaced")
        except pebble.ProcessExpired as exc:
            self._failures[spec.name] += n
            self._warn_once(
                spec.name,
                "expired",
                "Reward function %r: its worker process died (exit code %s) while scoring; the "
                "batch's rows score 0.0 and count as failures.",
                exc.exitcode,
            )
        except BrokenProcessPool as exc:
            raise RuntimeError(
                f"Reward function {spec.name!r}: its worker processes exited on start ({exc}). "
                "They import the main module (multiprocessing's forkserver), so a script must "
                'start training under `if __name__ == "__main__":`. Or run the function in the '
                "trainer's process (RewardCombiner(isolate=False), RLVRModule reward_isolate)."
            ) from exc
        except LoadError as exc:
            raise RuntimeError(
                f"Reward function {spec.name!r} could not be loaded in a worker process ({exc}). "
                "Define it at module level in an importable module, or run it in the trainer's "
                "process (RewardCombiner(isolate=...), RLVRModule reward_isolate)."
            ) from None
        return None

    def _check(self, spec: _Spec, outcome: Outcome, n: int) -> list[float | None]:
        if outcome.rows is None:
            values = coerce(outcome.returned, n, spec.name)
        else:
            values = []
            for i, raw in enumerate(outcome.rows):
                values += [0.0] if i in outcome.failed else coerce(raw, 1, spec.name, i)
        if outcome.failed:
            self._failures[spec.name] += len(outcome.failed)
            self._warn_once(
                spec.name,
                "failure",
                "Reward function %r raised on %d row(s), which score 0.0; further failures are "
                "counted in reward/%s/failures without a warning. First error:\n%s",
                len(outcome.failed),
                spec.name,
                outcome.error,
            )
        return self._apply_nan_policy(spec.name, values)

    def _apply_nan_policy(self, name: str, values: list[float | None]) -> list[float | None]:
        bad = {i for i, v in enumerate(values) if v is not None and not math.isfinite(v)}
        if not bad:
            return values
        if self.nan_policy == "error":
            raise RewardContractError(
                f"Reward function {name!r} returned {values[min(bad)]} for completion {min(bad)} "
                f"({len(bad)} of {len(values)} rows); expected a finite float, or None where it "
                "does not apply. nan_policy='fail' (RLVRModule: reward_nan_policy) scores such "
                "rows 0.0 and counts them as failures instead."
            )
        self._failures[name] += len(bad)
        self._warn_once(
            name,
            "nan",
            "Reward function %r returned NaN or inf on %d row(s), which score 0.0 and count as "
            "failures (nan_policy='fail').",
            len(bad),
        )
        return [0.0 if i in bad else v for i, v in enumerate(values)]

    def _record_timeout(self, name: str, fate: str) -> None:
        self._timeouts[name] += 1
        self._warn_once(
            name,
            "timeout",
            "Reward function %r exceeded timeout_s=%s on a batch; its rows score 0.0 and %s. "
            "Raise RewardCombiner(timeout_s=...) if it is just slow. Shown once per function.",
            self.timeout_s,
            fate,
        )

    def _warn_once(self, name: str, kind: str, message: str, *args: object) -> None:
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            logger.warning(message, name, *args)

    def _metrics(self, per_function: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, values in per_function.items():  # values: [N]
            if not torch.isnan(values).all():
                metrics[f"reward/{name}/mean"] = float(torch.nanmean(values))
            metrics[f"reward/{name}/failures"] = float(self._failures[name])
            metrics[f"reward/{name}/timeouts"] = float(self._timeouts[name])
        return metrics
