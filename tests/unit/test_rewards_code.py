"""Sandboxed code reward (rewards/code.py): scoring, test formats and hostile snippets.

Every hostile snippet must score 0.0 and leave this process and the host as they were. Tests that
need what only namespaces enforce (no network, hidden /tmp, PID namespace) are skipped where the
host cannot create them; the rlimits fallback is exercised for what it does enforce.
"""

from __future__ import annotations

import doctest
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from rlvr_lightning.rewards import code as code_rewards
from rlvr_lightning.rewards.code import CodeTestsReward, code_tests_pass, extract_code, parse_tests

FAST = {"timeout_s": 2.0, "case_timeout_s": 1.5}
ADD_ONE = ["assert f(1) == 2", "assert f(2) == 3"]


@pytest.fixture(scope="module")
def sandbox() -> CodeTestsReward:
    reward = CodeTestsReward(**FAST)
    reward.setup()
    return reward


@pytest.fixture(scope="module", params=["auto", "rlimits"])
def any_sandbox(request: pytest.FixtureRequest) -> CodeTestsReward:
    reward = CodeTestsReward(isolation=request.param, **FAST)
    reward.setup()
    return reward


@pytest.fixture(scope="module")
def ns_sandbox(sandbox: CodeTestsReward) -> CodeTestsReward:
    if not sandbox.setup().namespaces:
        pytest.skip("unprivileged user namespaces are unavailable on this host")
    return sandbox


def _score(reward: CodeTestsReward, code: str, tests: object = ("assert True",)) -> float | None:
    return reward([code], tests=[list(tests) if isinstance(tests, tuple) else tests])[0]


