"""The reward-function contract: call a function on a batch (row by row if the batch raises)
and check that it returned one float or None per completion.

``call_isolated`` runs in a worker thread or process; ``coerce`` runs in the trainer's process
and raises ``RewardContractError`` naming the function. An ``async def`` function (or one that
returns an awaitable) is awaited right there, on an event loop of its own. TRL's non-row
arguments (``trainer_state``, ``log_extra``, ``log_metric``) are made there too, so what a
function logs comes back with its values (``rewards.trl_contract``).
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from rlvr_lightning.rewards.trl_contract import Completion, RewardLog, RewardState, context_kwargs

RewardFn = Callable[..., Sequence[Any]]


class RewardContractError(ValueError):
    """A reward function returned something other than one float or None per completion."""


@dataclass(frozen=True)
class Outcome:
    """What calling one function on a batch returned, before the values are checked."""

    returned: object  # the batch call's return value, when it did not raise
    rows: list[object] | None = None  # else each row's return value, called alone
    failed: tuple[int, ...] = ()  # rows that raised when called alone
    error: str | None = None  # the first row error, with its traceback
    log: RewardLog | None = None  # what it passed to log_extra / log_metric (successful calls)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _plain(raw: object) -> object:
    """Tensors and arrays as flat lists, so they check (and leave a worker) like lists."""
    if isinstance(raw, torch.Tensor) or (hasattr(raw, "tolist") and hasattr(raw, "reshape")):
        return raw.reshape(-1).tolist()  # type: ignore[union-attr]
    return raw


def _settle(value: object) -> object:
    """``value``, awaited first when it is awaitable (an ``async def`` reward's coroutine).

    Reward calls run in a worker thread or process without an event loop, so ``asyncio.run``
    is the normal case; a caller already inside a running loop (a notebook running the
    combiner inline) gets the coroutine run on a short-lived thread instead.
    """
    if not inspect.isawaitable(value):
        return value

    async def wait_for() -> object:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait_for())
    with ThreadPoolExecutor(1, thread_name_prefix="async-reward") as pool:
        return pool.submit(asyncio.run, wait_for()).result()


def _call(
    fn: RewardFn,
    completions: list[Completion],
    kwargs: dict[str, Any],
    by_name: str,
) -> object:
    """``fn(completions, **kwargs)``, or ``fn(**{by_name: completions}, **kwargs)`` when the
    completions are passed by keyword (TRL's ``fn(prompts, completions, **kwargs)`` order)."""
    if by_name:
        return _plain(_settle(fn(**{by_name: completions}, **kwargs)))
    return _plain(_settle(fn(completions, **kwargs)))


def call_isolated(
    fn: RewardFn,
    completions: list[Completion],
    kwargs: dict[str, list[Any]],
    by_name: str = "",
    state: RewardState | None = None,
    context: tuple[str, ...] = (),
) -> Outcome:
    """Call on the batch; if that raises, call row by row so one bad row costs only itself.

    Runs in a worker thread or process; the return values are checked by the caller.
    ``by_name``: the keyword the completions go under; ``""`` passes them first, positionally.
    ``context``: the non-row arguments the function takes (``trl_contract.CONTEXT_ARGS``),
    ``state`` the ``trainer_state`` it gets.
    """
    log = RewardLog()
    try:
        returned = _call(
            fn, completions, {**kwargs, **context_kwargs(context, state, log)}, by_name
        )
        return Outcome(returned, log=log)
    except Exception:  # isolation is the point: the row retry reports the error
        pass
    rows: list[object] = []
    logs: list[RewardLog | None] = []
    failed: list[int] = []
    error = None
    for i, completion in enumerate(completions):
        row_log = RewardLog()
        row = {k: [v[i]] for k, v in kwargs.items()} | context_kwargs(context, state, row_log)
        try:
            rows.append(_call(fn, [completion], row, by_name))
            logs.append(row_log)
        except Exception:
            rows.append(None)
            logs.append(None)
            failed.append(i)
            error = error or traceback.format_exc()
    return Outcome(None, rows, tuple(failed), error, RewardLog.merge_rows(logs))


def _as_value(value: object, name: str, row: int) -> float | None:
    """One returned value as a float (NaN and inf included) or None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardContractError(
            f"Reward function {name!r} returned {type(value).__name__} {_short(value)} for "
            f"completion {row}; expected a float, or None where it does not apply."
        )
    return float(value)


def coerce(raw: object, n: int, name: str, first_row: int = 0) -> list[float | None]:
    """Check a return value: ``n`` floats or Nones, else raise naming the function."""
    if isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
        raise RewardContractError(
            f"Reward function {name!r} returned {type(raw).__name__} {_short(raw)}; expected a "
            f"list of {n} float or None (one per completion)."
        )
    if len(raw) != n:
        raise RewardContractError(
            f"Reward function {name!r} returned {len(raw)} values for {n} completion(s); "
            "expected one float or None per completion."
        )
    return [_as_value(v, name, first_row + i) for i, v in enumerate(raw)]
