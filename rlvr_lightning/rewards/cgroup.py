"""One memory cgroup per sandboxed row of the code reward: a single cap for all its processes.

A row's processes (the runner, every test case's child and whatever those fork) live in one
fresh cgroup with a memory limit, so ``max_processes`` children cannot each take ``memory_mb``:
together they get ``memory_mb``, and the kernel's OOM killer ends the row when it asks for
more. Both cgroup versions are used: v2 where this process's cgroup delegates the ``memory``
controller to its children, else the v1 ``memory`` hierarchy. Creating one needs write access
to this process's own cgroup (root, or a delegated subtree); without it the caller falls back
to per-process rlimits.
"""

from __future__ import annotations

import errno
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CgroupParent:
    """Where this process may create row cgroups, and which version's files they have."""

    path: Path
    version: int  # 1 or 2


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """(root within the hierarchy, mount point, fs type, super options) of each mount."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) >= 5 and len(rest) >= 3:
            found.append((fields[3], fields[4], rest[0], rest[2].split(",")))
    return found


def _candidates() -> list[CgroupParent]:
    """This process's cgroup in the v2 hierarchy and in the v1 ``memory`` one, where mounted."""
    own = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        own["v2" if hid == "0" and controllers == "" else controllers] = path
    found = []
    for root, point, fstype, options in _mounts():
        path = own.get("v2") if fstype == "cgroup2" else None
        if fstype == "cgroup" and "memory" in options:
            path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
        if path is not None and (path + "/").startswith(root.rstrip("/") + "/"):
            relative = path[len(root.rstrip("/")) :].lstrip("/")
            found.append(CgroupParent(Path(point) / relative, 2 if fstype == "cgroup2" else 1))
    return found


def find_parent() -> CgroupParent | None:
    """The first hierarchy where a child cgroup with a memory limit can be made, else None."""
    for parent in _candidates():
        try:
            probe = RowCgroup(parent, 64 << 20)
        except OSError:
            continue
        probe.remove()
        _remove_stale(parent)
        return parent
    return None


def _remove_stale(parent: CgroupParent) -> None:
    """Delete the empty row cgroups left by trainers that died mid-row (named by their pid)."""
    for folder in parent.path.glob("rlvr-code-*-*"):
        try:
            os.kill(int(folder.name.split("-")[2]), 0)
        except ProcessLookupError:
            try:
                folder.rmdir()
            except OSError:  # still has processes: their deadline will end them
                pass
        except (ValueError, OSError):
            pass


class RowCgroup:
    """A fresh child cgroup of ``parent`` limited to ``limit_bytes`` of memory (swap included)."""

    def __init__(self, parent: CgroupParent, limit_bytes: int) -> None:
        self.path = parent.path / f"rlvr-code-{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        try:
            if parent.version == 2:
                self._write("memory.max", limit_bytes)
                self._write("memory.swap.max", 0, optional=True)
                self._write("memory.oom.group", 1, optional=True)  # OOM ends the whole row
            else:
                self._write("memory.limit_in_bytes", limit_bytes)
                self._write("memory.memsw.limit_in_bytes", limit_bytes, optional=True)
        except OSError:
            self.path.rmdir()
            raise

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            (self.path / name).write_text(str(value))
        except OSError:
            if not optional:
                raise

    def add(self, pid: int) -> None:
        """Move ``pid`` in; the processes it starts afterwards are born inside."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self, patience_s: float = 2.0) -> None:
        """SIGKILL whatever is left inside (a setsid() escapee too), then delete the cgroup."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            except OSError:
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                self.path.rmdir()
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    return
            time.sleep(0.005)
