# The sandbox runner of ``rewards/code.py``, started by ``rewards/sandbox.py`` as
# ``python -I -c <this file's text>`` (never imported). It reads the job as JSON on stdin, runs
# each test case in a forked child (which runs ``_code_child.py``), relays the child's answers
# and prints them as JSON. It never runs model code and is not dumpable, so a snippet cannot
# ptrace it or open its descriptors; the trainer computes the verdict from the answers (values,
# not pass flags), so nothing the snippet writes anywhere can pass a test it fails.
#
# Namespace mode: this process makes a user, mount, network, PID, IPC and UTS namespace, forks
# the runner as PID 1 of it, builds a new root (read-only binds of the system paths, a private
# /tmp, a minimal /dev, the namespace's /proc), pivots into it, and starts every child in a
# further user + mount namespace, which locks those mounts (no umount, no remount read-write).
# Every child also gets no_new_privs, rlimits and, where the kernel has it, a Landlock domain.
import ctypes
import json
import os
import resource
import select
import signal
import socket
import struct
import sys
import time

NEWNS, NEWUTS, NEWIPC = 0x20000, 0x4000000, 0x8000000
NEWUSER, NEWPID, NEWNET = 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
ATIME_FLAGS, STRICTATIME = 1024 | 2048 | 4096, 1 << 24  # noatime, nodiratime, relatime
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")
INNER_ID = 1000  # the snippet's uid/gid inside its user namespace (root there is unmapped)
libc = ctypes.CDLL(None, use_errno=True)
job = json.loads(sys.stdin.read())
for _extra in (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))):
    # the interpreter's own tree, read-only, where it is not under a system path already
    if _extra != "/" and not any(
        _extra == b or _extra.startswith(b.rstrip("/") + "/") for b in job["binds"]
    ):
        job["binds"].append(_extra)


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, what + ": " + os.strerror(err))


def mount(src, dst, fstype, flags, data=None):
    enc = [s.encode() if s else None for s in (src, dst, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), "mount " + dst)


def syscall(number, *args):
    # libc's syscall() is variadic: integers must go in as C longs, not 32-bit ints.
    return libc.syscall(*[ctypes.c_long(a) if isinstance(a, int) else a for a in (number, *args)])


def write(path, text):
    with open(path, "w") as out:
        out.write(text)


def map_ids(inner, outer_uid, outer_gid):
    # One line each: the unprivileged form, allowed for the namespace's creator.
    write("/proc/self/setgroups", "deny")
    write("/proc/self/uid_map", f"{inner} {outer_uid} 1")
    write("/proc/self/gid_map", f"{inner} {outer_gid} 1")


def dumpable(flag):
    libc.prctl(4, flag, 0, 0, 0)  # PR_SET_DUMPABLE


def bind_ro(src, dst):
    if os.path.islink(src):  # merged-/usr symlinks such as /bin -> usr/bin stay symlinks
        os.symlink(os.readlink(src), dst)
        return
    if not os.path.exists(src):
        return
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "w").close()
    mount(src, dst, None, BIND | REC)
    # A remount inside a user namespace must keep the source's locked flags (atime included).
    kept = os.statvfs(src).f_flag & (NOEXEC | ATIME_FLAGS)
    atime = 0 if kept & ATIME_FLAGS else STRICTATIME
    mount(None, dst, None, BIND | REMOUNT | RDONLY | NOSUID | NODEV | kept | atime)


def build_dev(root):
    dev = root + "/dev"
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", NOSUID | NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        mount("/dev/" + name, f"{dev}/{name}", None, BIND)
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(dev + "/shm")
    mount(root + "/tmp", dev + "/shm", None, BIND)  # POSIX shared memory: the row's own /tmp
    mount(None, dev, None, REMOUNT | RDONLY | NOSUID | NOEXEC)


