"""``CollectiveWatch``: no silent waits between data-parallel ranks.

A rank blocked in a collective (all-reduce, gather, barrier, DDP's gradient all-reduce) for
``warn_every_s`` says so, and again every ``warn_every_s``: which collective, at which step,
called from where, and what every other rank last reported. After ``timeout_s`` the rank
logs which rank did not answer and what it was doing, and ends the run (exit code 1).
The CLI installs one with the defaults unless one is configured:
``--trainer.callbacks+=rlvr_lightning.callbacks.CollectiveWatch --trainer.callbacks.timeout_s=600``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from rlvr_lightning.runtime import collectives

log = logging.getLogger(__name__)

TIMEOUT_EXIT_CODE = 1
STORE_TIMEOUT_S = 5.0  # a heartbeat's store calls (the store's own timeout)


class CollectiveWatch(Callback):
    """Watches this rank's main thread from a background thread (multi-process runs only).

    Args:
        warn_every_s: seconds in one collective before the first message, and between two.
        timeout_s: seconds in one collective after which the run ends with an error naming
            the rank that did not answer. The default, 25 minutes, is this project's choice:
            below the 30 minutes after which gloo and NCCL give up with their own error
            (which names no rank, and would leave the on-exception checkpoint waiting on the
            same missing rank). A longer ``timeout_s`` needs a longer process group timeout
            (the strategy's ``timeout``).
        heartbeat_s: seconds between two reports of this rank's step and activity to the
            others; a rank silent for three of them counts as not answering.
    """

    def __init__(
        self, warn_every_s: float = 60.0, timeout_s: float = 1500.0, heartbeat_s: float = 5.0
    ) -> None:
        if min(warn_every_s, timeout_s, heartbeat_s) <= 0:
            raise ValueError(
                "CollectiveWatch: warn_every_s, timeout_s and heartbeat_s must be > 0."
            )
        self.warn_every_s, self.timeout_s, self.heartbeat_s = warn_every_s, timeout_s, heartbeat_s
        self._done = threading.Event()
        self._threads: list[threading.Thread] = []
        self._trainer: pl.Trainer | None = None
        self._address: str | None = None  # the store's, once heartbeats work
        self._peers: dict[int, dict[str, Any] | None] = {}
        self._exchanged = time.time()  # the last report and read that went through

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.world_size < 2 or self._threads:
            return
        self._trainer, self._exchanged = trainer, time.time()
        self._done.clear()
        self._threads = [threading.Thread(target=self._watch, name="CollectiveWatch", daemon=True)]
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            # Store calls run in a thread of their own: one to a frozen store host blocks.
            self._threads.append(
                threading.Thread(target=self._exchange, name="CollectiveWatch-beats", daemon=True)
            )
        for thread in self._threads:
            thread.start()

    def _exchange(self) -> None:
        """Report this rank's step and activity, and read the others', every heartbeat_s."""
        try:
            beats = collectives.Heartbeats(self._rank(), self._trainer.world_size)  # type: ignore[union-attr]
        except Exception as err:  # the watch still reports this rank's own waits
            log.warning("CollectiveWatch: no heartbeats (store unreachable: %s).", err)
            return
        self._address = beats.address
        while not self._done.wait(self.heartbeat_s):
            try:
                beats.report(self._step(), collectives.activity(collectives.main_frame()))
                self._peers = beats.read()
            except Exception as err:  # the store's host does not answer: said by `_message`
                log.debug("CollectiveWatch: heartbeat failed: %s", err)
                continue
            self._exchanged = time.time()

    def _watch(self) -> None:
        tick = min(1.0, self.warn_every_s / 4, self.heartbeat_s)
        waiting: FrameType | None = None
        since = next_warn = 0.0
        while not self._done.wait(tick):
            frame, now = collectives.main_frame(), time.time()
            found = collectives.waiting_on(frame)
            if found is None or found[1] is not waiting:
                waiting = None if found is None else found[1]
                since, next_warn = now, now + self.warn_every_s
                continue
            if now - since >= self.timeout_s:
                self._give_up(found[0], now - since, frame)
            elif now >= next_warn:
                next_warn += self.warn_every_s
                log.warning("%s", self._message(found[0], now - since, frame)[0])
            del frame

    def _rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else -1

    def _step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else -1

    def _message(self, name: str, waited: float, frame: FrameType | None) -> tuple[str, list[int]]:
        text = (
            f"Rank {self._rank()} has waited {waited:.0f} s in {name} at step {self._step()}, "
            f"called from {collectives.activity(frame)}."
        )
        if self._address is None:
            return text, []
        stale_s, now = 3 * self.heartbeat_s, time.time()
        peers, silent = collectives.describe_peers(self._peers, stale_s, now)
        if now - self._exchanged > stale_s + STORE_TIMEOUT_S:
            peers = (
                f"the store at {self._address} (hosted by rank 0) has not answered for "
                f"{now - self._exchanged:.0f} s; before that, {peers}"
            )
            silent = sorted({0, *silent})
        return f"{text} {peers}.", silent

    def _give_up(self, name: str, waited: float, frame: FrameType | None) -> None:
        text, silent = self._message(name, waited, frame)
        who = ", ".join(f"rank {r}" for r in silent) or "no rank is silent; the ranks disagree"
        log.error(
            "Collective timeout (CollectiveWatch timeout_s=%s): %s Not answering: %s. A rank that "
            "is stopped, swapping or in a different collective holds the others; if it is only "
            "slow, raise timeout_s. Ending this run; resume from the last checkpoint.",
            self.timeout_s,
            text,
            who,
        )
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        sys.stderr.flush()
        launcher = getattr(self._trainer.strategy, "launcher", None) if self._trainer else None
        if hasattr(launcher, "kill"):  # the ranks this process started (Lightning's DDP)
            launcher.kill(signal.SIGKILL)
        os._exit(TIMEOUT_EXIT_CODE)  # the main thread is blocked in C++: nothing else ends it

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stop()

    def _stop(self) -> None:
        self._done.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=1)  # a store call may hang: the threads are daemons
        self._threads = []
