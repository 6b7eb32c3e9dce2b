"""Hostile snippets against the code-reward sandbox, in every isolation mode this host has.

Each attack is written the way a policy could learn it: take the mounts apart, read or write
host files, forge the verdict on an inherited descriptor or by exiting early, or hold memory
across many children. Every test passes only when the attack is contained; the snippets that
must score 1.0 do so only when each of their attempts failed inside the sandbox.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlvr_lightning.rewards import code as code_rewards
from rlvr_lightning.rewards.code import CodeTestsReward

FAST = {"timeout_s": 3.0, "case_timeout_s": 2.5}
ADD_ONE = ["assert f(1) == 2", "assert f(2) == 3"]
CORRECT = "def f(x):\n    return x + 1\n"


@pytest.fixture(scope="module", params=["namespaces", "rlimits"])
def mode(request: pytest.FixtureRequest) -> CodeTestsReward:
    """A reward per isolation mode; namespaces is skipped only where the host has none."""
    reward = CodeTestsReward(isolation=request.param, **FAST)
    try:
        reward.setup()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return reward


def _score(reward: CodeTestsReward, code: str, tests: list[str] | None = None) -> float | None:
    return reward([code], tests=[tests or ["assert True"]])[0]


@pytest.fixture(scope="module")
def host_secret() -> Iterator[Path]:
    """A world-readable file in a 0755 directory outside the work dir (under /home or /root)."""
    base = Path("/home") if os.access("/home", os.W_OK) else Path.home()
    folder = base / f"rlvr-sandbox-test-{secrets.token_hex(4)}"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    secret = folder / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    yield secret
    secret.unlink()
    folder.rmdir()


@pytest.fixture()
def host_process_token() -> Iterator[str]:
    """A host process with a token on its command line, as the issue found one."""
    token = f"tok-{secrets.token_hex(6)}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", token])
    yield token
    proc.kill()
    proc.wait()


def test_correct_solution_scores_one(mode: CodeTestsReward) -> None:
    assert _score(mode, CORRECT, ADD_ONE) == 1.0
    io = {"inputs": ["3\n"], "outputs": ["6\n"]}
    assert mode(["print(int(input()) * 2)"], tests=[io]) == [1.0]


def test_snippet_has_no_capabilities(mode: CodeTestsReward) -> None:
    probe = (
        "sets = {l.split(':')[0]: int(l.split()[1], 16) for l in open('/proc/self/status')\n"
        "        if l.startswith('Cap')}\n"
        "assert sets and not any(sets.values()), sets"  # effective, permitted, bounding, ...
    )
    if not mode.setup().namespaces:  # /proc is out of reach there; nobody has no caps anyway
        probe = "import os\nassert os.geteuid() != 0"
    assert _score(mode, probe) == 1.0


def test_umount_tmp_and_proc_cannot_uncover_the_host(
    mode: CodeTestsReward, host_secret: Path, host_process_token: str
) -> None:
    marker = Path("/tmp") / f"rlvr-host-marker-{secrets.token_hex(4)}"
    marker.write_text("host")
    marker.chmod(0o644)
    attack = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
unmounted = [libc.umount2(p, 0) == 0 or libc.umount2(p, 2) == 0 for p in (b"/tmp", b"/proc")]
def readable(path):
    try:
        open(path).read()
        return True
    except OSError:
        return False
def host_cmdlines():
    found = []
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            found.append(open("/proc/" + pid + "/cmdline").read())
        except OSError:
            pass
    return found
assert unmounted == [False, False], unmounted
assert not readable({str(marker)!r})
assert not readable({str(host_secret)!r})
assert not any({host_process_token!r} in c for c in host_cmdlines())
"""
    try:
        assert _score(mode, attack) == 1.0
    finally:
        marker.unlink()


def test_file_under_a_0755_directory_is_out_of_reach(
    mode: CodeTestsReward, host_secret: Path
) -> None:
    assert _score(mode, f"assert open({str(host_secret)!r}).read() == 's3cret'") == 0.0
    assert _score(mode, f"import os\nos.listdir({str(host_secret.parent)!r})") == 0.0
    assert _score(mode, "import os\nos.listdir('/root')") == 0.0
    assert _score(mode, "import json\nassert json.dumps(1) == '1'") == 1.0  # stdlib still works


