"""Misbehaving rewards in real runs: a signal stops the CLI within seconds whatever the reward
does (and leaves no worker behind); a NaN reward stops ``fit`` with a message naming it, or is
counted with ``rewards.nan_policy: fail``; math-verify's own timeouts are on in the workers."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.rewards import RewardCombiner, RewardContractError, RewardWorkers, faults

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
STARTED = re.compile(r"rlvr_lightning\.rewards\.faults\.(\w+) started in process (\d+)")
STOP_WITHIN_S = 10.0  # "a few seconds" with room for a loaded CI machine


def _wait_for(path: Path, pattern: re.Pattern[str], proc: subprocess.Popen, limit_s: float) -> int:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if match := pattern.search(path.read_text(errors="replace")):
            return int(match.group(2))
        assert proc.poll() is None, f"the run ended first:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the reward did not start:\n{path.read_text()[-3000:]}")


def _gone(pid: int, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(
    ("reward", "signum"),
    [
        pytest.param("power_tower", signal.SIGTERM, id="power_tower-SIGTERM"),
        pytest.param("hang", signal.SIGINT, id="hang-SIGINT"),
    ],
)
def test_signal_stops_the_cli_whatever_the_reward_does(
    tmp_path: Path, reward: str, signum: int
) -> None:
    log = tmp_path / "run.log"
    cmd = [
        str(Path(sys.executable).parent / "rlvr-lightning"),
        "fit",
        "--config",
        CONFIG,
        f"--trainer.default_root_dir={tmp_path}",
        f"--model.init_args.rewards.functions=[rlvr_lightning.rewards.faults.{reward}]",
        "--model.init_args.rewards.timeout_s=60",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        worker = _wait_for(log, STARTED, proc, limit_s=240)
        time.sleep(1.0)  # deep in the reward: sleeping, or sympy on 9**387420489
        sent = time.monotonic()
        proc.send_signal(signum)
        try:
            proc.wait(timeout=STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"still running {STOP_WITHIN_S} s after {signal.Signals(signum).name}")
    stopped_in = time.monotonic() - sent
    assert stopped_in < STOP_WITHIN_S
    assert _gone(worker, limit_s=5.0), "the reward's worker process outlived the run"


def test_nan_reward_stops_fit_naming_the_function(tmp_path: Path) -> None:
    cli = build_cli(
        [
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.rewards.functions=[rlvr_lightning.testing.digit_fraction,"
            "rlvr_lightning.rewards.faults.nan_values]",
            "--model.init_args.rewards.isolate=false",  # no worker needed to check the contract
        ],
        run=False,
    )
    assert cli.model.rewards.isolated == []
    with pytest.raises(RewardContractError, match="'nan_values' returned nan for completion 0"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0


def test_nan_policy_fail_counts_and_training_continues(tmp_path: Path) -> None:
    cli = build_cli(
        [
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.rewards.functions=[rlvr_lightning.testing.digit_fraction,"
            "rlvr_lightning.rewards.faults.nan_values]",
            "--model.init_args.rewards.isolate=[]",
            "--model.init_args.rewards.nan_policy=fail",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert cli.trainer.logged_metrics["train/reward/nan_values/failures"] > 0


def test_math_verify_timeouts_are_on_in_workers() -> None:
    workers = RewardWorkers(1, preload=["rlvr_lightning.rewards.faults", "math_verify"])
    try:
        combiner = RewardCombiner([faults.power_tower], timeout_s=None, workers=workers)
        result = combiner(["a", "b"], {})  # no combiner timeout: only math-verify's stop it
    finally:
        workers.close()
    torch.testing.assert_close(result.per_function["power_tower"], torch.tensor([0.0, 0.0]))
