"""Worker processes for reward functions that may hang, spin or hold the GIL.

A function marked with :func:`run_in_process` (the built-in math verifiers are) runs in a
:class:`RewardWorkers` pool: a ``pebble.ProcessPool`` whose timed-out or cancelled tasks have their
worker killed and replaced, so a stuck verifier costs one timeout and nothing later, and the
trainer's main thread stays free to handle SIGINT/SIGTERM.

Workers start from a ``forkserver``: ``fork`` is not safe once torch has run multi-threaded ops
(measured: a matmul in a forked child deadlocks), and ``spawn`` would import the whole package again
for every replacement worker (8-10 s on a loaded 2-core machine; 0.1 s from a preloaded
forkserver).
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import pickle
import resource
import signal
import sys
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import pebble

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "run_in_process"
_PRELOAD = "run_in_process_preload"
_PR_SET_PDEATHSIG = 1


def run_in_process(fn: F | None = None, *, preload: Sequence[str] = ()) -> Any:
    """Mark a reward function to run in a worker process that is killed on timeout.

    Use it for functions that can hang or hold the GIL (symbolic maths, parsers, native code).
    The function must be importable by name (defined at module level); ``preload`` names extra
    modules the workers import before their first task (e.g. ``["math_verify"]``). Sets the
    attribute ``run_in_process = True``; ``RewardCombiner(isolate=...)`` can override it.

    >>> @run_in_process(preload=["fractions"])
    ... def exact(completions: list[str], answer: list[str]) -> list[float]:
    ...     return [float(c == a) for c, a in zip(completions, answer)]
    >>> is_marked(exact), exact(["1"], answer=["1"])
    (True, [1.0])
    """

    def mark(f: F) -> F:
        setattr(f, _MARK, True)
        setattr(f, _PRELOAD, tuple(preload))
        return f

    return mark if fn is None else mark(fn)


def is_marked(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked with :func:`run_in_process`."""
    return getattr(fn, _MARK, False) is True


def isolated_names(
    functions: list[Callable[..., Any]], names: list[str], isolate: bool | Sequence[str] | None
) -> set[str]:
    """Names of the functions to run in worker processes; checks that they can be sent there."""
    if isolate is None:
        chosen = {name for fn, name in zip(functions, names, strict=True) if is_marked(fn)}
    elif isinstance(isolate, bool):
        chosen = set(names) if isolate else set()
    else:
        chosen = set(isolate)
        unknown = sorted(chosen - set(names))
        if unknown:
            raise ValueError(f"isolate names {unknown} are not reward function names {names}.")
    for fn, name in zip(functions, names, strict=True):
        if name in chosen:
            try:
                pickle.dumps(fn)
            except Exception as exc:
                raise ValueError(
                    f"Reward function {name!r} is set to run in a worker process but cannot be "
                    f"pickled ({type(exc).__name__}: {exc}). Define it at module level (not a "
                    "lambda or closure), or leave it out of isolate."
                ) from exc
    return chosen


def preload_modules(fns: Sequence[Callable[..., Any]]) -> tuple[str, ...]:
    """The modules defining ``fns`` plus the extra modules their marks name, without repeats."""
    names: list[str] = []
    for fn in fns:
        module = getattr(fn, "__module__", None) or type(fn).__module__
        names += [module, *getattr(fn, _PRELOAD, ())]
    return tuple(dict.fromkeys(n for n in names if n and n != "__main__"))


class LoadError(RuntimeError):
    """A reward function could not be unpickled (imported) in a worker process."""


def call_pickled(blob: bytes, task: Callable[..., Any], *args: Any) -> Any:
    """Worker side: load the reward function from ``blob`` and run ``task(fn, *args)``.

    The function travels pickled inside the task so that a failure to import it in the worker
    surfaces as a ``LoadError`` instead of a worker that dies while reading its task.
    """
    try:
        fn = pickle.loads(blob)
    except Exception as exc:
        raise LoadError(f"{type(exc).__name__}: {exc}") from None
    return task(fn, *args)


