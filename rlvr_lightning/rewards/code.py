"""Sandboxed code-execution rewards: run the completion's Python against the row's tests.

``tests`` column, one entry per row (``None`` or empty: the row scores ``None``, not applicable):

- ``list[str]``: each string is one test case, Python code run after the solution in the same
  namespace; it passes when it raises nothing (typically one ``assert`` statement). In
  ``assert <expr> <op> <literal>`` the value of ``<expr>`` must be plain data (None, bool,
  numbers, str, bytes, and lists, tuples, sets, dicts of them; subclasses count as their base):
  the trainer, not the sandbox, compares it with the literal.
- ``str``: one test case of Python code, or a JSON object as below.
- ``{"inputs": [...], "outputs": [...]}`` (APPS/TACO style): the solution runs as a program once
  per pair with the input on stdin; it passes when its stdout equals the output after stripping
  trailing whitespace from every line and blank lines from both ends.

The code is the last fenced block tagged ``python``, ``py``, ``python3`` or untagged, else the
whole completion; an empty one scores 0.0 without running.

Every row runs in a fresh process tree under one memory cap (``memory_mb`` for all of its
processes together: a cgroup of its own where this process may create one, see
``rewards/cgroup.py``; else RLIMIT_AS per process, i.e. up to ``max_processes * memory_mb``),
at most ``max_workers`` rows at once per reward object, with RLIMIT_CPU, RLIMIT_AS,
RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, RLIMIT_CORE=0 and no_new_privs on every snippet
process, a wall-clock deadline per test case and per row after which everything is SIGKILLed,
a minimal environment and, as root, the host uid ``nobody`` (65534). Each test case runs in a
child forked from the sandbox's runner that gets only the solution and the questions of its
case: the expected values stay in the trainer (see ``rewards/code_judge.py``), and the runner
that relays the answers never runs model code and cannot be ptraced, so writing to descriptors,
exiting early, killing the runner or printing a verdict cannot pass a failing test.

With ``isolation="namespaces"`` (picked by ``"auto"`` where unprivileged user namespaces work)
the snippet sees a new root: read-only binds of ``/usr``, ``/etc`` and the interpreter's tree, a
private size-limited tmpfs as ``/tmp`` (the working directory, also ``/dev/shm``), a minimal
``/dev`` and a ``/proc`` of its own PID namespace; the host's home directories, ``/run``,
``/var`` and everything else are absent. The mounts are locked (each test case runs in a further
user namespace as uid 1000 with no capabilities), so ``umount`` or a read-write remount fails.
No network (an empty network namespace), its own IPC and UTS namespaces.

With ``isolation="rlimits"`` (the fallback) the snippet shares the host's filesystem, network
and PID namespaces. Where the kernel has Landlock (ABI >= 1; the CI machine has 7) it may only
read and execute under the same system paths and read/write its working directory: other
host files cannot be read, listed or written (``/run/lock``, ``/tmp``, ``/dev/shm`` included;
``stat`` still works), and with ABI >= 4 / 6 it cannot open TCP connections, signal processes
outside the sandbox or reach abstract unix sockets. Without Landlock it can do whatever its
user may (documented; ``auto`` warns). Landlock is applied in namespace mode too.

Neither mode makes the snippet's own interpreter trustworthy: a snippet that hooks it can fake
the answers to test statements that are not ``assert <expr> <op> <literal>`` (a bare assert's
truth value, "done" for other statements; see ``code_judge``). Every snippet process also gets a
seccomp filter that refuses ``socket()``, io_uring and SysV / POSIX IPC objects
(``socketpair()`` and pipes stay). Train on untrusted models inside a container or VM as well.
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

from rlvr_lightning.rewards.cgroup import find_parent
from rlvr_lightning.rewards.code_judge import (
    Check,
    explain_program,
    explain_steps,
    judge_steps,
    plan_test,
    same_output,
)
from rlvr_lightning.rewards.sandbox import (
    SYSTEM_PATH,
    Setup,
    landlock_abi,
    process_count,
    run_sandbox,
)
from rlvr_lightning.rewards.trl_contract import Completion, completion_text

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*(python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_NOBODY = 65534
_MAX_OUTPUT = 1 << 20
# Rows scored at once per reward object: this project's choice, so that the default worst case
# is 8 * memory_mb = 4 GiB however many cores the machine has.
DEFAULT_MAX_WORKERS = 8

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
        memory_mb: memory of the whole row (its cgroup's limit, where one can be made) and
            RLIMIT_AS of every sandboxed process.
        file_size_mb: RLIMIT_FSIZE (largest file a snippet may write); in namespace mode also
            the size of the private ``/tmp``, the working directory.
        max_processes: RLIMIT_NPROC, counted inside the namespace; in rlimits mode it is added
            to the sandbox user's current process count on the host.
        max_workers: rows scored at once by this object (across calls and threads), each in
            its own sandbox; default ``min(os.cpu_count(), 8)`` (this project's choice).
        isolation: ``"auto"`` uses namespaces when this host allows them, else rlimits;
            ``"namespaces"`` raises at the first call when it cannot have them.
        hidden_paths: directories under the read-only system paths (e.g. ``/etc/secrets``)
            covered by an empty tmpfs in namespace mode; hiding the interpreter's tree breaks it.
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
        self.max_workers = max_workers or min(os.cpu_count() or 1, DEFAULT_MAX_WORKERS)
        self.hidden_paths = tuple(hidden_paths)
        self.uid = _NOBODY if os.geteuid() == 0 else None  # None: stay who we are
        self._setup: Setup | None = None
        self._lock = threading.Lock()
        self._rows = threading.BoundedSemaphore(self.max_workers)

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
        self, completions: list[Completion], tests: Sequence[object], **_: object
    ) -> list[float | None]:
        cases = [parse_tests(t) for t in tests]
        codes = [extract_code(completion_text(c)) for c in completions]  # strings or TRL's messages
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
        return self._run(self.setup(), code, cases)

    def failures(self, code: str, cases: list[Case]) -> list[str | None]:
        """Per case, None when it passes, else why it fails in words (execution feedback);
        what a case expects (a compared literal, the expected stdout) never appears."""
        plans, results = self._execute(self.setup(), code, cases)
        return [_explain(c, p, r) for c, p, r in zip(cases, plans, results, strict=True)]

    def _execute(
        self, setup: Setup, code: str, cases: list[Case]
    ) -> tuple[list[tuple[list[dict[str, str]], list[Check]] | None], list[dict[str, Any] | None]]:
        """Each case's plan (None: a program) and the sandbox's result (None: not reached)."""
        plans = [plan_test(test) if test is not None else None for test, _, _ in cases]
        job = self._job(code, cases, [p[0] if p else None for p in plans], setup.namespaces)
        with self._rows:
            results = run_sandbox(setup, job, self.uid, self.timeout_s, self.memory_mb << 20)
        return plans, results or [None] * len(cases)

    def _run(self, setup: Setup, code: str, cases: list[Case]) -> list[bool]:
        plans, results = self._execute(setup, code, cases)
        return [
            _judge(want, plan, result)
            for (_, _, want), plan, result in zip(cases, plans, results, strict=True)
        ]

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
        landlock, cgroup = landlock_abi() >= 1, find_parent()
        for python in filter(None, candidates):
            if self._run(Setup(python, False, landlock, cgroup), "x = 1", probe) != [True]:
                continue
            if self.isolation != "rlimits":
                setup = Setup(python, True, landlock, cgroup)
                if self._run(setup, "x = 1", probe) == [True]:
                    return setup
            if self.isolation == "namespaces":
                raise RuntimeError(
                    "CodeTestsReward(isolation='namespaces'): user, mount and PID namespaces "
                    "with a new root fail on this host (unprivileged user namespaces disabled?)."
                    " Enable them (user.max_user_namespaces, kernel.apparmor_restrict_"
                    "unprivileged_userns) or pass isolation='auto' to fall back to rlimits."
                )
            if self.isolation == "auto" or not landlock:
                logger.warning(
                    "CodeTestsReward: no user namespaces here; snippets share the host's "
                    "network and processes%s.",
                    ""
                    if landlock
                    else f" and can read the files of user {self.uid or os.geteuid()}",
                )
            return Setup(python, False, landlock, cgroup)
        raise RuntimeError(
            f"CodeTestsReward: none of the interpreters {candidates} runs in the sandbox as uid "
            f"{self.uid or os.geteuid()}. Pass python= an interpreter that user can execute."
        )

    def _job(
        self,
        code: str,
        cases: list[Case],
        steps: list[list[dict[str, str]] | None],
        namespaces: bool,
    ) -> dict[str, Any]:
        nproc = self.max_processes
        if not namespaces:
            nproc += process_count(os.geteuid() if self.uid is None else self.uid)
        mib = 1 << 20
        return {
            "code": code,
            "cases": [
                {"stdin": stdin, "steps": s} for (_, stdin, _), s in zip(cases, steps, strict=True)
            ],
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


def _judge(
    want: str | None,
    plan: tuple[list[dict[str, str]], list[Check]] | None,
    result: dict[str, Any] | None,
) -> bool:
    """One case's verdict from the sandbox's result (None: the case never finished)."""
    if result is None:
        return False
    if plan is None:  # a program: exit status 0 and the expected stdout
        return result.get("exit") == 0 and same_output(str(result.get("out")), want or "")
    answers = result.get("answers")
    return isinstance(answers, list) and judge_steps(*plan, [str(a) for a in answers])


def _explain(
    case: Case,
    plan: tuple[list[dict[str, str]], list[Check]] | None,
    result: dict[str, Any] | None,
) -> str | None:
    """Why one case fails, in words (None: it passes); the counterpart of ``_judge``."""
    if result is None:
        return "did not finish (it timed out, or the sandbox died)"
    if plan is None:
        return explain_program(case[1], case[2] or "", result)
    return explain_steps(*plan, [str(a) for a in result.get("answers") or []])


@functools.cache
def _default_reward() -> CodeTestsReward:
    return CodeTestsReward()


def code_tests_pass(
    completions: list[Completion], tests: Sequence[object], **_: object
) -> list[float | None]:
    """Fraction of ``tests`` passed, with :class:`CodeTestsReward`'s defaults; None without tests.

    For other settings (all-or-nothing, limits) put ``CodeTestsReward(...)`` in
    ``rewards.functions``.
    """
    return _default_reward()(completions, tests)
