"""Sandboxed code-execution rewards: run the completion's Python against the row's tests.

``tests`` column, one entry per row (``None`` or empty: the row scores ``None``, not applicable):

- ``list[str]``: each string is one test case, Python code run after the solution in the same
  namespace; it passes when it raises nothing (typically one ``assert`` statement).
- ``str``: one test case of Python code, or a JSON object as below.
- ``{"inputs": [...], "outputs": [...]}`` (APPS/TACO style): the solution runs as a program once
  per pair with the input on stdin; it passes when its stdout equals the output after stripping
  trailing whitespace from every line and blank lines from both ends.

The code is the last fenced block tagged ``python``, ``py``, ``python3`` or untagged, else the
whole completion; an empty one scores 0.0 without running.

Every row runs in a fresh process tree (``python -I``, minimal environment, new session, empty
temporary working directory that is ``HOME`` and ``TMPDIR``, removed afterwards) under
RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE and RLIMIT_CORE=0, with a
wall-clock deadline per test case and per row after which its process group is SIGKILLed. Each
test case runs in its own forked grandchild, so ``os.kill(os.getppid(), ...)`` reaches the
sandbox's runner, never the trainer. When the process runs as root, the sandbox runs as
``nobody`` (65534) so that it cannot read or write root's files.

With ``isolation="namespaces"`` (picked by ``"auto"`` when ``unshare --user --map-root-user
--net --pid --fork --mount`` works, as on most Linux hosts with unprivileged user namespaces)
there is also: no network (an empty network namespace, not even loopback), a PID namespace
(snippets cannot see or signal host processes; everything dies with the runner), RLIMIT_NPROC
counted inside the namespace only, and fresh size-limited tmpfs mounts over ``/tmp``,
``/var/tmp``, ``/dev/shm`` and ``hidden_paths``; the working directory is the new ``/tmp``.

With ``isolation="rlimits"`` (the fallback) there is none of that: the network is reachable,
the snippet sees the filesystem and processes with its user's permissions (as a non-root user it
can read, write and signal that user's files and processes), RLIMIT_NPROC counts all of the
sandbox user's processes on the host, and a descendant that calls ``setsid()`` escapes the kill.

Neither mode is a security boundary against code written to attack this harness (it can forge
a pass through the runner's descriptors); run untrusted models in a container or VM as well.
Memory is bounded per process: a snippet may hold ``max_processes * memory_mb``.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import shutil
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

from rlvr_lightning.rewards.sandbox import (
    SYSTEM_PATH,
    Setup,
    process_count,
    run_sandbox,
)

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_NOBODY = 65534
_MAX_OUTPUT = 1 << 20

Case = tuple[str | None, str | None, str | None]  # (test code, stdin, expected stdout)


def extract_code(text: str) -> str:
    """The last fenced block tagged python/py/python3 or untagged, else the whole text.

    >>> extract_code("Try:\\n```python\\nx = 1\\n```\\nthen\\n```py\\nx = 2\\n```")
    'x = 2\\n'
    >>> extract_code("x = 3")
    'x = 3'
    """
    blocks = _FENCE.findall(text)
    return blocks[-1][1] if blocks else text


def parse_tests(tests: object) -> list[Case] | None:
    """Test cases of one row in the documented ``tests`` formats; None when there are none.

    >>> parse_tests(["assert f(1) == 2"])
    [('assert f(1) == 2', None, None)]
    >>> parse_tests({"inputs": ["1\\n"], "outputs": ["2\\n"]})
    [(None, '1\\n', '2\\n')]
    >>> parse_tests(None), parse_tests([])
    (None, None)
    """
    if isinstance(tests, str):
        try:
            decoded = json.loads(tests)
        except ValueError:
            decoded = None
        tests = decoded if isinstance(decoded, dict) else [tests]
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs", []), tests.get("outputs", [])
        if len(inputs) != len(outputs):
            raise ValueError(f"tests has {len(inputs)} inputs but {len(outputs)} outputs.")
        cases: list[Case] = [(None, str(i), str(o)) for i, o in zip(inputs, outputs, strict=True)]
    elif tests is None:
        cases = []
    else:
        cases = [(str(t), None, None) for t in tests]
    return cases or None


class CodeTestsReward:
    """Reward object: fraction (or all-or-nothing) of the row's ``tests`` the completion passes.

    Args:
        mode: ``"fraction"`` (default) scores passed / total cases; ``"all"`` scores 1.0 only when
            every case passes, else 0.0.
        timeout_s: wall-clock seconds for all cases of one row; cases not started in time fail,
            and the row's process group is SIGKILLed a few seconds after it.
        case_timeout_s: wall-clock seconds for one case; RLIMIT_CPU is this rounded up, plus 1.
        memory_mb: RLIMIT_AS of every sandboxed process.
        file_size_mb: RLIMIT_FSIZE (largest file a snippet may write); in namespace mode also
            the size of each tmpfs, the working directory included.
        max_processes: RLIMIT_NPROC, counted inside the namespace; in rlimits mode it is added
            to the sandbox user's current process count on the host.
        max_workers: rows scored at once, each in its own sandbox; default ``os.cpu_count()``.
        isolation: ``"auto"`` uses namespaces when this host allows them, else rlimits;
            ``"namespaces"`` raises at the first call when it cannot have them.
        hidden_paths: directories covered by an empty tmpfs in namespace mode, in addition to
            ``/tmp``, ``/var/tmp`` and ``/dev/shm``; hiding the interpreter's own tree breaks it.
        python: interpreter for the snippets; default this one when the sandbox user can run
            it, else the first ``python3`` on ``/usr/local/bin:/usr/bin:/bin`` (as root the
            sandbox is ``nobody``, who cannot enter e.g. ``/root/.pyenv``).

    >>> reward = CodeTestsReward(timeout_s=5)
    >>> reward(["```python\\ndef f(x):\\n    return x + 1\\n```", "def f(x): return x", "x"],
    ...        tests=[["assert f(1) == 2", "assert f(2) == 3"]] * 2 + [None])
    [1.0, 0.0, None]
    """

    name = "code_tests_pass"

    def __init__(
        self,
        mode: Literal["fraction", "all"] = "fraction",
        timeout_s: float = 10.0,
        case_timeout_s: float = 4.0,
        memory_mb: int = 512,
        file_size_mb: int = 16,
        max_processes: int = 16,
        max_workers: int | None = None,
        isolation: Literal["auto", "namespaces", "rlimits"] = "auto",
        hidden_paths: Sequence[str] = (),
        python: str | None = None,
    ) -> None:
        self._check_args(mode, timeout_s, case_timeout_s, memory_mb, file_size_mb, max_processes)
        if isolation not in ("auto", "namespaces", "rlimits"):
            raise ValueError(f"isolation must be auto, namespaces or rlimits; got {isolation!r}.")
        self.mode, self.isolation, self.python = mode, isolation, python
        self.timeout_s, self.case_timeout_s = float(timeout_s), float(case_timeout_s)
        self.memory_mb, self.file_size_mb, self.max_processes = (
            memory_mb,
            file_size_mb,
            max_processes,
        )
        self.max_workers = max_workers or os.cpu_count() or 1
        self.hidden_paths = ("/tmp", "/var/tmp", "/dev/shm", *hidden_paths)
        self.uid = _NOBODY if os.geteuid() == 0 else None  # None: stay who we are
        self._setup: Setup | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _check_args(mode: str, timeout_s: float, case_timeout_s: float, *sizes: int) -> None:
        if mode not in ("fraction", "all"):
            raise ValueError(f"mode must be 'fraction' or 'all'; got {mode!r}.")
        if not 0 < case_timeout_s <= timeout_s:
            raise ValueError(
                f"need 0 < case_timeout_s <= timeout_s; got case_timeout_s={case_timeout_s}, "
                f"timeout_s={timeout_s}. timeout_s bounds all cases of a row together."
            )
        if min(sizes) < 1:
            raise ValueError(
                f"memory_mb, file_size_mb and max_processes must be >= 1; got {sizes}."
            )

    def __call__(
        self, completions: list[str], tests: Sequence[object], **_: object
    ) -> list[float | None]:
        cases = [parse_tests(t) for t in tests]
        codes = [extract_code(c) for c in completions]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, max(len(codes), 1))) as pool:
            return list(pool.map(self._score_row, codes, cases))

    def _score_row(self, code: str, cases: list[Case] | None) -> float | None:
        if cases is None:
            return None
        if not code.strip():
            return 0.0
        passed = self.run(code, cases)
        if self.mode == "all":
            return float(all(passed))
        return sum(passed) / len(cases)

    def run(self, code: str, cases: list[Case]) -> list[bool]:
        """One pass flag per case; all False when the sandbox dies or misses its deadline."""
        setup = self.setup()
        return run_sandbox(
            setup, self._job(code, cases, setup.namespaces), self.uid, self.timeout_s
        ) or [False] * len(cases)

    def setup(self) -> Setup:
        """Pick the interpreter and the isolation mode on first use (probes run a sandbox)."""
        with self._lock:
            if self._setup is None:
                self._setup = self._probe()
            return self._setup

    def _probe(self) -> Setup:
        probe: list[Case] = [("assert x == 1", None, None)]
        candidates = (
            [self.python]
            if self.python
            else [sys.executable, shutil.which("python3", path=SYSTEM_PATH)]
        )
        for python in filter(None, candidates):
            if run_sandbox(
                Setup(python, False), self._job("x = 1", probe, False), self.uid, 10.0
            ) != [True]:
                continue
            if self.isolation != "rlimits":
                job = self._job("x = 1", probe, True)
                if run_sandbox(Setup(python, True), job, self.uid, 10.0) == [True]:
                    return Setup(python, True)
            if self.isolation == "namespaces":
                raise RuntimeError(
                    "CodeTestsReward(isolation='namespaces'): `unshare --user --net --pid --mount` "
                    "fails on this host (unprivileged user namespaces disabled?). Enable them "
                    "(user.max_user_namespaces, kernel.apparmor_restrict_unprivileged_userns)"
                    " or pass isolation='auto' to fall back to rlimits only."
                )
            logger.warning(
                "CodeTestsReward: no user namespaces here; snippets run with rlimits only and can "
                "reach the network and read the files of user %s.",
                self.uid or os.geteuid(),
            )
            return Setup(python, False)
        raise RuntimeError(
            f"CodeTestsReward: none of the interpreters {candidates} runs in the sandbox as uid "
            f"{self.uid or os.geteuid()}. Pass python= an interpreter that user can execute."
        )

    def _job(self, code: str, cases: list[Case], namespaces: bool) -> dict[str, Any]:
        nproc = self.max_processes
        if not namespaces:
            nproc += process_count(os.geteuid() if self.uid is None else self.uid)
        mib = 1 << 20
        return {
            "code": code,
            "cases": cases,
            "namespaces": namespaces,
            "hidden": self.hidden_paths,
            "disk": self.file_size_mb * mib,
            "timeout": self.timeout_s,
            "case_timeout": self.case_timeout_s,
            "max_output": _MAX_OUTPUT,
            "limits": {
                "RLIMIT_CPU": math.ceil(self.case_timeout_s) + 1,
                "RLIMIT_AS": self.memory_mb * mib,
                "RLIMIT_FSIZE": self.file_size_mb * mib,
                "RLIMIT_NPROC": nproc,
                "RLIMIT_NOFILE": 64,
                "RLIMIT_CORE": 0,
            },
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, timeout_s={self.timeout_s}, "
            f"case_timeout_s={self.case_timeout_s}, isolation={self.isolation!r})"
        )


@functools.cache
def _default_reward() -> CodeTestsReward:
    return CodeTestsReward()


def code_tests_pass(
    completions: list[str], tests: Sequence[object], **_: object
) -> list[float | None]:
    """Fraction of ``tests`` passed, with :class:`CodeTestsReward`'s defaults; None without tests.

    For other settings (all-or-nothing, limits) put ``CodeTestsReward(...)`` in ``reward_fns``.
    """
    return _default_reward()(completions, tests)
