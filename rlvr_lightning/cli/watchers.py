"""The watchers every CLI trainer gets unless the config names its own: ``MemoryGuard``
(memory near the limit) and ``CollectiveWatch`` (a rank waiting on another)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from rlvr_lightning.callbacks import CollectiveWatch, MemoryGuard


def with_watchers(config: dict[str, Any], callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` plus a default ``MemoryGuard`` and ``CollectiveWatch``, each unless the
    trainer config's callbacks or ``callbacks`` already hold one."""
    given = config.get("callbacks") or []
    configured = [*(given if isinstance(given, list) else [given]), *callbacks]
    added = [
        cls()
        for cls in (MemoryGuard, CollectiveWatch)
        if not any(isinstance(cb, cls) for cb in configured)
    ]
    return [*callbacks, *added]
