"""``MemoryGuard``: say when the trainer nears the machine's memory limit, and stop cleanly
before the kernel's OOM killer ends it with no message and nothing saved.

The CLI installs one with the defaults below unless one is configured:
``--trainer.callbacks+=rlvr_lightning.callbacks.MemoryGuard --trainer.callbacks.stop_share=0.9``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from rlvr_lightning.runtime import memory

log = logging.getLogger(__name__)

# Sent by the watcher thread to the main thread, whose handler raises `MemoryLimitExceeded`:
# a real signal also wakes a main thread blocked in a wait (a reward's timeout, a join).
STOP_SIGNAL = signal.SIGUSR2


class MemoryLimitExceeded(SystemExit):
    """The trainer's memory passed ``MemoryGuard.stop_share`` of the limit; exit code 1.

    A ``SystemExit``, as ``checkpointing.TrainingStopped``: it is raised wherever the main
    thread is, and an ``except Exception`` there (a reward's error handling) must not take it
    for that code's own failure. The message is logged when it is raised."""

    def __init__(self, reason: str) -> None:
        super().__init__(1)
        self.reason = reason


class MemoryGuard(Callback):
    """Watches the trainer's resident memory against the limit (``memory.machine_limit``: the
    cgroup's ``memory.max`` where set, else ``MemTotal``) from a background thread.

    Args:
        warn_share: share of the limit at which a warning, once per run, gives the numbers
            and the settings that size the memory (``micro_batch_size``, ``max_new_tokens``,
            ``max_prompt_tokens``).
        stop_share: share at which training stops with ``MemoryLimitExceeded`` (exit code 1)
            so the on-exception checkpoints are written while there is still room, rather
            than the kernel killing the process; None: never stop.
        interval_s: seconds between two readings.
        limit_bytes: the limit to use instead of the machine's.

    The shares (0.85 and 0.95) and the 0.2 s interval are this project's choice: memory that
    grows by more than 5% of the limit within 0.2 s can still be killed first.
    """

    def __init__(
        self,
        warn_share: float = 0.85,
        stop_share: float | None = 0.95,
        interval_s: float = 0.2,
        limit_bytes: int | None = None,
    ) -> None:
        if not 0 < warn_share <= 1 or (stop_share is not None and not 0 < stop_share <= 1):
            raise ValueError(
                f"MemoryGuard: warn_share ({warn_share}) and stop_share ({stop_share}) are "
                "shares of the memory limit, in (0, 1]."
            )
        self.warn_share, self.stop_share = warn_share, stop_share
        self.interval_s, self.limit_bytes = interval_s, limit_bytes
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self._installed = False  # our handler of STOP_SIGNAL is in place
        self._reason = ""

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = memory.machine_limit()
        if self.limit_bytes is not None:
            found = (self.limit_bytes, "MemoryGuard.limit_bytes")
        if found is None or memory.resident_bytes() is None:
            return
        knobs = memory.knobs(pl_module, trainer.datamodule)
        self._done.clear()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(STOP_SIGNAL, self._raise)
            self._installed = True
        self._thread = threading.Thread(
            target=self._watch, args=(*found, knobs), name="MemoryGuard", daemon=True
        )
        self._thread.start()

    def _watch(self, limit: int, source: str, knobs: str) -> None:
        warned = False
        while not self._done.wait(self.interval_s):
            used = memory.resident_bytes() or 0
            share = used / limit
            text = (
                f"the trainer holds {memory.gib(used)}, {share:.0%} of the {memory.gib(limit)} "
                f"it may use ({source})"
            )
            if not warned and share >= self.warn_share:
                warned = True
                log.warning("Memory: %s. To use less, lower %s.", text, knobs)
            if self.stop_share is not None and share >= self.stop_share:
                self._reason = (
                    f"Memory: {text}, over MemoryGuard's stop_share {self.stop_share}: stopping "
                    f"before the kernel kills the process. Lower {knobs}; a reward that "
                    "allocates without bound shows here too (reward_isolate runs it in a "
                    "worker process)."
                )
                log.error("%s", self._reason)
                self._done.set()
                if self._installed:  # else the signal's default action would kill the process
                    signal.pthread_kill(threading.main_thread().ident or 0, STOP_SIGNAL)
                return

    def _raise(self, signum: int, frame: Any) -> None:
        raise MemoryLimitExceeded(self._reason)

    def _stop_watching(self) -> None:
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(STOP_SIGNAL, self._previous or signal.SIG_DFL)
            self._installed = False

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_watching()

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stop_watching()


def exit_at_once(code: int) -> None:
    """Flush and end the process without finalising the interpreter: a reward thread still
    allocating inside torch makes the finalisation abort (exit code 134 instead of ``code``)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
