"""What the combiner knows about each reward function, and the checks of its arguments and of
the columns a batch brings. Pure functions of the functions and the columns.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlvr_lightning.rewards.contract import RewardFn
from rlvr_lightning.rewards.signature import (
    dedupe,
    default_name,
    inspect_columns,
    wants_messages,
)
from rlvr_lightning.rewards.trl_contract import CONTEXT_ARGS


@dataclass(frozen=True)
class RewardSpec:
    """A reward function with what the combiner learned about it at construction."""

    fn: RewardFn
    name: str
    weight: float
    columns: frozenset[str] | None  # names it accepts; None means all (it takes **kwargs)
    required: tuple[str, ...]  # columns without a default
    first: str  # name of its completions parameter, never passed as a column
    by_name: bool = False  # the completions go by keyword, under ``first``
    isolated: bool = False  # runs in a worker process
    messages: bool = False  # gets message-list completions on every row (``wants_messages``)

    @property
    def context(self) -> tuple[str, ...]:
        """The non-row arguments (``trl_contract.CONTEXT_ARGS``) it takes."""
        return tuple(a for a in CONTEXT_ARGS if self.columns is None or a in self.columns)

    def kwargs(self, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The columns it takes, without its completions parameter."""
        return {
            k: v
            for k, v in columns.items()
            if k != self.first
            and k not in CONTEXT_ARGS
            and (self.columns is None or k in self.columns)
        }

    @property
    def needs(self) -> tuple[str, ...]:
        """The columns it needs (parameters without a default, TRL's non-row ones aside)."""
        return tuple(c for c in self.required if c not in CONTEXT_ARGS)


def build_specs(
    functions: list[RewardFn], names: list[str], weights: list[float], isolated: set[str]
) -> tuple[RewardSpec, ...]:
    """One spec per function, its signature read once."""
    return tuple(
        RewardSpec(
            fn,
            name,
            weight,
            *inspect_columns(fn, name),
            isolated=name in isolated,
            messages=wants_messages(fn),
        )
        for fn, name, weight in zip(functions, names, weights, strict=True)
    )


def check_batch_columns(specs: Sequence[RewardSpec], n: int, columns: dict[str, list[Any]]) -> None:
    """Raise when a column's length is not ``n`` or a function's column is missing."""
    wrong = {k: len(v) for k, v in columns.items() if len(v) != n}
    if wrong:
        raise ValueError(f"Reward columns must have one entry per completion ({n}); got {wrong}.")
    for spec in specs:
        missing = [c for c in spec.needs if c not in columns]
        if missing:
            raise ValueError(
                f"Reward function {spec.name!r} needs column(s) {missing}, but the batch only "
                f"has {sorted(columns)}. Add them to the dataset or give them defaults."
            )


def picklable(fn: RewardFn) -> bool:
    """Whether ``fn`` could be sent to a worker process (a module-level function)."""
    try:
        pickle.dumps(fn)
    except Exception:  # any failure means it cannot travel
        return False
    return True


def resolve_names(functions: list[RewardFn], names: Sequence[str] | None) -> list[str]:
    """The functions' metric names: ``names`` checked, or derived and made distinct."""
    if names is None:
        return dedupe([default_name(fn) for fn in functions])
    names = list(names)
    if len(names) != len(functions) or len(set(names)) != len(names):
        raise ValueError(
            f"RewardCombiner got {len(names)} names {names} for {len(functions)} functions; "
            "give one distinct name per function, or omit names to derive them."
        )
    return names


def check_args(
    functions: list[RewardFn], weights: list[float], timeout_s: float | None, nan_policy: str
) -> None:
    """Raise on arguments ``RewardCombiner`` cannot work with, saying how to fix them."""
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
