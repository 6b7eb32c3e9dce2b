"""The one place where reward functions are weighted, isolated from each other and timed out.

A reward function is ``fn(completions, **columns) -> list[float | None]`` with TRL's contract:
completions are strings, or ``[{"role": "assistant", "content": ...}]`` for rows whose prompt is
conversational; ``trainer_state``, ``log_extra`` and ``log_metric`` are passed as TRL does
(``rewards.trl_contract``). The combiner hands each function only the columns its signature
names (all of them when it takes ``**kwargs``) and turns ``None`` into NaN. The completions go
first, or by keyword to a parameter named ``completions`` (TRL's ``fn(prompts, completions,
**kwargs)``); an ``async def`` function is awaited. A function that raises on some rows costs
those rows their reward; one that raises on every row (or most, over a window) stops training
with a ``RewardFailureError`` (``rewards.health``). One that hangs costs the batch's rows their
reward: in a worker process nothing later (the worker is killed); in a thread the thread keeps
running, so a few such stop training with a ``RewardTimeoutError`` (``rewards.threads``). A
function that breaks the contract (wrong length, wrong type, NaN) stops training with a
``RewardContractError`` naming it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import Future, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Literal

import pebble
import torch

from rlvr_lightning.rewards.contract import (
    Outcome,
    RewardFn,
    call_isolated,
    coerce,
)
from rlvr_lightning.rewards.health import RewardHealth
from rlvr_lightning.rewards.isolation import (
    DEFAULT_WORKER_MEMORY_MB,
    LoadError,
    RewardWorkers,
    isolated_names,
    preload_modules,
)
from rlvr_lightning.rewards.specs import (
    RewardSpec,
    build_specs,
    check_args,
    check_batch_columns,
    picklable,
    resolve_names,
)
from rlvr_lightning.rewards.threads import AbandonedThreads, fix_for
from rlvr_lightning.rewards.trl_contract import (
    Completion,
    RewardLog,
    RewardState,
    as_completions,
    conversational_rows,
    logged_columns,
)

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
            ``reward/{name}/timeouts`` (calls that ran out of time); and the mean of what a
            function passed to ``log_metric(metric, value)`` as ``reward/{name}/{metric}``.
        logged_columns: what the functions passed to ``log_extra(column, values)``, one value
            per completion (a column two functions log is kept as ``{name}/{column}`` for the
            second).
    """

    total: torch.Tensor  # [N]
    per_function: dict[str, torch.Tensor]  # name -> [N]
    metrics: dict[str, float]
    logged_columns: dict[str, list[Any]] = field(default_factory=dict)


