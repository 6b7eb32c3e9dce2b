"""Reward functions that run in a thread of the trainer's process, with a timeout.

Python cannot kill a thread, so a call that runs past its timeout is abandoned: it keeps its
thread, and the CPU it burns, until it returns or the process exits: with a spinning reward
every timeout slows the rest of each later step (measured on the tiny config: 0.3 s to 5.1 s
over 6 steps).
So the first timeout of a function is reported with the fix (a worker process, which is killed
on timeout), and once ``max_abandoned`` of its abandoned threads are still running the run stops
instead of stacking more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class RewardTimeoutError(RuntimeError):
    """Reward calls abandoned on timeout in the trainer's process are still running."""


def fix_for(name: str, picklable: bool) -> str:
    """How to make a function's timeouts harmless: run it where a timeout can kill it."""
    where = (
        f"run it in a worker process that is killed on timeout: list {name!r} in "
        "model.init_args.rewards.isolate or mark it @rlvr_lightning.rewards.run_in_process"
        if picklable
        else "define it at module level so that it can run in a worker process that is killed "
        f"on timeout (rewards.isolate: [{name}])"
    )
    return f"Fix: {where}; or raise rewards.timeout_s if it is only slow."


class AbandonedThreads:
    """Runs tasks in daemon threads with a timeout and keeps the threads it had to abandon.

    Args:
        max_abandoned: how many abandoned threads of one function may still be running before
            :meth:`run` raises ``error``; ``None`` never raises.
        what: what the functions are, for the error (a tool's threads are counted here too).
        error: the exception raised past ``max_abandoned``.
    """

    def __init__(
        self,
        max_abandoned: int | None = 3,
        what: str = "Reward function",
        error: type[RuntimeError] = RewardTimeoutError,
    ) -> None:
        if max_abandoned is not None and max_abandoned < 1:
            raise ValueError(
                f"max_abandoned_threads must be >= 1 (or None for no limit); got {max_abandoned}."
            )
        self.max_abandoned, self.what, self.error = max_abandoned, what, error
        self._abandoned: dict[str, list[threading.Thread]] = {}

    def __getstate__(self) -> dict[str, object]:
        # Threads cannot be pickled (a combiner copied with its module); a copy starts afresh.
        return {**self.__dict__, "_abandoned": {}}

    def __setstate__(self, state: dict[str, object]) -> None:
        # Copies pickled before ``what`` and ``error`` existed are reward threads.
        self.__dict__.update({"what": "Reward function", "error": RewardTimeoutError, **state})

    def running(self, name: str) -> int:
        """How many of ``name``'s abandoned threads are still running."""
        alive = [t for t in self._abandoned.get(name, []) if t.is_alive()]
        self._abandoned[name] = alive
        return len(alive)

    def run(self, task: Callable[[], T], timeout_s: float, name: str, fix: str) -> T | None:
        """``task()`` in a daemon thread; None if it has not finished after ``timeout_s``.

        Daemon threads never block the process's exit. ``fix`` completes the error raised when
        too many of ``name``'s abandoned threads are still running.
        """
        box: list[T | BaseException] = []

        def work() -> None:
            try:
                box.append(task())
            except BaseException as exc:  # SystemExit and the like: re-raised below, as inline
                box.append(exc)

        thread = threading.Thread(target=work, name=f"reward-{name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self.abandon(name, thread, timeout_s, fix)
            return None
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def abandon(self, name: str, thread: threading.Thread, timeout_s: float, fix: str) -> None:
        """Count ``thread``, which ran ``name`` past ``timeout_s``, as abandoned; raise when
        ``max_abandoned`` of ``name``'s abandoned threads are still running."""
        self._abandoned.setdefault(name, []).append(thread)
        running = self.running(name)
        if self.max_abandoned is not None and running >= self.max_abandoned:
            raise self.error(
                f"{self.what} {name!r} ran past timeout_s={timeout_s} in {running} calls "
                "whose threads are still running in the trainer's process (Python cannot stop "
                f"a thread; max_abandoned_threads={self.max_abandoned}).\n{fix}"
            )
