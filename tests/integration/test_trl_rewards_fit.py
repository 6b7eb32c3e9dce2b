"""TRL's own reward functions, unchanged, through ``rlvr-lightning fit``: with ``trl``
installed, ``rewards.functions: [trl.rewards.accuracy_reward, trl.rewards.think_format_reward]`` on
rows with a ``solution`` column trains with zero reward failures, on conversational prompts (as
TRL's docs show them) and on plain ones. Where ``trl`` is missing this file is skipped;
tests/unit/test_rewards_trl_contract.py covers the contract with copies of the functions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import build_cli

pytest.importorskip("trl")
pytest.importorskip("math_verify")

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
FUNCTIONS = ("accuracy_reward", "think_format_reward")


def _rows(conversational: bool) -> str:
    rows = []
    for i in range(16):
        question = f"What is {i} + {i}?"
        prompt = [{"role": "user", "content": question}] if conversational else question
        rows.append(json.dumps({"prompt": prompt, "solution": f"${2 * i}$"}) + "\n")
    return "".join(rows)


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "plain"])
def test_trl_rewards_train_with_zero_failures(tmp_path: Path, conversational: bool) -> None:
    data = tmp_path / "sums.jsonl"
    data.write_text(_rows(conversational))
    cli = build_cli(
        [
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={tmp_path}",
            f"--data.init_args.source={data}",
            "--data.init_args.val_size=4",
            "--model.init_args.rewards.functions=[trl.rewards.accuracy_reward,"
            "trl.rewards.think_format_reward]",
        ],
        run=False,
    )
    assert cli.model.rewards.names == list(FUNCTIONS)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    metrics = cli.trainer.logged_metrics
    for name in FUNCTIONS:
        assert metrics[f"train/reward/{name}/failures"] == 0, name
        assert metrics[f"train/reward/{name}/timeouts"] == 0, name
        assert not math.isnan(metrics[f"train/reward/{name}"]), name  # rows scored, not skipped