def _wait(future: Future) -> Outcome:
    """The future's result. Waiting in slices keeps the main thread where a signal handler
    that raises (SIGINT, a SIGTERM stop) interrupts it at once."""
    while not future.done():
        wait([future], timeout=0.5)
    return future.result()


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
        max_failure_share: a function that raises on every row of a batch (of two rows or
            more), or fails or times out on more than this share of its rows over the last
            ``failure_window`` batches, stops training with ``RewardFailureError``; ``None``
            only counts failures. 0.5 and 10 are this project's choice: a parser that raises
            on odd rows scores them 0 and goes on; one that fails on most rows is broken.
        failure_window: batches the failure share is measured over (judged once full).
        max_abandoned_threads: once this many timed-out calls of one function still run in
            abandoned threads, training stops with ``RewardTimeoutError`` (the first timeout is
            reported with the fix: a worker process); ``None`` lets them stack. 3 is this
            project's choice: a slow call that finishes later does not count.
        worker_memory_mb: address space of each worker process (``RLIMIT_AS``; 4096 MB, this
            project's choice): a reward allocating past it fails on those rows (counted, and
            loud by the rules above) instead of growing the machine out of memory.

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
        max_failure_share: float | None = 0.5,
        failure_window: int = 10,
        max_abandoned_threads: int | None = 3,
        worker_memory_mb: int | None = DEFAULT_WORKER_MEMORY_MB,
    ) -> None:
        functions = list(functions)
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        names = resolve_names(functions, names)
        check_args(functions, weights, timeout_s, nan_policy)
        isolated = isolated_names(functions, names, isolate)
        self.timeout_s = timeout_s or None
        self.nan_policy = nan_policy
        self.specs = build_specs(functions, names, weights, isolated)
        self._own_workers = workers is None
        self._workers = workers
        self.health = RewardHealth(names, max_failure_share, failure_window)
        self._threads = AbandonedThreads(max_abandoned_threads)
        self.worker_memory_mb = worker_memory_mb

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

    def __call__(
        self,
        completions: list[str] | list[list[dict]],
        columns: dict[str, list[Any]],
        conversational: Sequence[bool] | None = None,
        trainer_state: RewardState | None = None,
    ) -> RewardResult:
        """Score ``completions`` (texts) with the per-row ``columns``.

        ``conversational``: which rows a reward gets as a message list; by default those whose
        ``prompts`` column entry is a message list (a reward that annotates its completions as
        ``list[list[dict[str, str]]]``, as TRL's own do, gets every row so).
        ``trainer_state``: what a reward taking ``trainer_state`` gets
        (``RewardState.of(trainer)``; None outside training).
        """
        check_batch_columns(self.specs, len(completions), columns)
        if conversational is None:
            conversational = conversational_rows(columns.get("prompts"), len(completions))
        given = {
            False: as_completions(completions, conversational),
            True: as_completions(completions, [True] * len(completions)),  # TRL-annotated
        }
        futures = {
            spec.name: self._submit(spec, given[spec.messages], columns, trainer_state)
            for spec in self.specs
            if spec.isolated
        }
        logs: dict[str, RewardLog] = {}
        try:
            per_function = {
                spec.name: self._score(
                    spec, given[spec.messages], columns, futures.get(spec.name), trainer_state, logs
                )
                for spec in self.specs
            }  # name -> [N]
        except BaseException:  # a stopping error, or a signal stopping the run: kill the rest
            for future in futures.values():
                future.cancel()
            raise
        weighted = torch.stack(
            [spec.weight * per_function[spec.name] for spec in self.specs]
        )  # [F, N]
        total = torch.nansum(weighted, dim=0)  # [N]; all-NaN rows sum to 0
        metrics = self._metrics(per_function, logs)
        return RewardResult(
            total, per_function, metrics, logged_columns(logs, total.numel(), self.health.warn_once)
        )

    def required_columns(self) -> dict[str, tuple[str, ...]]:
        """name -> the columns that function needs (parameters without a default)."""
        return {spec.name: spec.needs for spec in self.specs if spec.needs}

    def check_available(
        self, columns: Sequence[str], where: str, supplied: Sequence[str] = ROLLOUT_COLUMNS
    ) -> None:
        """Raise naming the reward, the column and the columns there are when a required
        column is neither in ``columns`` (``where`` says whose: a data source) nor ``supplied``
        (the per-row inputs the module adds)."""
        for spec in self.specs:
            missing = [c for c in spec.needs if c not in (*columns, *supplied)]
            if missing:
                raise ValueError(
                    f"Reward function {spec.name!r} needs column {missing[0]!r}, but {where} has "
                    f"only {sorted(columns)} (plus {', '.join(supplied)}). Add the column to the "
                    "data (or map one to it with data.columns), give the parameter a default, or "
                    "drop the reward."
                )

    def _submit(
        self,
        spec: RewardSpec,
        completions: list[Completion],
        columns: dict[str, list[Any]],
        state: RewardState | None,
    ) -> Future:
        if self._workers is None:
            isolated = [s.fn for s in self.specs if s.isolated]
            processes = max(1, min(len(isolated), os.cpu_count() or 1))
            preload = preload_modules(isolated)
            self._workers = RewardWorkers(processes, preload, self.worker_memory_mb)
        by_name = spec.first if spec.by_name else ""
        args = (completions, spec.kwargs(columns), by_name, state, spec.context)
        return self._workers.submit(spec.fn, call_isolated, *args, timeout=self.timeout_s)

    def _score(
        self,
        spec: RewardSpec,
        completions: list[Completion],
        columns: dict[str, list[Any]],
        future: Future | None,
        state: RewardState | None,
        logs: dict[str, RewardLog],
    ) -> torch.Tensor:
        n = len(completions)
        outcome = (
            self._collect(spec, future, n)
            if future is not None
            else self._run_here(spec, completions, columns, state)
        )
        values = [0.0] * n if outcome is None else self._check(spec, outcome, n)
        if outcome is not None and outcome.log is not None:
            logs[spec.name] = outcome.log
        return torch.tensor(
            [math.nan if v is None else v for v in values], dtype=torch.float32
        )  # [N]

    def _run_here(
        self,
        spec: RewardSpec,
        completions: list[Completion],
        columns: dict[str, list[Any]],
        state: RewardState | None,
    ) -> Outcome | None:
        kwargs = spec.kwargs(columns)
        by_name = spec.first if spec.by_name else ""

        def task() -> Outcome:
            return call_isolated(spec.fn, completions, kwargs, by_name, state, spec.context)

        if self.timeout_s is None:
            return task()
        fix = fix_for(spec.name, picklable(spec.fn))
        outcome = self._threads.run(task, self.timeout_s, spec.name, fix)
        if outcome is None:
            self._record_timeout(spec.name, f"its thread keeps running. {fix}", len(completions))
        return outcome

    def _collect(self, spec: RewardSpec, future: Future, n: int) -> Outcome | None:
        try:
            return _wait(future)
        except TimeoutError:
            self._record_timeout(spec.name, "its worker process was killed and replaced", n)
        except pebble.ProcessExpired as exc:
            self.health.warn_once(
                spec.name,
                "expired",
                "Reward function %r: its worker process died (exit code %s) while scoring; the "
                "batch's rows score 0.0 and count as failures.",
                exc.exitcode,
            )
            self.health.record_rows(spec.name, n, n, None)
        except BrokenProcessPool as exc:
            raise RuntimeError(
                f"Reward function {spec.name!r}: its worker processes exited on start ({exc}). "
                "They import the main module (multiprocessing's forkserver), so a script must "
                'start training under `if __name__ == "__main__":`. Or run the function in the '
                "trainer's process (RewardCombiner(isolate=False), RLVRModule rewards.isolate)."
            ) from exc
        except LoadError as exc:
            raise RuntimeError(
                f"Reward function {spec.name!r} could not be loaded in a worker process ({exc}). "
                "Define it at module level in an importable module, or run it in the trainer's "
                "process (RewardCombiner(isolate=...), RLVRModule rewards.isolate)."
            ) from None
        return None

    def _check(self, spec: RewardSpec, outcome: Outcome, n: int) -> list[float | None]:
        if outcome.rows is None:
            values = coerce(outcome.returned, n, spec.name)
        else:
            values = []
            for i, raw in enumerate(outcome.rows):
                values += [0.0] if i in outcome.failed else coerce(raw, 1, spec.name, i)
        self.health.record_rows(spec.name, len(outcome.failed), n, outcome.error)
        return self.health.apply_nan_policy(spec.name, values, self.nan_policy)

    def _record_timeout(self, name: str, fate: str, rows: int) -> None:
        self.health.record_timeout(name, self.timeout_s, fate, rows)

    def _metrics(
        self, per_function: dict[str, torch.Tensor], logs: dict[str, RewardLog]
    ) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, values in per_function.items():  # values: [N]
            if not torch.isnan(values).all():
                metrics[f"reward/{name}/mean"] = float(torch.nanmean(values))
        metrics.update(self.health.metrics())
        for name, log in logs.items():
            metrics.update({f"reward/{name}/{k}": v for k, v in log.means().items()})
        return metrics
