"""Progress bars count steps toward max_steps (not ``Epoch 0/-2``); the CLI adds one by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rlvr_lightning.callbacks import RichStepProgressBar, StepProgressBar

from rlvr_lightning import RLVRModule
from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.testing import digit_fraction, grouped, quiet_trainer
from rlvr_lightning.types import Sampling

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


@pytest.mark.parametrize("bar_class", [StepProgressBar, RichStepProgressBar])
def test_bar_counts_steps_toward_max_steps(bar_class):
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[digit_fraction],
            sampling=Sampling(max_new_tokens=4, temperature=1.0, group_size=2),
        ),
    )
    data = RLVRDataModule("addition", train_size=4, val_size=2, prompts_per_step=2)
    bar = bar_class()
    trainer = quiet_trainer(max_steps=3, callbacks=[bar], enable_progress_bar=True)
    trainer.fit(module, datamodule=data)
    assert trainer.max_epochs == -1 and bar.total_train_batches == 3
    if isinstance(bar, StepProgressBar):
        tqdm = bar.train_progress_bar
        assert (tqdm.n, tqdm.total, tqdm.desc) == (3, 3, "Step: ")
    else:
        assert bar._get_train_description(0).strip() == "Step"
        (task,) = [t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id]
        assert (task.completed, task.total) == (3, 3)


def test_with_max_epochs_the_bar_is_lightnings():
    bar = RichStepProgressBar()
    trainer = quiet_trainer(max_epochs=2, callbacks=[bar], enable_progress_bar=True)
    bar.setup(trainer, None, "fit")  # attaches the trainer, as fit does
    assert bar._get_train_description(0).strip() == "Epoch 0/1"


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--trainer.enable_progress_bar=true"], StepProgressBar),
        (
            [
                "--trainer.enable_progress_bar=true",
                "--trainer.callbacks+=lightning.pytorch.callbacks.RichProgressBar",
            ],
            "RichProgressBar",
        ),
        ([], type(None)),  # tiny.yaml turns the bar off
    ],
)
def test_cli_adds_the_step_bar_only_where_lightning_would_add_its_own(flags, expected):
    cli = build_cli(["--config", CONFIG, *flags], run=False)
    bar = cli.trainer.progress_bar_callback
    if isinstance(expected, str):
        assert type(bar).__name__ == expected
    else:
        assert type(bar) is expected
