# The sandbox runner of ``rewards/code.py``, started by ``rewards/sandbox.py``: executed as
# ``python -I -c <this file's text>`` inside the sandbox (never imported). It reads the job as
# JSON on stdin and prints one pass flag per case; it forks one grandchild per case so the
# snippet never runs in the process that reports, and in namespace mode it is PID 1: its exit
# takes every descendant with it.
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

job = json.loads(sys.stdin.read())
if job["namespaces"]:
    libc = ctypes.CDLL(None, use_errno=True)
    for path in job["hidden"]:
        if (
            os.path.isdir(path)
            and libc.mount(
                b"tmpfs",
                path.encode(),
                b"tmpfs",
                6,
                f"size={job['disk']},nr_inodes=4096,mode=1777".encode(),
            )
            != 0
        ):
            raise OSError(ctypes.get_errno(), "cannot mount tmpfs over " + path)
    os.chdir("/tmp")
for name, value in job["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans, setsid() ones too, come to us


def sweep():
    # SIGKILL every process whose parent we are until none is left; orphans keep arriving
    # as their parents die. In namespace mode kill(-1) reaches the whole namespace at once.
    me = str(os.getpid())
    for _ in range(500):
        if job["namespaces"]:
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
        kids = []
        for entry in os.listdir("/proc"):
            try:
                with open("/proc/" + entry + "/stat") as stat:
                    if entry.isdigit() and stat.read().rsplit(")", 1)[1].split()[1] == me:
                        kids.append(int(entry))
            except (OSError, IndexError):
                pass
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, os.WNOHANG)
            except OSError:
                pass
        if not kids:
            return
        time.sleep(0.002)


def child(code, test, stdin_fd, stdout_fd, ok_fd):
    os.setpgid(0, 0)
    os.dup2(stdin_fd, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    sys.stdin, sys.stdout = open(0, closefd=False), open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "solution.py", "exec"), scope)
    except SystemExit as exc:
        if test is not None or exc.code not in (None, 0):
            raise
    if test is not None:
        exec(compile(test, "test.py", "exec"), scope)
    sys.stdout.flush()
    os.write(ok_fd, b"ok")


def run_case(test, stdin_text, deadline):
    with open(".in", "w+") as fin, open(".out", "w+b") as fout:
        fin.write(stdin_text or "")
        fin.seek(0)
        os.unlink(".in"), os.unlink(".out")
        read_ok, write_ok = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_ok)
                child(job["code"], test, fin.fileno(), fout.fileno(), write_ok)
            except BaseException:
                os._exit(1)
            os._exit(0)
        os.close(write_ok)
        pidfd = os.pidfd_open(pid)
        select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        status = os.waitpid(pid, 0)[1]
        sweep()
        ok = os.read(read_ok, 2) == b"ok" and os.waitstatus_to_exitcode(status) == 0
        os.close(read_ok), os.close(pidfd)
        fout.seek(0)
        return ok, fout.read(job["max_output"]).decode("utf-8", "replace")


def same_output(got, want):
    return [s.rstrip() for s in got.strip().splitlines()] == [
        s.rstrip() for s in str(want).strip().splitlines()
    ]


end = time.monotonic() + job["timeout"]
passed = []
for test, stdin_text, want in job["cases"]:
    if time.monotonic() >= end:
        passed.append(False)
        continue
    ok, out = run_case(test, stdin_text, min(end, time.monotonic() + job["case_timeout"]))
    passed.append(ok and (want is None or same_output(out, want)))
sys.__stdout__.write(json.dumps(passed))