def test_world_writable_host_places_are_covered(mode: CodeTestsReward) -> None:
    name = f"rlvr-escape-{secrets.token_hex(4)}"
    places = ["/run/lock", "/var/tmp", "/tmp", "/dev/shm", "/dev/mqueue", "/var/lock"]
    attack = (
        f"for d in {places!r}:\n"
        "    try:\n"
        f"        open(d + '/{name}', 'w').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
    )
    assert _score(mode, attack) == 1.0
    leaked = [d for d in places if os.path.exists(f"{d}/{name}")]
    for d in leaked:
        os.unlink(f"{d}/{name}")
    assert leaked == []


# Each forges a pass for `assert False` without passing it.
FORGERIES = {
    "ok_on_every_fd": (
        "import os\nfor fd in range(1, 256):\n    try:\n        os.write(fd, b'ok')\n"
        "    except OSError:\n        pass\nos._exit(0)"
    ),
    "verdicts_on_every_fd": (
        "import os\nfor fd in range(1, 256):\n"
        "    for msg in (b'[true]\\n', b'{\"done\": true}\\n'):\n"
        "        try:\n            os.write(fd, msg)\n        except OSError:\n            pass\n"
        "os._exit(0)"
    ),
    "os_exit_before_asserts": "import os\nos._exit(0)",
    "sys_exit_before_asserts": "import sys\nsys.exit(0)",
    "print_fake_verdict": "print('[true]')\nprint('ok')",
    "runner_fds_through_proc": (
        "import os\nppid = os.getppid()\nfor fd in range(256):\n    try:\n"
        "        with open(f'/proc/{ppid}/fd/{fd}', 'w') as out:\n            out.write('[true]')\n"
        "    except OSError:\n        pass\nos._exit(0)"
    ),
    "kill_runner_then_exit": (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos._exit(0)"
    ),
    # the classic: a result whose __eq__ says yes to everything (tested on `assert f(1) == 2`)
    "always_equal": (
        "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()"
    ),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forged_pass_scores_zero(mode: CodeTestsReward, name: str) -> None:
    tests = ["assert False"] if name != "always_equal" else ["assert f(1) == 2"]
    assert _score(mode, FORGERIES[name], tests) == 0.0
    assert _score(mode, CORRECT, ADD_ONE) == 1.0  # and the sandbox still works afterwards


def test_memory_is_capped_for_the_whole_row() -> None:
    """16 children touching 256 MB each (4 GB) against a 300 MB row: the row must not finish."""
    for isolation in ("namespaces", "rlimits"):
        reward = CodeTestsReward(
            isolation=isolation, memory_mb=300, max_processes=40, timeout_s=12, case_timeout_s=12
        )
        try:
            setup = reward.setup()
        except RuntimeError:
            continue
        if setup.cgroup is None:
            pytest.skip("no writable memory cgroup: only per-process limits here")
        attack = (
            "import os\nacks = []\nfor _ in range(16):\n    r, w = os.pipe()\n"
            "    if os.fork() == 0:\n        block = bytearray(256 << 20)\n"
            "        for i in range(0, len(block), 4096):\n            block[i] = 1\n"
            "        os.write(w, b'1')\n        import time\n        time.sleep(30)\n"
            "    os.close(w)\n    acks.append(r)\n"
            "assert all(os.read(r, 1) == b'1' for r in acks)\n" + CORRECT
        )
        start = time.monotonic()
        assert _score(reward, attack, ["assert f(1) == 2"]) == 0.0, isolation
        assert time.monotonic() - start < 8  # stopped by the cap, well before the deadline
        assert subprocess.run(["true"]).returncode == 0
        assert _score(reward, CORRECT, ADD_ONE) == 1.0


def test_concurrent_rows_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    reward = CodeTestsReward(max_workers=2, **FAST)
    reward.setup()
    live, peak, lock = [0], [0], threading.Lock()
    real = code_rewards.run_sandbox

    def counting(*args: object, **kwargs: object) -> object:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            return real(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(code_rewards, "run_sandbox", counting)
    callers = [
        threading.Thread(target=reward, args=([CORRECT] * 3,), kwargs={"tests": [ADD_ONE] * 3})
        for _ in range(3)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert peak[0] == 2  # 9 rows from 3 threads, never more than max_workers at once


def test_mounts_stay_locked_in_a_further_user_namespace(mode: CodeTestsReward) -> None:
    # As it starts, and after it made a user namespace of its own (every capability in it),
    # the snippet's mounts must refuse umount, a read-write remount and a new /proc.
    attack = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def attempts():
    tries = [libc.umount2(p, 2) for p in (b"/tmp", b"/proc", b"/", b"/usr", b"/dev")]
    tries.append(libc.mount(None, b"/", None, 32, None))  # MS_REMOUNT read-write
    tries.append(libc.mount(None, b"/usr", None, 32 | 4096, None))  # MS_REMOUNT | MS_BIND
    tries.append(libc.mount(b"proc", b"/tmp", b"proc", 0, None))
    return tries
before = attempts()
libc.unshare(0x10000000 | 0x20000)  # CLONE_NEWUSER | CLONE_NEWNS; may fail, that is fine too
after = attempts()
assert all(t != 0 for t in before + after), (before, after)
"""
    assert _score(mode, attack) == 1.0


def test_runner_cannot_be_traced_or_read(mode: CodeTestsReward) -> None:
    attack = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
runner = os.getppid()
assert libc.ptrace(16, runner, 0, 0) != 0  # PTRACE_ATTACH
for path in (f"/proc/{runner}/mem", f"/proc/{runner}/environ"):
    try:
        open(path, "rb").read(1)
        raise SystemExit(1)
    except OSError:
        pass
pidfd = libc.syscall(434, runner, 0)  # pidfd_open, then pidfd_getfd of its descriptor 1
assert pidfd < 0 or libc.syscall(438, pidfd, 1, 0) < 0
"""
    assert _score(mode, attack) == 1.0


def test_nothing_is_writable_but_the_work_dir(mode: CodeTestsReward) -> None:
    attack = (
        "import os\nwritten = []\n"
        "for path in ('/x', '/etc/x', '/usr/x', '/dev/x', '/proc/x', os.environ['HOME'] + '/x'):\n"
        "    try:\n        open(path, 'w').write('x')\n        written.append(path)\n"
        "    except OSError:\n        pass\n"
        "assert written == [os.environ['HOME'] + '/x'], written"
    )
    assert _score(mode, attack) == 1.0


def test_no_ipc_objects_that_outlive_the_row(mode: CodeTestsReward) -> None:
    attack = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "made = [libc.shmget(0, 4096, 0o1600), libc.msgget(0, 0o1600), libc.semget(0, 1, 0o1600),\n"
        "        libc.mq_open(b'/rlvr-escape', 0o102, 0o600, None)]\n"  # O_CREAT | O_RDWR
        "assert made == [-1] * 4, made"
    )
    assert _score(mode, attack) == 1.0


def test_no_sockets(mode: CodeTestsReward) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        server.settimeout(0.2)
        attack = (
            "import socket\na, b = socket.socketpair()\n"  # the harness's kind stays available
            "for family, kind in ((socket.AF_INET, socket.SOCK_STREAM),\n"
            "                     (socket.AF_INET, socket.SOCK_DGRAM), (socket.AF_UNIX, 1)):\n"
            "    try:\n        s = socket.socket(family, kind)\n"
            f"        s.connect(('127.0.0.1', {port}) if family == socket.AF_INET else '/x')\n"
            "        raise SystemExit(1)\n"
            "    except PermissionError:\n        pass\n"
        )
        assert _score(mode, attack) == 1.0
        with pytest.raises(TimeoutError):
            server.accept()


def test_hidden_paths_are_empty_in_namespace_mode() -> None:
    reward = CodeTestsReward(isolation="namespaces", hidden_paths=["/etc/ssl"], **FAST)
    try:
        reward.setup()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    assert os.listdir("/etc/ssl")  # there is something to hide on the host
    assert _score(reward, "import os\nassert os.listdir('/etc/ssl') == []") == 1.0
