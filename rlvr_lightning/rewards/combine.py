"""The one place where reward functions are weighted, isolated from each other and timed out.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``. The
combiner hands each function only the columns its signature names (all of them when it takes
``**kwargs``), turns ``None`` into NaN, and makes sure that a function that raises, returns
garbage or hangs costs the affected rows their reward instead of stopping training.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[Any]]


@dataclass(frozen=True)
class RewardResult:
    """Scores of one batch of completions.

    Args:
        total: ``[N]`` float32 weighted sum over functions, skipping not-applicable values; 0 for
            a row no function applies to.
        per_function: name -> ``[N]`` float32 raw value of each function, NaN where it returned
            None; failed or timed-out rows hold 0.0.
        metrics: ``reward/{name}/mean`` for this batch (omitted when no row applies), and since
            the combiner was built: ``reward/{name}/failures`` (rows that raised or returned
            garbage) and ``reward/{name}/timeouts`` (calls that ran out of time).
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


@dataclass(frozen=True)
class _Outcome:
    """What scoring one function on a batch produced."""

    values: list[float | None]
    failed_rows: int
    error: BaseException | None  # first error that cost a row its score


class _BadReturn(TypeError):
    """A reward function returned something other than one number or None per completion."""


def _snake_case(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _default_name(fn: RewardFn) -> str:
    name = getattr(fn, "__name__", None) or getattr(fn, "name", None)
    return str(name) if name else _snake_case(type(fn).__name__)


def _dedupe(names: list[str]) -> list[str]:
    """Suffix repeated names with ``_2``, ``_3``, ... so every metric key stays distinct."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def _inspect_columns(fn: RewardFn, name: str) -> tuple[frozenset[str] | None, tuple[str, ...], str]:
    """Accepted columns (None = all), required columns and the completions parameter's name."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: hand them everything
        return None, (), ""
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in (*positional, inspect.Parameter.VAR_POSITIONAL):
        raise ValueError(
            f"Reward function {name!r} must take the completions as its first positional "
            f"argument: fn(completions: list[str], **columns) -> list[float | None]."
        )
    first = params[0].name if params[0].kind in positional else ""
    named = [p for p in params[1:] if p.kind in keyword]
    required = tuple(p.name for p in named if p.default is inspect.Parameter.empty)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return (None if takes_all else frozenset(p.name for p in named)), required, first


def _as_value(value: object) -> float | None:
    """One returned value as a float, or None; NaN counts as None (not applicable)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise _BadReturn(f"expected a float or None per completion, got {type(value).__name__}")
    result = float(value)
    if math.isinf(result):
        raise _BadReturn(f"expected a finite float or None per completion, got {result}")
    return None if math.isnan(result) else result


def _coerce(raw: object, n: int) -> list[float | None]:
    """Check a function's return value: ``n`` floats or Nones."""
    if isinstance(raw, torch.Tensor):
        raw = raw.reshape(-1).tolist()
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise _BadReturn(f"expected a list of {n} floats or None, got {type(raw).__name__}")
    if len(raw) != n:
        raise _BadReturn(f"expected a list of {n} values (one per completion), got {len(raw)}")
    return [_as_value(v) for v in raw]


def _call(fn: RewardFn, completions: list[str], kwargs: dict[str, list[Any]]) -> list[float | None]:
    return _coerce(fn(completions, **kwargs), len(completions))


def _call_isolated(fn: RewardFn, completions: list[str], kwargs: dict[str, list[Any]]) -> _Outcome:
    """Score the batch; if that fails, score row by row so one bad row costs only itself."""
    try:
        return _Outcome(_call(fn, completions, kwargs), 0, None)
    except Exception:  # isolation is the point: the row retry reports the error
        pass
    values: list[float | None] = []
    failed, error = 0, None
    for i, completion in enumerate(completions):
        try:
            values.extend(_call(fn, [completion], {k: [v[i]] for k, v in kwargs.items()}))
        except Exception as exc:
            values.append(0.0)
            failed, error = failed + 1, error or exc
    return _Outcome(values, failed, error)


def _run_with_timeout(task: Callable[[], _Outcome], timeout_s: float, name: str) -> _Outcome | None:
    """Run ``task`` in a daemon thread; None if it has not finished after ``timeout_s``.

    Python cannot kill a thread, so a stuck task is abandoned: it keeps its thread (and any CPU
    it burns) until it returns or the process exits. Daemon threads never block that exit.
    """
    box: list[_Outcome | BaseException] = []

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
            ``None`` or ``0`` calls functions inline without a thread or timeout.

    Functions run one after another, each in its own daemon thread when ``timeout_s`` is set.
    A function that raises on the batch is retried row by row; rows that still fail score 0.0.

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
    ) -> None:
        functions = list(functions)
        weights = [1.0] * len(functions) if weights is None else [float(w) for w in weights]
        names = self._resolve_names(functions, names)
        self._check_args(functions, weights, timeout_s)
        self.timeout_s = timeout_s or None
        self.specs = tuple(
            _Spec(fn, name, weight, *_inspect_columns(fn, name))
            for fn, name, weight in zip(functions, names, weights, strict=True)
        )
        self._failures = dict.fromkeys(names, 0)
        self._timeouts = dict.fromkeys(names, 0)
        self._warned: set[tuple[str, str]] = set()

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @staticmethod
    def _resolve_names(functions: list[RewardFn], names: Sequence[str] | None) -> list[str]:
        if names is None:
            return _dedupe([_default_name(fn) for fn in functions])
        names = list(names)
        if len(names) != len(functions) or len(set(names)) != len(names):
            raise ValueError(
                f"RewardCombiner got {len(names)} names {names} for {len(functions)} functions; "
                "give one distinct name per function, or omit names to derive them."
            )
        return names

    @staticmethod
    def _check_args(
        functions: list[RewardFn], weights: list[float], timeout_s: float | None
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

    def __call__(self, completions: list[str], columns: dict[str, list[Any]]) -> RewardResult:
        self._check_columns(len(completions), columns)
        per_function = {
            spec.name: self._score(spec, completions, columns) for spec in self.specs
        }  # name -> [N]
        weighted = torch.stack(
            [spec.weight * per_function[spec.name] for spec in self.specs]
        )  # [F, N]
        total = torch.nansum(weighted, dim=0)  # [N]; all-NaN rows sum to 0
        return RewardResult(total, per_function, self._metrics(per_function))

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

    def _score(
        self, spec: _Spec, completions: list[str], columns: dict[str, list[Any]]
    ) -> torch.Tensor:
        kwargs = self._kwargs_for(spec, columns)

        def task() -> _Outcome:
            return _call_isolated(spec.fn, completions, kwargs)

        outcome = (
            task() if self.timeout_s is None else _run_with_timeout(task, self.timeout_s, spec.name)
        )
        if outcome is None:
            self._timeouts[spec.name] += 1
            self._warn_timeout(spec.name)
            outcome = _Outcome([0.0] * len(completions), 0, None)
        if outcome.failed_rows:
            self._failures[spec.name] += outcome.failed_rows
            self._warn_failure(spec.name, outcome)
        values = [math.nan if v is None else v for v in outcome.values]
        return torch.tensor(values, dtype=torch.float32)  # [N]

    def _warn_timeout(self, name: str) -> None:
        if (name, "timeout") in self._warned:
            return
        self._warned.add((name, "timeout"))
        logger.warning(
            "Reward function %r exceeded timeout_s=%s on a batch; its rows score 0.0 and the "
            "thread is abandoned (Python cannot kill threads). Raise RewardCombiner(timeout_s=...) "
            "if it is just slow. This warning is shown once per function.",
            name,
            self.timeout_s,
        )

    def _warn_failure(self, name: str, outcome: _Outcome) -> None:
        if (name, "failure") in self._warned:
            return
        self._warned.add((name, "failure"))
        error = outcome.error
        logger.warning(
            "Reward function %r failed on %d row(s), which score 0.0: %s. "
            "Further failures are counted in reward/%s/failures without a warning.",
            name,
            outcome.failed_rows,
            error,
            name,
            exc_info=(type(error), error, error.__traceback__) if error is not None else None,
        )

    def _metrics(self, per_function: dict[str, torch.Tensor]) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for name, values in per_function.items():  # values: [N]
            if not torch.isnan(values).all():
                metrics[f"reward/{name}/mean"] = float(torch.nanmean(values))
            metrics[f"reward/{name}/failures"] = float(self._failures[name])
            metrics[f"reward/{name}/timeouts"] = float(self._timeouts[name])
        return metrics
