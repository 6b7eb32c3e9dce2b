"""Process side of ``rewards/code.py``: start one row's sandbox, read its answers, kill it.

The limits and isolation modes are described in ``code.py``'s docstring; this module holds the
command that starts the runner (``_code_runner.py``, which runs ``_code_child.py`` in a forked
child per test case), the per-row working directory and memory cgroup, and the teardown that
kills every process the row left behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr_lightning.rewards.cgroup import CgroupParent, RowCgroup

GRACE_S = 3.0  # interpreter and namespace start-up on top of the row's deadline
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
# Read-only in the sandbox (this project's choice: what an interpreter and its libraries need);
# the interpreter's own prefix is added by the runner. Everything else of the host is absent
# in namespace mode and refused by Landlock in rlimits mode.
SYSTEM_BINDS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")

# Run inside the sandbox (the runner as `python -I -c`, the harness by the runner's exec);
# read once here, so the sandbox user never needs access to the installed package.
RUNNER = (Path(__file__).parent / "_code_runner.py").read_text()
CHILD = (Path(__file__).parent / "_code_child.py").read_text()


@dataclass(frozen=True)
class Setup:
    """How this host runs sandboxes, decided once per reward object."""

    python: str
    namespaces: bool
    landlock: bool = False
    cgroup: CgroupParent | None = None


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where it has none (or refuses it to us)."""
    libc = ctypes.CDLL(None, use_errno=True)
    version = libc.syscall(ctypes.c_long(444), None, ctypes.c_long(0), ctypes.c_long(1))
    return max(0, int(version))


def process_count(uid: int) -> int:
    """Processes on this host whose real uid is ``uid`` (racy; only sizes RLIMIT_NPROC)."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as status:
                count += any(
                    line.split()[1:2] == [str(uid)] for line in status if line[:4] == "Uid:"
                )
        except (OSError, IndexError):
            continue
    return count


def session_members(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``, read from ``/proc``."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and fields[0] != "Z" and fields[3] == str(sid):
            members.append(int(entry))
    return members


def kill_session(sid: int, patience_s: float = 2.0) -> None:
    """SIGKILL every process of the sandbox's session and wait until each has exited.

    Killing the runner's process group is not enough: each test case runs in a group of its
    own, and a snippet that kills the runner is orphaned, so it would outlive the row.
    """
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        handles = []
        for pid in session_members(sid):
            try:
                handle = os.pidfd_open(pid)
            except OSError:  # exited meanwhile
                continue
            try:
                signal.pidfd_send_signal(handle, signal.SIGKILL)
            except OSError:
                os.close(handle)
                continue
            handles.append(handle)
        if not handles:
            return
        for handle in handles:  # a pidfd turns readable when its process has exited
            select.select([handle], [], [], max(0.0, deadline - time.monotonic()))
            os.close(handle)


def run_sandbox(
    setup: Setup, job: dict[str, Any], uid: int | None, timeout_s: float, memory_bytes: int
) -> list[dict[str, Any] | None] | None:
    """Run ``job`` in a fresh sandbox; one result per case (None: not reached), or None if the
    runner gave none (it died, e.g. killed by the row's memory cap, or missed its deadline)."""
    workdir = tempfile.mkdtemp(prefix="rlvr-code-")
    env = {"PATH": SYSTEM_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    if setup.namespaces:
        env.update(HOME="/tmp", TMPDIR="/tmp")
    ids: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    full_job = {
        **job, "child": CHILD, "binds": list(SYSTEM_BINDS),
        "namespaces": setup.namespaces, "landlock": setup.landlock,
    }  # fmt: skip
    cgroup = None
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        if setup.cgroup is not None:
            cgroup = RowCgroup(setup.cgroup, memory_bytes)
        out, returncode = _communicate(setup, full_job, env, ids, timeout_s, workdir, cgroup)
        results = json.loads(out) if returncode == 0 and out else None
    except (OSError, ValueError):
        return None
    finally:
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)
    if not isinstance(results, list) or len(results) != len(job["cases"]):
        return None
    return [r if isinstance(r, dict) else None for r in results]


def _communicate(
    setup: Setup,
    job: dict[str, Any],
    env: dict[str, str],
    ids: dict[str, Any],
    timeout_s: float,
    workdir: str,
    cgroup: RowCgroup | None,
) -> tuple[bytes, int | None]:
    proc = subprocess.Popen(
        [setup.python, "-I", "-c", RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, cwd=workdir, env=env, start_new_session=True, **ids,
    )  # fmt: skip
    try:
        # The runner reads the whole job before it forks anything, so it is inside the
        # cgroup before any of its descendants exist.
        if cgroup is not None:
            cgroup.add(proc.pid)
        out, _ = proc.communicate(json.dumps(job).encode(), timeout=timeout_s + GRACE_S)
    except subprocess.TimeoutExpired:
        out = b""
    finally:
        kill_session(proc.pid)  # start_new_session: the session id is the pid
        proc.wait()
    return out, proc.returncode