def _live_sandbox_processes() -> list[int]:
    """Non-zombie processes of the sandbox user ``nobody``; only meaningful when we are root."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields["Uid"].split()[0] == "65534" and not fields["State"].strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def test_doctests() -> None:
    result = doctest.testmod(code_rewards)
    assert result.attempted > 0 and result.failed == 0


def test_failures_agree_with_the_verdict_and_hide_what_is_expected(sandbox) -> None:
    cases = [("assert f(1) == 2", None, None), ("assert f(2) == 99", None, None)]
    cases.append(("assert g(1)", None, None))
    failures = sandbox.failures("def f(x):\n    return x + 1", cases)
    assert [why is None for why in failures] == sandbox.run("def f(x): return x + 1", cases)
    assert failures == [
        None,
        "`f(2)` returned 3, which is not the expected value",
        "`g(1)` raised NameError",
    ]
    program = [(None, "3\n", "6"), (None, "3\n", "4")]
    assert sandbox.failures("print(int(input()) * 2)", program) == [
        None,
        "on input '3\\n' the program printed '6\\n', which is not the expected output",
    ]
    hang = sandbox.failures("while True: pass", cases[:1])
    assert hang == ["`f(1)` gave no answer (the code crashed, exited or ran out of time)"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2\n"),
        ("```py\nc = 3\n```", "c = 3\n"),
        ("```\nd = 4\n```", "d = 4\n"),
        ("```bash\nls\n```", "```bash\nls\n```"),  # other languages: fall back to the whole text
        ("e = 5", "e = 5"),
        ("```python\nunclosed", "```python\nunclosed"),
    ],
)
def test_extract_code(text: str, expected: str) -> None:
    assert extract_code(text) == expected


def test_parse_tests_formats() -> None:
    assert parse_tests("assert g()") == [("assert g()", None, None)]
    assert parse_tests('{"inputs": ["1"], "outputs": ["2"]}') == [(None, "1", "2")]
    assert parse_tests({"inputs": [], "outputs": []}) is None
    with pytest.raises(ValueError, match="inputs"):
        parse_tests({"inputs": ["1"], "outputs": []})


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="mode"):
        CodeTestsReward(mode="most")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="case_timeout_s"):
        CodeTestsReward(timeout_s=1.0, case_timeout_s=2.0)
    with pytest.raises(ValueError, match="isolation"):
        CodeTestsReward(isolation="docker")  # type: ignore[arg-type]


def test_normal_cases(any_sandbox: CodeTestsReward) -> None:
    completions = [
        "Here:\n```python\ndef f(x):\n    return x + 1\n```",
        "def f(x):\n    return x",
        "def f(x:\n    return x",
        "   ",
        "def f(x):\n    return 2 if x == 1 else 0",
        "def f(x): return x + 1",
    ]
    tests = [ADD_ONE] * 5 + [None]
    # correct, wrong, syntax error, empty (0.0, never run), half right, no tests (None)
    assert any_sandbox(completions, tests=tests) == [1.0, 0.0, 0.0, 0.0, 0.5, None]


def test_all_mode_and_default_function() -> None:
    half = "def f(x):\n    return 2 if x == 1 else 0"
    assert CodeTestsReward(mode="all", **FAST)([half], tests=[ADD_ONE]) == [0.0]
    assert code_tests_pass(["def f(x): return x + 1"], tests=[ADD_ONE]) == [1.0]


def test_stdin_stdout_cases(any_sandbox: CodeTestsReward) -> None:
    io = {"inputs": ["2\n", "5\n", "7"], "outputs": ["4\n", "10", "14  \n\n"]}
    double = "import sys\nprint(int(input()) * 2)\nsys.exit(0)"
    assert _score(any_sandbox, double, io) == 1.0
    assert _score(any_sandbox, "print(int(input()) + 2)", io) == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    "code",
    ["import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise KeyboardInterrupt"],
    ids=["os._exit", "sys.exit", "keyboard_interrupt"],
)
def test_exiting_early_does_not_pass(any_sandbox: CodeTestsReward, code: str) -> None:
    assert _score(any_sandbox, code, ("assert False",)) == 0.0


# Each would go on to define a correct f if its limit did not stop it first.
LIMITED = {
    "infinite_loop": "while True:\n    pass",
    "huge_allocation": "x = bytearray(8 * 2**30)",
    "huge_list": "x = [0] * 10**10",
    "huge_file": "f = open('big', 'wb')\nfor _ in range(1024):\n    f.write(bytes(1 << 20))",
}
# These attack the harness and the host instead; none defines f.
ESCAPES = {
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        0"
    ),
    # orphaned by its own kill, it lives on in its own process group: the whole session must go
    "kill_parent": "import os, signal, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(5)",
    "kill_group": "import os, signal\nos.killpg(0, signal.SIGKILL)",
    "setsid_escape": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)",
}
HOSTILE = {name: code + "\ndef f(x):\n    return x + 1" for name, code in LIMITED.items()}
HOSTILE.update(ESCAPES)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_snippet_scores_zero(any_sandbox: CodeTestsReward, name: str) -> None:
    start = time.monotonic()
    assert _score(any_sandbox, HOSTILE[name], tuple(ADD_ONE)) == 0.0
    assert time.monotonic() - start < FAST["timeout_s"] + 3.0
    if os.geteuid() == 0:  # the sandbox ran as nobody: nothing of it may survive
        assert _live_sandbox_processes() == []
    assert subprocess.run(["true"]).returncode == 0  # this process can still fork
    assert _score(any_sandbox, "def f(x): return x + 1", tuple(ADD_ONE)) == 1.0


def test_working_directory_is_fresh_and_the_environment_minimal(
    any_sandbox: CodeTestsReward,
) -> None:
    check = (
        "import os\n"
        "assert os.listdir('.') == []\n"
        "assert os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd()\n"
        "assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'LC_CTYPE'}\n"
        "open('scratch', 'w').write('x')\n"
    )
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).glob("rlvr-code-*"))
    assert _score(any_sandbox, check) == 1.0
    assert set(Path(os.environ.get("TMPDIR", "/tmp")).glob("rlvr-code-*")) == before  # removed


def test_secret_outside_the_sandbox_is_unreadable(
    any_sandbox: CodeTestsReward, tmp_path: Path
) -> None:
    setup = any_sandbox.setup()
    if not (setup.namespaces or setup.landlock) and os.geteuid() != 0:
        pytest.skip("rlimits without Landlock, same user: the user's files are readable")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    if any_sandbox.setup().namespaces:  # world-readable: only the tmpfs over /tmp can hide it
        secret.chmod(0o644)
        for parent in [tmp_path, *tmp_path.parents]:
            if str(parent).startswith("/tmp/"):
                parent.chmod(parent.stat().st_mode | 0o755)
    # without namespaces, running as nobody is what stops it (tmp_path is 0700, owned by root)
    assert _score(any_sandbox, f"assert open({str(secret)!r}).read() == 's3cret'") == 0.0
    assert _score(any_sandbox, "import os\nassert os.path.exists('/etc/hostname')") == 1.0


def test_no_network_in_the_namespace(ns_sandbox: CodeTestsReward) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(0.2)
        snippet = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        assert _score(ns_sandbox, snippet) == 0.0
        with pytest.raises(TimeoutError):
            server.accept()


def test_pid_namespace_contains_kill_all(ns_sandbox: CodeTestsReward) -> None:
    # Guard: kill(-1) outside a PID namespace would hit every process nobody may signal.
    assert _score(ns_sandbox, "import os\nassert os.getppid() == 1") == 1.0
    assert _score(ns_sandbox, "import os, signal\nos.kill(-1, signal.SIGKILL)") == 0.0
    assert subprocess.run(["true"]).returncode == 0
