"""Runs that cannot mix: one run per checkpoint directory, stale locks taken over, leftover
temporary files removed, and "newest good checkpoint" read from the steps, not the file times.
Each fault goes through ``rlvr-lightning fit`` on ``configs/tiny.yaml``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import main
from rlvr_lightning.runtime import checkpoint_files
from rlvr_lightning.runtime.run_lock import LOCK_NAME, RunLock, RunLockError

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")
EXE = str(Path(sys.executable).parent / "rlvr-lightning")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def fit_args(root: Path, steps: int, *extra: str) -> list[str]:
    """``fit`` on tiny.yaml saving every step into ``root/c`` (last.ckpt and the last 3)."""
    return [
        "fit",
        "--config",
        CONFIG,
        f"--trainer.default_root_dir={root}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'c'}",
        "--trainer.callbacks.every_n_train_steps=1",
        "--trainer.callbacks.monitor=step",
        "--trainer.callbacks.mode=max",
        "--trainer.callbacks.save_top_k=3",
        "--trainer.callbacks.save_last=true",
        *extra,
    ]


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    try:
        main(args)
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def start_holder(root: Path) -> subprocess.Popen:
    """A long ``rlvr-lightning fit`` into ``root/c``, returned once it has saved last.ckpt."""
    log = (root / "holder.log").open("wb")
    proc = subprocess.Popen(
        [EXE, *fit_args(root, 100000)], stdout=log, stderr=subprocess.STDOUT, cwd=root
    )
    deadline = time.monotonic() + 180
    while not (root / "c" / "last.ckpt").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((root / "holder.log").read_text())
        time.sleep(0.2)
    return proc


def test_a_second_run_into_a_busy_directory_is_refused_and_a_dead_holder_is_taken_over(
    tmp_path, capsys, caplog
):
    """Before: no lock; ``--ckpt_path last`` of the second run resumed the first's files and its
    top-k cleanup deleted the other's checkpoints. Now the second run stops at start naming
    the holder and the fix, and nothing in the directory changes; once the holder is killed
    (SIGKILL leaves its lock file and temporary files), the next run takes over with a
    warning, removes the temporary files and resumes from the newest good step."""
    holder = start_holder(tmp_path)
    try:
        lock = json.loads((tmp_path / "c" / LOCK_NAME).read_text())
        assert lock["pid"] == holder.pid
        code, out = run_cli(fit_args(tmp_path, 3, "--ckpt_path=last"), capsys)
        assert code == 1, out
        assert f"is in use by another run (pid {holder.pid} on host" in out
        assert "another trainer.default_root_dir" in out and "--ckpt_path last" in out
        assert holder.poll() is None  # the holder runs on, untouched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    d = tmp_path / "c"
    assert json.loads((d / LOCK_NAME).read_text())["pid"] == holder.pid  # left by the kill
    # What a kill mid-write leaves (AtomicCheckpointIO's names): an empty and a whole file.
    (d / ".last.ckpt.k1l2ed.tmp").write_bytes(b"")
    shutil.copy(d / "last.ckpt", d / ".epoch=0-step=9.ckpt.x7y8z9.tmp")
    start = checkpoint_files.checkpoint_step(d / "last.ckpt")
    code, out = run_cli(fit_args(tmp_path, start + 1, "--ckpt_path=last"), capsys)
    assert code == 0, out
    assert f"Took over the lock of pid {holder.pid}" in caplog.text
    assert not list(d.glob(".*.tmp"))
    assert not (d / LOCK_NAME).exists()  # released at the end
    assert torch.load(d / "last.ckpt", weights_only=False)["global_step"] == start + 1


def test_a_lock_held_in_this_process_refuses_and_a_released_one_does_not(tmp_path):
    held = RunLock.acquire(tmp_path)
    with pytest.raises(RunLockError, match=f"pid {os.getpid()} on host"):
        RunLock.acquire(tmp_path)
    held.release()
    RunLock.acquire(tmp_path).release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_file_of_a_live_process_on_this_host_is_never_taken_over(tmp_path):
    """Even where ``flock`` is not shared (some network filesystems): a lock file naming a live
    process of this host refuses, one naming a pid that is gone is taken over."""
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        fake = {"pid": live.pid, "host": os.uname().nodename, "start_ticks": None}
        (tmp_path / LOCK_NAME).write_text(json.dumps(fake))
        with pytest.raises(RunLockError, match=f"pid {live.pid}"):
            RunLock.acquire(tmp_path)
    finally:
        live.kill()
        live.wait()
    RunLock.acquire(tmp_path).release()


def test_newest_good_is_the_highest_step_after_a_copy(tmp_path, capsys):
    """Before: chosen by modification time; after ``cp -r`` it named step 38 although 39 and
    40 were good. Now the highest loadable step wins, whatever the file times say."""
    src = tmp_path / "run"
    code, out = run_cli(fit_args(src, 3), capsys)
    assert code == 0, out
    copy = tmp_path / "copy"
    shutil.copytree(src / "c", copy)
    now = time.time()
    for i, name in enumerate(["epoch=0-step=3.ckpt", "last.ckpt", "epoch=0-step=2.ckpt"]):
        os.utime(copy / name, (now + i, now + i))  # step 2 is the newest file
    (copy / "epoch=0-step=3.ckpt").write_bytes(b"truncated")
    assert checkpoint_files.newest_good([copy]) == (copy / "last.ckpt").resolve()
    # As the CLI names it when asked to resume from the truncated file:
    args = fit_args(tmp_path / "again", 4, f"--ckpt_path={copy / 'epoch=0-step=3.ckpt'}")
    code, out = run_cli(args, capsys)
    assert code == 1 and f"the newest good checkpoint is {copy / 'last.ckpt'}" in out, out
    (copy / "last.ckpt").unlink()
    assert checkpoint_files.newest_good([copy]) == (copy / "epoch=0-step=2.ckpt").resolve()
