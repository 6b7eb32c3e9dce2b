"""The replay and curriculum configs run end to end (tiny model swapped in, two steps)."""

from pathlib import Path

import pytest

from rlvr_lightning.cli.main import build_cli

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["replay.yaml", "curriculum.yaml"])
def test_strategy_config_runs(tmp_path, name):
    cli = build_cli(
        [
            "fit", "--config", str(CONFIGS / name),
            "--model.init_args.policy=tiny:0",
            "--model.init_args.sampling={max_new_tokens: 6, temperature: 1.0, group_size: 4}",
            "--model.init_args.val_sampling={max_new_tokens: 6, temperature: 0.0}",
            "--trainer.precision=32-true", "--trainer.max_steps=2",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
            "--data.init_args.val_size=4",
        ]
    )  # fmt: skip
    dm = cli.datamodule
    strategy = dm.replay if name == "replay.yaml" else dm.curriculum
    assert strategy is not None
    assert dm.steps >= 2 and len(dm.stats) > 0
