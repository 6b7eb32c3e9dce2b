"""Two-process DDP on CPU (gloo), each run as a subprocess with a hard timeout, so a deadlock
fails the test instead of hanging it. The scripts live in ``ddp_scripts.py``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).with_name("ddp_scripts.py"))
TIMEOUT_S = 300  # two CPU processes import torch and Lightning in ~30 s on a loaded machine


def _run_all(commands: list[list[str]], cwd: Path) -> None:
    """Run ``commands`` concurrently in their own process groups, each writing to its own log
    file (a full pipe would block a rank inside a collective); kill every group (and the ranks
    Lightning launched inside it) at the deadline and fail with every process's log."""
    logs = [cwd / f"process{i}.log" for i in range(len(commands))]
    procs = []
    for cmd, log in zip(commands, logs, strict=True):
        with log.open("wb") as f:
            procs.append(
                subprocess.Popen(
                    cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # SIGTERM is handled by Lightning
        except ProcessLookupError:
            pass
        proc.wait()
    report = "\n".join(
        f"--- process {i} (rc {p.returncode}) ---\n{log.read_text(errors='replace')[-3000:]}"
        for i, (p, log) in enumerate(zip(procs, logs, strict=True))
    )
    assert not hung, f"processes {hung} gave no result in {TIMEOUT_S} s\n{report}"
    assert all(p.returncode == 0 for p in procs), report


def test_ddp_fit_with_one_rank_fully_filtered_finishes(tmp_path):
    # Rank 1's groups are all uninformative: it trains on no rows but still joins every
    # gradient all-reduce, so both ranks take the same 4 optimiser steps with equal weights.
    out = tmp_path / "fit"
    _run_all([[sys.executable, SCRIPT, "fit", str(out)]], cwd=tmp_path)
    results = [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in (0, 1)]
    for r in results:
        assert r["global_step"] == 4 and r["rollout_step"] == 2
        assert r["rank_param_diff"] == 0.0
    assert results[0]["trained_rows"] == 8 and results[1]["trained_rows"] == 0


def test_two_ranks_give_the_union_batch_loss_and_gradient(tmp_path):
    # Ranks hold unequal token counts (and micro-batch counts); with the unit count averaged
    # over ranks, DDP's mean gradient is the one-process gradient of the union batch.
    out, init = tmp_path / "grads.json", tmp_path / "init"
    _run_all(
        [[sys.executable, SCRIPT, "grads", str(rank), str(init), str(out)] for rank in (0, 1)],
        cwd=tmp_path,
    )
    result = json.loads(out.read_text())
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "empty_rank"]:
        assert result[mode]["grad_scale"] > 1e-3, mode
        assert result[mode]["grad_diff"] < 1e-5 * result[mode]["grad_scale"], mode
        assert result[mode]["loss_diff"] < 1e-6, mode
    # Without the shared unit count each rank's own mean is averaged: a different gradient.
    assert result["token-mean/naive"]["grad_diff"] > 1e-3


FREEZE = """
import os
import signal
import time

import torch.distributed as dist

CALLS = [0]


def freeze_reward(completions, **_):
    CALLS[0] += 1
    if dist.get_rank() == int(os.environ["FROZEN_RANK"]) and CALLS[0] == 2:  # step 2's scoring
        time.sleep(2)  # reported to the other rank (heartbeat_s 0.5) before the freeze
        os.kill(os.getpid(), signal.SIGSTOP)
    return [float(i % 2) for i in range(len(completions))]
"""


def _frozen_run(tmp_path: Path, frozen: int) -> tuple[str, int | None, float]:
    """``rlvr-lightning fit`` on 2 gloo ranks whose rank ``frozen`` stops (SIGSTOP) in step 2's
    reward; returns the output once "Collective timeout" is in it and the process group is
    gone or killed (rank 0 frozen: it never exits), with rank 0's exit code and the seconds."""
    (tmp_path / "freeze.py").write_text(FREEZE)
    exe = str(Path(sys.executable).parent / "rlvr-lightning")
    config = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
    cmd = [exe, "fit", "--config", config, f"--trainer.default_root_dir={tmp_path}"]
    cmd += ["--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.max_steps=4"]
    cmd += ["--trainer.limit_val_batches=0"]
    cmd += ["--model.init_args.rewards.functions=[freeze.freeze_reward]"]
    cmd += ["--trainer.callbacks+=rlvr_lightning.callbacks.CollectiveWatch"]
    cmd += ["--trainer.callbacks.warn_every_s=3", "--trainer.callbacks.timeout_s=10"]
    cmd += ["--trainer.callbacks.heartbeat_s=0.5", "--model.init_args.rewards.timeout_s=0"]
    log, start = tmp_path / "out.log", time.monotonic()
    with log.open("wb") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "FROZEN_RANK": str(frozen)},
        )
    try:
        while time.monotonic() - start < TIMEOUT_S and proc.poll() is None:
            if "Collective timeout" in log.read_text(errors="replace") and frozen == 0:
                time.sleep(1)  # rank 1 ends itself; rank 0 stays stopped
                break
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.monotonic() - start
    return log.read_text(errors="replace"), (proc.returncode if frozen else None), seconds


@pytest.mark.parametrize("frozen", [1, 0])
def test_a_frozen_rank_is_named_every_few_seconds_then_the_run_ends(tmp_path, frozen):
    """Before: one rank frozen (SIGSTOP) left the other waiting in gloo's 30-minute default
    with no message. Now the waiting rank says every ``warn_every_s`` which collective it is
    in, at which step, and which rank has not answered since it was in the reward; after
    ``timeout_s`` it ends the run with exit code 1 (rank 0 also SIGKILLs the rank it launched).
    A frozen rank 0 also freezes the c10d store it hosts: rank 1 says so."""
    log, code, seconds = _frozen_run(tmp_path, frozen)
    waiter = 1 - frozen
    waits = [line for line in log.splitlines() if f"Rank {waiter} has waited" in line]
    assert len(waits) >= 3, log  # at 3, 6, 9 s, then the timeout's own message
    assert all(" in barrier at step 1, called from over_ranks (" in w for w in waits), waits
    # The frozen rank reported twice a second until it froze, 2 s into the reward.
    assert f"rank {frozen} has not answered for" in waits[-1]
    assert "(last: step 1, in freeze_reward (freeze.py:" in waits[-1]
    if frozen == 0:
        assert "the store at 127.0.0.1:" in waits[-1] and "(hosted by rank 0)" in waits[-1]
    assert "Collective timeout (CollectiveWatch timeout_s=10.0)" in log
    assert f"Not answering: rank {frozen}." in log
    assert code in (None, 1), log[-3000:]
    assert seconds < TIMEOUT_S
