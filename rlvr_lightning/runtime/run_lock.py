"""One run per checkpoint directory.

Two runs writing into one directory resume each other's files and delete each other's
checkpoints when they keep the last K. ``RunLock.acquire`` takes an exclusive ``flock`` on
``<dir>/.rlvr-run.lock`` for the run's lifetime and writes the holder's pid, host and start time
into it. The kernel drops the ``flock`` when the holder dies (SIGKILL and OOM kills included),
so a lock file nobody holds is stale: it is taken over with a warning naming the run that left
it. A lock file on this host whose pid is still the same live process is never taken over,
even where the filesystem does not share ``flock`` between clients.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOCK_NAME = ".rlvr-run.lock"


class RunLockError(RuntimeError):
    """Another live run holds the directory; the message names it and the fix."""


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), which
    tells a live holder from a new process that got its pid; None where it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def holder_alive(holder: dict[str, Any]) -> bool:
    """Whether the lock file's holder is a live process on this host (False elsewhere: that
    is the ``flock``'s to tell)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    start = process_start(holder["pid"])
    return start is not None and holder.get("start_ticks") in (None, start)


def describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    since = f", started {started}" if started else ""
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}{since}"


def _read(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _in_use(path: Path, holder: dict[str, Any]) -> RunLockError:
    return RunLockError(
        f"Checkpoint directory {path.parent} is in use by another run ({describe(holder)}); "
        "two runs in one directory resume and delete each other's checkpoints.\n"
        "Fix: give this run its own directory (another trainer.default_root_dir, or the "
        "ModelCheckpoint's dirpath), or wait until that run has ended and resume it with "
        f"--ckpt_path last. If no such run exists any more, delete {path}."
    )


@dataclass
class RunLock:
    """A held lock on a directory; ``release`` removes the file and drops the ``flock``."""

    path: Path
    fd: int

    @classmethod
    def acquire(cls, directory: Path) -> RunLock:
        """Lock ``directory`` for this process or raise ``RunLockError`` naming the holder."""
        path = directory / LOCK_NAME
        for _ in range(3):  # retried when the file was replaced between open and flock
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise _in_use(path, holder) from None
            if not _same_file(fd, path):  # the holder released (unlinked) it meanwhile
                os.close(fd)
                continue
            holder = _read(fd)
            if holder_alive(holder) and (holder.get("pid"), holder.get("host")) != _me():
                os.close(fd)
                raise _in_use(path, holder)
            if holder and (holder.get("pid"), holder.get("host")) != _me():
                log.warning(
                    "Took over the lock of %s in %s: that run ended without releasing it "
                    "(killed?). Its checkpoints stay; resume with --ckpt_path last.",
                    describe(holder),
                    directory,
                )
            _write_holder(fd)
            return cls(path, fd)
        raise RunLockError(f"Could not lock {path}: it was replaced three times in a row.")

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and drop the ``flock``; idempotent."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):
            if _same_file(self.fd, self.path):
                self.path.unlink()
        os.close(self.fd)
        self.fd = -1


def _me() -> tuple[int, str]:
    return os.getpid(), socket.gethostname()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _write_holder(fd: int) -> None:
    pid = os.getpid()
    holder = {
        "pid": pid,
        "host": socket.gethostname(),
        "start_ticks": process_start(pid),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    os.fsync(fd)
