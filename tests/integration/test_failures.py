"""Bad input fails clearly or is isolated; training state is not lost."""

from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import build_cli

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def _cli(*extra):
    return build_cli(["--config", CONFIG, *extra], run=False)


def test_raising_reward_is_isolated_and_training_continues():
    cli = _cli()

    def flaky(completions, **_):
        raise RuntimeError("boom")

    # max_failure_share=None: only count (raising on every row stops the run by default).
    cli.model.rewards = type(cli.model.rewards)(
        [cli.model.rewards.specs[0].fn, flaky], timeout_s=5.0, max_failure_share=None
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    assert cli.trainer.logged_metrics["train/reward/flaky/failures"] > 0


def test_nan_loss_skips_steps_then_stops_with_a_clear_error():
    def nan_loss(logp, old_logp, advantages, mask, **_):
        return logp * float("nan"), {}

    cli = _cli("--model.init_args.update.max_nonfinite_steps=2", "--trainer.max_steps=5")
    cli.model.updater = type(cli.model.updater)(
        **{**cli.model.updater.__dict__, "loss_fn": nan_loss}
    )
    before = [p.detach().clone() for p in cli.model.policy.parameters()]
    with pytest.raises(FloatingPointError, match="non-finite for 2 optimiser steps"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    for a, b in zip(before, cli.model.policy.parameters(), strict=True):
        assert torch.equal(a, b), "a non-finite update reached the weights"


def test_group_size_one_is_rejected_with_a_fix():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        _cli("--model.init_args.sampling.group_size=1")


def test_unknown_algorithm_lists_the_choices():
    with pytest.raises(SystemExit):
        _cli("--model.init_args.algorithm=ppo2")


@pytest.mark.parametrize("measured", ["bf16-mixed", "32-true"])
def test_choose_precision_sets_the_trainer_precision_it_measured(measured):
    from rlvr_lightning.device import fast_paths

    with fast_paths.forced({"precision/float32": measured}):
        cli = _cli("--choose_precision=true", "--trainer.precision=32-true")
    assert cli.trainer.precision == measured
