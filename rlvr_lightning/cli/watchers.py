"""The callbacks every CLI trainer gets unless the config names its own: ``MemoryGuard``
(memory near the limit), ``CollectiveWatch`` (a rank waiting on another) and, for ``fit``, a
``CompletionsTable`` (what the policy writes, from the first run)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from rlvr_lightning.callbacks import CollectiveWatch, CompletionsTable, MemoryGuard

# Rows per step of the default CompletionsTable (this project's choice).
COMPLETIONS_ROWS = 4


def _configured(config: dict[str, Any], callbacks: list[Callback]) -> list[Any]:
    given = config.get("callbacks") or []
    return [*(given if isinstance(given, list) else [given]), *callbacks]


def with_watchers(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` plus a default ``MemoryGuard`` and ``CollectiveWatch``, each unless the
    trainer config's callbacks or ``callbacks`` already hold one."""
    configured = _configured(config, callbacks)
    added = [
        cls()
        for cls in (MemoryGuard, CollectiveWatch)
        if not any(isinstance(cb, cls) for cb in configured)
    ]
    return [*callbacks, *added]


def with_completions_table(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` plus a ``CompletionsTable`` (every step, ``COMPLETIONS_ROWS`` rows) unless
    one is configured."""
    if any(isinstance(cb, CompletionsTable) for cb in _configured(config, callbacks)):
        return callbacks
    return [*callbacks, CompletionsTable(every_n_steps=1, max_rows=COMPLETIONS_ROWS)]