def _die_with_parent() -> None:
    """Linux: SIGKILL this worker when its parent (the forkserver) exits.

    The forkserver exits when the trainer does, however it ends, so a SIGKILLed trainer does not
    leave a spinning reward behind.
    """
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass


# Address space of one reward worker by default (this project's choice): a verifier that parses
# and compares answers needs far less; the forkserver's imports map ~0.7 GB of it here.
DEFAULT_WORKER_MEMORY_MB = 4096


def _limit_memory(memory_mb: int | None) -> None:
    """Cap the worker's address space: an allocation past it raises ``MemoryError`` in the
    reward (a counted failure) instead of growing until the kernel kills the trainer."""
    if memory_mb is None:
        return
    limit = memory_mb << 20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _init_worker(modules: tuple[str, ...], memory_mb: int | None = None) -> None:
    # pebble installs a Python-level SIGTERM handler, which cannot run while native code holds
    # the GIL; the default action ends the worker at once when the pool stops it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with_parent()
    _limit_memory(memory_mb)
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # reported with the function's name when a task loads it


def _stop(pool: pebble.ProcessPool) -> None:
    pool.stop()
    pool.join()


class RewardWorkers:
    """A pool of worker processes for reward functions; a timed-out task's worker is replaced.

    Args:
        processes: worker processes, i.e. how many functions can run at the same time.
        preload: modules to import before the workers start (the modules that define the
            functions, e.g. from :func:`preload_modules`): imported once in the forkserver if
            this is the first pool of the process, else by each worker.
        memory_mb: address-space cap of each worker (``RLIMIT_AS``); None: no cap.

    The pool starts on the first :meth:`submit` and is stopped by :meth:`close`, when the object
    is garbage-collected, or at interpreter exit. Pickling it (e.g. with the module) drops the
    live pool; the copy starts its own.
    """

    def __init__(
        self,
        processes: int = 1,
        preload: Sequence[str] = (),
        memory_mb: int | None = DEFAULT_WORKER_MEMORY_MB,
    ) -> None:
        if processes < 1:
            raise ValueError(f"RewardWorkers needs processes >= 1; got {processes}.")
        if memory_mb is not None and memory_mb < 64:
            raise ValueError(f"RewardWorkers needs memory_mb >= 64 (or None); got {memory_mb}.")
        self.processes = processes
        self.preload = tuple(preload)
        self.memory_mb = memory_mb
        self._pool: pebble.ProcessPool | None = None
        self._finalizer: weakref.finalize | None = None

    def submit(
        self, fn: Callable[..., Any], task: Callable[..., Any], *args: Any, timeout: float | None
    ) -> Future:
        """Run ``task(fn, *args)`` in a worker; the future raises ``TimeoutError`` when the
        task ran longer than ``timeout`` seconds (its worker is then killed and replaced)."""
        pool = self._pool or self._start()
        return pool.schedule(call_pickled, args=(pickle.dumps(fn), task, *args), timeout=timeout)

    def close(self) -> None:
        """Stop the workers (killing any running task); a later ``submit`` starts new ones."""
        if self._finalizer is not None:
            self._finalizer()
        self._pool, self._finalizer = None, None

    def _start(self) -> pebble.ProcessPool:
        context = multiprocessing.get_context("forkserver")
        # Only read when the forkserver starts; "__main__" keeps multiprocessing's default.
        context.set_forkserver_preload(["__main__", *self.preload])
        self._pool = pebble.ProcessPool(
            self.processes,
            initializer=_init_worker,
            initargs=(self.preload, self.memory_mb),
            context=context,
        )
        self._finalizer = weakref.finalize(self, _stop, self._pool)
        return self._pool

    def __getstate__(self) -> dict[str, Any]:
        return {"processes": self.processes, "preload": self.preload, "memory_mb": self.memory_mb}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def __repr__(self) -> str:
        name, preload = type(self).__name__, list(self.preload)
        return f"{name}(processes={self.processes}, preload={preload}, memory_mb={self.memory_mb})"
