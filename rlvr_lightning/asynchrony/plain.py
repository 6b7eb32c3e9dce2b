"""The batch types as plain data (dicts, lists, tensors, numbers, strings), so a checkpoint that
holds queued rounds loads with ``torch.load(weights_only=True)`` and survives a new field.

Generic over ``dataclasses.fields``: a field added to ``Rollouts`` or ``Scored`` (``env_mask``
of multi-turn rows, ...) is saved and restored with no change here. A restored dataclass gets
only the fields its class still has; a field missing from the saved data keeps its default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlvr_lightning.types import PromptBatch, Rollouts, Scored

TYPE_KEY = "__dataclass__"
# The dataclasses a queued round holds, by name (saved as the name, never as a pickled class).
KNOWN: dict[str, type] = {cls.__name__: cls for cls in (PromptBatch, Rollouts, Scored)}


def register(cls: type) -> type:
    """Make ``cls`` (a dataclass) known to :func:`from_plain`; returns it (a decorator)."""
    KNOWN[cls.__name__] = cls
    return cls


def to_plain(value: Any) -> Any:
    """``value`` with every known dataclass turned into ``{TYPE_KEY: name, field: value}``,
    tuples into lists tagged as tuples; tensors are kept (detached, on the CPU)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        name = type(value).__name__
        if KNOWN.get(name) is not type(value):
            raise TypeError(f"to_plain: {name} is not registered (asynchrony.plain.register).")
        fields = {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {TYPE_KEY: name, **fields}
    if hasattr(value, "detach"):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [to_plain(v) for v in value]}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    return value


def from_plain(value: Any) -> Any:
    """The inverse of :func:`to_plain`."""
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(from_plain(v) for v in value["__tuple__"])
        if TYPE_KEY in value:
            cls = KNOWN[value[TYPE_KEY]]
            names = {f.name for f in dataclasses.fields(cls)}
            return cls(**{k: from_plain(v) for k, v in value.items() if k in names})
        return {k: from_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_plain(v) for v in value]
    return value
