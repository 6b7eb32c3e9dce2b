"""A run whose groups are all filtered out stops with an error instead of spinning: the
stopping rule ``max_steps`` counts optimiser steps, which such a run never takes."""

from pathlib import Path

import pytest

from rlvr_lightning.cli.main import main

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
# boxed_format is 0 for every completion of the random tiny model: a constant reward, so
# filter_zero_variance drops every group (the outcome never varies within one).
CONSTANT = ["--model.init_args.rewards.functions=[rlvr_lightning.rewards.boxed_format]"]


def test_all_groups_filtered_stops_with_a_clear_error(tmp_path, capsys):
    args = [
        "fit",
        "--config",
        CONFIG,
        f"--trainer.default_root_dir={tmp_path}",
        *CONSTANT,
        "--model.init_args.selection.filter_zero_variance=true",
        "--model.init_args.update.max_steps_without_update=3",
    ]
    with pytest.raises(SystemExit) as stop:
        main(args=args)
    assert stop.value.code == 1
    assert "3 rollout steps in a row took no optimiser step" in capsys.readouterr().err


def test_max_steps_without_update_must_be_positive(capsys):
    with pytest.raises(SystemExit) as stop:
        main(
            args=["fit", "--config", CONFIG, "--model.init_args.update.max_steps_without_update=0"]
        )
    assert stop.value.code == 1
    assert "max_steps_without_update must be >= 1" in capsys.readouterr().err