def build_root():
    # The row's empty host directory becomes the sandbox's /: nothing else of the host is in it.
    root = os.getcwd()
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,nr_inodes=1024,mode=755")
    for path in job["binds"]:
        bind_ro(path, root + path)
    os.mkdir(root + "/tmp")
    tmp_opts = f"size={job['disk']},nr_inodes=4096,mode=1777"
    mount("tmpfs", root + "/tmp", "tmpfs", NOSUID | NODEV, tmp_opts)
    build_dev(root)
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    for path in job["hidden"]:
        if os.path.isdir(root + path) and not os.path.islink(root + path):
            mount("tmpfs", root + path, "tmpfs", NOSUID | NODEV | RDONLY, "size=4k,mode=755")
    os.chdir(root)
    check(syscall(PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
    os.chdir("/")
    mount(None, "/", None, REMOUNT | RDONLY | NOSUID | NODEV)
    os.chdir("/tmp")


def enter_namespaces():
    # Returns in the runner (PID 1 of the new namespaces); the parent only relays its status.
    uid, gid = os.geteuid(), os.getegid()
    check(libc.unshare(NEWUSER | NEWNS | NEWNET | NEWPID | NEWIPC | NEWUTS), "unshare")
    map_ids(0, uid, gid)
    pid = os.fork()
    if pid:
        dumpable(0)
        status = os.waitpid(pid, 0)[1]
        os._exit(0 if os.waitstatus_to_exitcode(status) == 0 else 1)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the parent
    build_root()


LL_RO = 1 | 4 | 8  # execute, read_file, read_dir
LL_FILE = 1 | 2 | 4 | (1 << 14)  # the rights a rule on a file (not a directory) may carry
LL_NO_DEVICES = ~((1 << 6) | (1 << 11))  # make_char, make_block


def landlock(ro, rw, devices):
    # Allow-list: read/execute under `ro`, everything but device nodes under `rw`, read/write of
    # a few device files; every other path, TCP bind/connect, abstract unix sockets outside the
    # domain and signals to processes outside it are refused (the last two need ABI 6).
    abi = syscall(444, None, 0, 1)
    fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = ctypes.create_string_buffer(struct.pack("QQQ", fs, 3, 3)[:size], size)
    ruleset = syscall(444, attr, size, 0)
    if ruleset < 0:
        check(ruleset, "landlock_create_ruleset")
    for paths, access in ((ro, LL_RO), (rw, fs & LL_NO_DEVICES), (devices, 2 | 4)):
        for path in paths:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            allowed = access if os.path.isdir(path) else access & LL_FILE
            rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed & fs, fd), 12)
            check(syscall(445, ruleset, 1, rule, 0), "landlock_add_rule " + path)
            os.close(fd)
    check(syscall(446, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


# seccomp: refused calls per architecture (audit arch; socket, io_uring_setup, shmget, semget,
# msgget, mq_open). No sockets at all (socketpair(2), the harness's channel, stays; io_uring's
# socket op would bypass the check), and no SysV / POSIX IPC objects, which would outlive the
# row in the host's IPC namespace (rlimits mode) and hold memory outside its cgroup.
SECCOMP_DENY = {
    "x86_64": (0xC000003E, (41, 425, 29, 64, 68, 240)),
    "aarch64": (0xC00000B7, (198, 425, 194, 190, 186, 180)),
}


def seccomp_filter():
    arch, numbers = SECCOMP_DENY[os.uname().machine]
    deny = 0x00050000 | 13  # SECCOMP_RET_ERRNO | EACCES
    program = [
        (0x20, 0, 0, 4),  # A = seccomp_data.arch
        (0x15, 1, 0, arch),  # a foreign ABI (i386 socketcall) ...
        (0x06, 0, 0, 0x80000000),  # ... kills the process
        (0x20, 0, 0, 0),  # A = seccomp_data.nr
        (0x35, 0, 1, 0x40000000),  # x32 numbers are refused
        (0x06, 0, 0, deny),
    ]
    for number in numbers:
        program += [(0x15, 0, 1, number), (0x06, 0, 0, deny)]
    program.append((0x06, 0, 0, 0x7FFF0000))  # SECCOMP_RET_ALLOW
    code = b"".join(struct.pack("HBBI", *insn) for insn in program)
    filters = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HxxxxxxP", len(program), ctypes.addressof(filters))
    check(libc.prctl(22, 2, ctypes.create_string_buffer(fprog, len(fprog)), 0, 0), "seccomp")


def drop_capabilities():
    # The creator of a user namespace holds every capability in it: give them all up (bounding
    # and ambient sets too), as an exec by a non-root uid would.
    for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
        check(libc.prctl(24, cap, 0, 0, 0), "PR_CAPBSET_DROP")
    check(libc.prctl(47, 4, 0, 0, 0), "PR_CAP_AMBIENT_CLEAR_ALL")
    header = ctypes.create_string_buffer(struct.pack("Ii", 0x20080522, 0), 8)  # version 3
    check(libc.capset(header, ctypes.create_string_buffer(24)), "capset")


def become_child(stdin_fd, stdout_fd, chan_fd):
    # Runs in the forked child, then runs the harness (``_code_child.py``) in it. Forked, not
    # exec'd: this process holds no expected value, so there is nothing here to find, and a
    # fork costs ~1 ms where a fresh interpreter costs 10-40. Any failure ends it with 127.
    os.setpgid(0, 0)
    dumpable(1)  # the runner's flag is not the child's: its own /proc/self stays its own
    for fd, target in (
        (stdin_fd, 0),
        (stdout_fd, 1),
        (os.open(os.devnull, os.O_WRONLY), 2),
        (chan_fd, 3),
    ):
        os.dup2(fd, target)
        os.set_inheritable(target, True)
    os.closerange(4, 1 << 16)
    if job["namespaces"]:  # a user + mount namespace of its own: every mount above is locked
        check(libc.unshare(NEWUSER | NEWNS), "unshare")
        map_ids(INNER_ID, 0, 0)
        drop_capabilities()
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    if job["landlock"]:
        readable = job["binds"] + (["/proc"] if job["namespaces"] else [])  # its own /proc only
        landlock(readable, [os.getcwd()], ["/dev/" + n for n in DEVICES])
    seccomp_filter()
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    exec(compile(job["child"], "harness.py", "exec"), {"__name__": "harness"})
    os._exit(0)


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


def send(sock, message, deadline):
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    sock.sendall(json.dumps(message).encode() + b"\n")


def receive(sock, pidfd, deadline, buffer):
    # One answer line (bytes, without the newline), or None on EOF, overflow, the deadline or
    # the child's exit (a descendant holding the socket open does not keep the case waiting).
    while b"\n" not in buffer:
        if len(buffer) > job["max_output"]:
            return None
        ready = select.select([sock, pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]
        if sock not in ready:
            return None
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None
        buffer.extend(chunk)
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line


def converse(sock, pidfd, case, deadline):
    answers, buffer = [], bytearray()
    try:
        send(sock, {"code": job["code"], "io": case["steps"] is None}, deadline)
        for step in case["steps"] or []:
            send(sock, step, deadline)
            line = receive(sock, pidfd, deadline, buffer)
            if line is None:
                break
            answers.append(line.decode("utf-8", "replace"))
    except OSError:  # timeout, or the child closed its end
        pass
    return answers


def run_case(case, deadline):
    with open(".in", "w+b") as fin, open(".out", "w+b") as fout:
        fin.write((case["stdin"] or "").encode())
        fin.seek(0)
        os.unlink(".in"), os.unlink(".out")
        mine, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            try:
                become_child(fin.fileno(), fout.fileno(), theirs.fileno())
            finally:
                os._exit(127)
        theirs.close()
        pidfd = os.pidfd_open(pid)
        answers = converse(mine, pidfd, case, deadline)
        if case["steps"] is None:  # a program: its exit status and stdout are the result
            select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))
        mine.close()
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        status = os.waitpid(pid, 0)[1]
        os.close(pidfd)
        sweep()
        fout.seek(0)
        out = fout.read(job["max_output"]).decode("utf-8", "replace")
        return {"exit": os.waitstatus_to_exitcode(status), "out": out, "answers": answers}


def main():
    if job["namespaces"]:
        enter_namespaces()
    dumpable(0)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans, setsid() ones too, come to us
    end = time.monotonic() + job["timeout"]
    results = []
    for case in job["cases"]:
        if time.monotonic() >= end:
            results.append(None)
            continue
        results.append(run_case(case, min(end, time.monotonic() + job["case_timeout"])))
    sys.__stdout__.write(json.dumps(results))


main()
