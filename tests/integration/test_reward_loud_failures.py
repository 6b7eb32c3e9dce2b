"""Rewards that fail loudly, through ``rlvr-lightning fit``: the README's old ``short_and_right``
on CSV data (int answers) stops the run naming it, its error and the fix, where it used to
train on zeros and exit 0; the README's example as written now trains on the same data; an
unmarked reward that spins is reported once with the fix and stops the run after
``max_abandoned_threads`` timeouts, where each timeout used to leave a spinning thread."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import build_cli, main

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
README = Path(__file__).parents[2] / "README.md"

OLD_EXAMPLE = """
def short_and_right(completions, answer, completion_length, **_):
    return [
        1.0 if a in c and n < 20 else 0.0 for c, a, n in zip(completions, answer, completion_length)
    ]
"""

SPIN = """
def spin(completions, **_):
    while True:
        pass
"""


def _readme_example() -> str:
    """The ``my_rewards.py`` block of the README's "Add a reward" section, as a user copies it."""
    text = README.read_text()
    start = text.index("# my_rewards.py\n")
    return text[start : text.index("```", start)]


def _csv(tmp_path: Path) -> str:
    rows = "".join(f"What is {i} + {i}?,{2 * i}\n" for i in range(40))
    (tmp_path / "sums.csv").write_text("prompt,answer\n" + rows)  # answers read back as ints
    return str(tmp_path / "sums.csv")


def _args(tmp_path: Path, module: str) -> list[str]:
    return [
        "--config",
        CONFIG,
        f"--trainer.default_root_dir={tmp_path}",
        f"--data.init_args.source={_csv(tmp_path)}",
        f"--model.init_args.rewards.functions=[{module}.short_and_right]",
    ]


def test_a_reward_raising_on_every_row_stops_fit(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "old_rewards.py").write_text(OLD_EXAMPLE)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *_args(tmp_path, "old_rewards")])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "RewardFailureError: Reward function 'short_and_right' raised on all 8 rows" in err
    assert "TypeError: 'in <string>' requires string as left operand, not int" in err
    assert "(at old_rewards.py:" in err and "Fix: make the function return 0.0" in err


def test_the_readme_example_trains_on_the_same_data(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "readme_rewards.py").write_text(_readme_example())
    cli = build_cli(_args(tmp_path, "readme_rewards"), run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert cli.trainer.logged_metrics["train/reward/short_and_right/failures"] == 0


def test_a_spinning_unmarked_reward_is_reported_once_then_stops_the_run(tmp_path):
    (tmp_path / "spin_rewards.py").write_text(SPIN)
    cmd = [
        str(Path(sys.executable).parent / "rlvr-lightning"),
        "fit",
        "--config",
        CONFIG,
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.max_steps=8",
        "--model.init_args.rewards.functions=[spin_rewards.spin]",
        "--model.init_args.rewards.timeout_s=0.5",
    ]
    # A subprocess: the spinning threads end with it, not with this test.
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.count("Reward function 'spin' exceeded timeout_s=0.5") == 1  # once
    assert "its thread keeps running. Fix: run it in a worker process" in done.stderr
    assert "RewardTimeoutError: Reward function 'spin' ran past timeout_s=0.5 in 3 calls" in (
        done.stderr
    )
    assert "max_abandoned_threads=3" in done.stderr and "rewards.isolate" in done.stderr
