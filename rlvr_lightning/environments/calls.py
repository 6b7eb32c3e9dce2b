"""Running environment calls (tools, ``feedback``, async ``get_reward``) with a timeout each.

All calls of a turn run on one event loop, in a daemon thread that a :class:`CallRunner` owns:
an async function is awaited there (and cancelled on timeout); a sync one runs in a daemon
thread of its own whose result the loop awaits. So the rows of a batch run concurrently and a
hanging call holds up only its own row, for its own timeout. Python cannot stop a thread: a
sync call past its timeout is abandoned and counted with the reward code's accounting
(``rewards/threads.py``), which stops the run once ``max_abandoned_threads`` of one tool's
abandoned threads are still running.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from rlvr_lightning.rewards.threads import AbandonedThreads

T = TypeVar("T")
# Past the last call's own timeout: the loop's hand-over and the threads' start (this project's
# choice); a turn that takes longer means an async call blocks the loop without awaiting.
LOOP_GRACE_S = 5.0


class ToolTimeoutError(RuntimeError):
    """Tool calls abandoned on timeout in the trainer's process are still running."""


TOOL_FIX = (
    "Fix: make the tool return within tool_timeout_s (give it its own timeout), make it async "
    "(a coroutine is cancelled on timeout), or raise tool_timeout_s if it is only slow."
)


@dataclass(frozen=True)
class Outcome:
    """How one call ended: a value, an exception, or a timeout."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False


class CallRunner:
    """One event loop in a daemon thread for the environment calls, and the abandoned threads.

    Args:
        max_abandoned_threads: abandoned threads of one tool that may still be running before
            a call raises :class:`ToolTimeoutError`; ``None`` never raises.
    """

    def __init__(self, max_abandoned_threads: int | None = 16) -> None:
        self.threads = AbandonedThreads(max_abandoned_threads, "Tool", ToolTimeoutError)
        self._timed_out: set[str] = set()  # names with abandoned threads, for abandoned()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # A loop and its thread cannot be pickled (a copy of the module); a copy starts afresh.
        return {"threads": self.threads, "_timed_out": set()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.threads, self._timed_out = state["threads"], state["_timed_out"]
        self._loop, self._lock = None, threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        """The runner's event loop, started on first use in a daemon thread."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="rlvr-environments", daemon=True
                )
                thread.start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the runner's loop and wait at most ``timeout_s`` for it."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop())
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise RuntimeError(
                f"Environment calls did not finish within {timeout_s:.0f} s although each has "
                "its own timeout: an async tool or environment method blocks the event loop "
                "without awaiting. Fix: await in it, or move blocking work to "
                "asyncio.to_thread(...)."
            ) from None

    def close(self) -> None:
        """Stop the loop (abandoned threads run on until they return or the process exits)."""
        with self._lock:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    async def call(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float, name: str
    ) -> Outcome:
        """``fn(**kwargs)`` within ``timeout_s``; an exception or a timeout is an outcome."""
        if inspect.iscoroutinefunction(fn):
            try:
                return Outcome(await asyncio.wait_for(fn(**kwargs), timeout_s))
            except TimeoutError:
                return Outcome(timed_out=True)
            except Exception as exc:
                return Outcome(error=exc)
        return await self._call_in_thread(fn, kwargs, timeout_s, name)

    async def _call_in_thread(
        self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float, name: str
    ) -> Outcome:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Outcome] = loop.create_future()

        def settle(outcome: Outcome) -> None:
            if not done.done():  # cancelled by the timeout meanwhile
                done.set_result(outcome)

        def work() -> None:
            try:
                outcome = Outcome(fn(**kwargs))
            except Exception as exc:
                outcome = Outcome(error=exc)
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:  # the loop closed while this call ran on, abandoned
                pass

        thread = threading.Thread(target=work, name=f"tool-{name}", daemon=True)
        thread.start()
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            self._timed_out.add(name)
            self.threads.abandon(name, thread, timeout_s, TOOL_FIX)
            return Outcome(timed_out=True)

    def abandoned(self) -> dict[str, int]:
        """Abandoned threads still running, per tool name (only those with any)."""
        counts = {name: self.threads.running(name) for name in sorted(self._timed_out)}
        return {name: n for name, n in counts.items() if n}
