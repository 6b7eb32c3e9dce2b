"""What a data-parallel rank is doing, read from outside its main thread.

``waiting_on`` reads the main thread's Python stack (``sys._current_frames``) and names the
``torch.distributed`` collective it is blocked in (or DDP's backward, where the gradient
all-reduce waits). ``Heartbeats`` lets ranks report their step and activity to each other
through the job's c10d key-value store (a client of its own on ``MASTER_ADDR:MASTER_PORT``,
with a short timeout, so a rank whose store host does not answer is noticed rather than
waited for). A frozen rank stops reporting, and the ranks waiting for it can name it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import sysconfig
import time
from datetime import timedelta
from types import FrameType
from typing import Any

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "all_gather_into_tensor",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
    }
)
KEY_PREFIX = "rlvr_heartbeat/"
_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename.replace(os.sep, "/")
    short = path[path.rindex("/rlvr_lightning/") + 1 :] if "/rlvr_lightning/" in path else path
    return (
        f"{code.co_name} ({short.rsplit('/', 1)[-1] if short == path else short}:{frame.f_lineno})"
    )


def _is_library(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    if "/rlvr_lightning/" in name.replace(os.sep, "/"):
        return False
    return name.startswith(_LIBRARY_DIRS) or name.startswith("<")


def _stack(frame: FrameType | None) -> list[FrameType]:
    """``frame`` and its callers, innermost first."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def waiting_on(frame: FrameType | None) -> tuple[str, FrameType] | None:
    """The collective the stack ending in ``frame`` is blocked in, and its outermost
    ``torch.distributed`` frame (which stays the same while the call lasts); None if none."""
    found = None
    for f in _stack(frame):
        path = f.f_code.co_filename.replace(os.sep, "/")
        if "/torch/distributed/" in path and f.f_code.co_name in COLLECTIVES:
            found = (f.f_code.co_name, f)  # keep going: the outermost one names the call
        elif "/torch/autograd/" in path and f.f_code.co_name == "_engine_run_backward":
            found = found or ("backward (DDP's gradient all-reduce)", f)
        elif found is not None:
            return found
    return found


def activity(frame: FrameType | None, depth: int = 3) -> str:
    """What the stack ending in ``frame`` does: its innermost ``depth`` frames outside the
    libraries, innermost first (``reward (my_rewards.py:7) < score (rlvr_lightning/...)``)."""
    own = [f for f in _stack(frame) if not _is_library(f)]
    if not own:
        return "outside this project's code"
    return " < ".join(_where(f) for f in own[:depth])


def main_frame() -> FrameType | None:
    """The main thread's current frame."""
    import threading

    return sys._current_frames().get(threading.main_thread().ident or 0)


class Heartbeats:
    """Each rank's last report (time, step, activity) in the job's c10d store."""

    def __init__(self, rank: int, world_size: int, timeout_s: float = 5.0) -> None:
        from torch.distributed import TCPStore

        self.rank, self.world_size = rank, world_size
        self.address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        self.store = TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def report(self, step: int, doing: str) -> None:
        beat = {"time": time.time(), "step": step, "doing": doing, "host": socket.gethostname()}
        self.store.set(f"{KEY_PREFIX}{self.rank}", json.dumps(beat))

    def read(self) -> dict[int, dict[str, Any] | None]:
        """Every other rank's last report (None: it has not reported)."""
        out: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"{KEY_PREFIX}{rank}"
            out[rank] = json.loads(self.store.get(key)) if self.store.check([key]) else None
        return out


def describe_peers(
    beats: dict[int, dict[str, Any] | None], stale_s: float, now: float
) -> tuple[str, list[int]]:
    """One line per other rank and the ranks that have not reported for ``stale_s``."""
    lines, silent = [], []
    for rank, beat in sorted(beats.items()):
        if beat is None:
            lines.append(f"rank {rank} has not reported since the run started")
            silent.append(rank)
            continue
        age = now - beat["time"]
        where = f"step {beat['step']}, in {beat['doing']} on host {beat['host']}"
        if age > stale_s:
            lines.append(f"rank {rank} has not answered for {age:.0f} s (last: {where})")
            silent.append(rank)
        else:
            lines.append(f"rank {rank} is alive ({where})")
    return "; ".join(lines), silent
