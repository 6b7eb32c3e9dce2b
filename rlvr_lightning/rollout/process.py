"""A rollout engine in its own process: the asynchronous worker of ``rollout_mode: async``.

``ProcessEngine`` starts a child process (``spawn``) that builds the real engine (vLLM) and
serves requests over a pipe, one at a time and in order. ``submit`` sends a generation and
returns at once, so the trainer's update runs while the child decodes (its own process, its
own threads, a GIL of its own); ``collect`` waits for the rows. ``generate`` is both.

Weights travel through shared memory: the first ``load_weights`` copies the policy's tensors,
cast to the engine's dtype, into buffers shared with the child (torch's shared-memory
reductions: no pickled weights); later loads copy into the same buffers and only send a
message. The child copies them into its model (the engine's own ``load_weights``).

The per-request sampling seeds are drawn here, from this process's torch RNG, when the request
is submitted (``rollout.base.request_seeds``): the run's RNG stream is the same as with the
engine in-process, whatever the trainer draws while the child decodes.

The child ends when the pipe closes (this process exiting, even killed) or on ``close``; a
child that dies or raises surfaces here as a ``RuntimeError`` with its message.
"""

from __future__ import annotations

import faulthandler
import signal
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.multiprocessing as mp

from rlvr_lightning.rollout.base import request_seeds
from rlvr_lightning.types import Rollouts, Sampling

START_TIMEOUT_S = 600.0
"""How long the child may take to import and build its engine (this project's choice)."""


def _serve(conn: Any, build: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """The child: build the engine, then answer requests until the pipe closes. ``kill -USR1``
    on it prints its threads' stacks (a hung worker)."""
    faulthandler.register(signal.SIGUSR1)
    torch.set_grad_enabled(False)
    try:
        engine = build(*args, **kwargs)
        conn.send(("ok", {"eos_ids": engine.eos_ids, "dtype": engine.weights_dtype}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    buffers: list[tuple[str, torch.Tensor]] = []
    while True:
        try:
            name, payload = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if name == "close":
            return
        start = time.perf_counter()
        try:
            if name == "buffers":
                buffers, result = payload[0][0], None
            elif name == "load":
                result = engine.load_weights(buffers)
            else:
                result = getattr(engine, name)(*payload[0], **payload[1])
            conn.send(("ok", (result, time.perf_counter() - start)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ProcessEngine:
    """``build(*args, **kwargs)`` (an engine with its own weights) run in a child process.

    Args:
        build: a picklable callable returning the engine (e.g. ``VLLMEngine``).
        args, kwargs: its arguments (the tokenizer included: it is pickled to the child).
        tokenizer: this process's tokenizer (the engine protocol's ``tokenizer``).
    """

    def __init__(
        self, build: Callable[..., Any], args: tuple, kwargs: dict, tokenizer: Any
    ) -> None:
        self.tokenizer = tokenizer
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(
            target=_serve, args=(child, build, args, kwargs), name="rlvr-rollout-worker"
        )
        self._process.start()
        child.close()
        self._pending: list[int] = []  # tickets sent, answers not yet read, in order
        self._answers: dict[int, tuple[Any, float]] = {}
        self._next_ticket = 0
        self._buffers: list[tuple[str, torch.Tensor]] | None = None
        self.busy_s = 0.0  # the child's seconds of work since the last ``take_busy``
        # Stopped when this engine is collected or at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop, self._conn, self._process)
        info = self._receive(START_TIMEOUT_S)
        self.eos_ids, self.weights_dtype = info["eos_ids"], info["dtype"]

    @property
    def shares_policy(self) -> bool:
        return False

    # ---- the pipe ---------------------------------------------------------------------------

    def _receive(self, timeout_s: float | None = None) -> Any:
        """The next answer; the child's error, or its death, as a ``RuntimeError``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(1.0):
            if not self._process.is_alive():
                raise self._died()
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"The rollout worker did not start within {timeout_s:.0f} s.")
        status, value = self._conn.recv()
        if status == "error":
            last = value.strip().splitlines()[-1]  # the exception itself, first
            raise RuntimeError(f"The rollout worker process raised {last}\nIn the worker:\n{value}")
        return value

    def _died(self) -> RuntimeError:
        self._process.join(1)
        return RuntimeError(
            f"The rollout worker process died (exit code {self._process.exitcode}); its log "
            "is above. Rerun with engine_kwargs.process: false to see the engine's error in "
            "this process."
        )

    def _send(self, name: str, payload: Any) -> int:
        try:
            self._conn.send((name, payload))
        except (BrokenPipeError, ConnectionResetError) as err:
            raise self._died() from err
        self._next_ticket += 1
        self._pending.append(self._next_ticket)
        return self._next_ticket

    def collect(self, ticket: int) -> Any:
        """The answer to ``ticket``, reading (and keeping) the earlier answers first."""
        while ticket not in self._answers:
            oldest = self._pending.pop(0)  # popped first: an error answers it too
            self._answers[oldest] = self._receive()
        result, busy = self._answers.pop(ticket)
        self.busy_s += busy
        return result

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self.collect(self._send(name, (args, kwargs)))

    def take_busy(self) -> float:
        """The child's seconds of work since the last call (the worker's busy time)."""
        busy, self.busy_s = self.busy_s, 0.0
        return busy

    # ---- the engine protocol ----------------------------------------------------------------

    def submit(self, prompt_ids: torch.Tensor, *rest: Any, **kwargs: Any) -> int:
        """Send a generation (``generate``'s arguments; seeds drawn now, here);
        ``collect(ticket)`` gives its rows."""
        sampling: Sampling = rest[1] if len(rest) > 1 else kwargs["sampling"]
        seeds = request_seeds(prompt_ids.shape[0] * sampling.group_size)
        return self._send("generate", ((prompt_ids, *rest), {**kwargs, "seeds": seeds}))

    def generate(self, *args: Any, **kwargs: Any) -> Rollouts:
        return self.collect(self.submit(*args, **kwargs))

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the weights into the shared buffers (made on the first call), then reload."""
        named = list(named_tensors)
        names = [n for n, _ in named]
        if self._buffers is None or [n for n, _ in self._buffers] != names:
            self._buffers = [
                (n, torch.empty(t.shape, dtype=self.weights_dtype).share_memory_())
                for n, t in named
            ]
            self._call("buffers", self._buffers)
        with torch.no_grad():
            for (_, buffer), (_, tensor) in zip(self._buffers, named, strict=True):
                buffer.copy_(tensor)
        self._call("load")

    def read_weights(self, fn: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> Any:
        """``fn`` (picklable) of the weights the engine holds, run in the child."""
        return self._call("read_weights", fn)

    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        return self._call("score", prompt_ids, completion_ids)

    def sleep(self) -> None:
        self._call("sleep")

    def wake_up(self) -> None:
        self._call("wake_up")

    def close(self) -> None:
        """Stop the child (asked, then killed after 10 s)."""
        self._finalizer()


def _stop(conn: Any, process: Any) -> None:
    if not process.is_alive():
        return
    try:
        conn.send(("close", None))
    except (BrokenPipeError, OSError):
        pass
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
