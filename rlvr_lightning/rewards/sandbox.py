"""Process side of ``rewards/code.py``: start one row's sandbox, read its result, kill it.

The limits and isolation modes are described in ``code.py``'s docstring; this module holds the
command that starts the runner (``_code_runner.py``), the per-row working directory, and the
teardown that kills every process the row left behind.
"""

from __future__ import annotations

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

GRACE_S = 3.0  # interpreter and namespace start-up on top of the row's deadline
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
NAMESPACE_ARGS = (
    "--user",
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount",
    "--mount-proc",
)

# Runs inside the sandbox as `python -I -c` (see `_code_runner.py`); read once here, so the
# sandbox user never needs access to the installed package.
RUNNER = (Path(__file__).parent / "_code_runner.py").read_text()


@dataclass(frozen=True)
class Setup:
    """How this host runs sandboxes, decided once per reward object."""

    python: str
    namespaces: bool


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


def command(setup: Setup) -> list[str]:
    runner = [setup.python, "-I", "-c", RUNNER]
    return ["unshare", *NAMESPACE_ARGS, "--", *runner] if setup.namespaces else runner


def run_sandbox(
    setup: Setup, job: dict[str, Any], uid: int | None, timeout_s: float
) -> list[bool] | None:
    """Run ``job`` in a fresh sandbox; the runner's pass flags, or None if it gave none."""
    workdir = tempfile.mkdtemp(prefix="rlvr-code-")
    env = {"PATH": SYSTEM_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    if setup.namespaces:
        env.update(HOME="/tmp", TMPDIR="/tmp")
    ids: dict[str, Any] = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)
        proc = subprocess.Popen(
            command(setup), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=workdir, env=env, start_new_session=True, **ids,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(json.dumps(job).encode(), timeout=timeout_s + GRACE_S)
        except subprocess.TimeoutExpired:
            out = b""
        finally:
            kill_session(proc.pid)  # start_new_session: the session id is the pid
            proc.wait()
        flags = json.loads(out) if proc.returncode == 0 and out else None
    except (OSError, ValueError):
        return None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    valid = isinstance(flags, list) and len(flags) == len(job["cases"])
    return [bool(f) for f in flags] if valid else None
