"""PPO with a value head (estimator gae): a two-step tiny fit, the checkpoint round trip."""

from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.hub import module_heads
from rlvr_lightning.testing import checkpointing_args

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
HEAD = (
    '--model.init_args.value_head={"class_path": "rlvr_lightning.heads.ValueHead", '
    '"init_args": {"lr": 0.01, "mlp_hidden": 8, "gamma": 0.9, "lam": 0.95}}'
)


def _cli(tmp_path, *extra, run=False):
    args = [
        "--config",
        CONFIG,
        "--model.init_args.estimator=gae",
        HEAD,
        *checkpointing_args(tmp_path),
        *extra,
    ]
    return build_cli(["fit", *args] if run else args, run=run)


def test_gae_fit_logs_a_finite_value_loss_and_the_checkpoint_restores_the_head(tmp_path):
    cli = _cli(tmp_path)
    head = cli.model.value_head
    before = [p.detach().clone() for p in head.parameters()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2
    logged = cli.trainer.logged_metrics
    for key in ("train/value_loss", "train/value_grad_norm", "train/value_mean"):
        assert torch.isfinite(logged[key]), key
    assert any(not torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))
    opt = cli.model.optimizers()
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 0.01]  # policy, head
    assert cli.model.hparams["value_head"]["init_args"]["mlp_hidden"] == 8
    assert module_heads(cli.model) == {"value_head": head}  # ExportModel writes it

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    trained = {k: v for k, v in cli.model.state_dict().items() if k.startswith("value_head.")}
    assert trained and all(torch.equal(saved["state_dict"][k], v) for k, v in trained.items())
    fresh = _cli(tmp_path / "fresh").model
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.items())
    fresh.load_state_dict(saved["state_dict"])
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.items())


def test_gae_fit_resumes_with_the_head_and_its_optimiser_group(tmp_path):
    _cli(tmp_path, run=True)
    last = tmp_path / "ckpt" / "last.ckpt"
    cli = _cli(tmp_path, "--trainer.max_steps=3", f"--ckpt_path={last}", run=True)
    assert cli.trainer.global_step == 3
    state = cli.model.optimizers().state_dict()
    assert len(state["param_groups"]) == 2 and state["param_groups"][1]["lr"] == 0.01


def test_gae_without_a_value_head_and_a_head_without_gae_are_setup_errors():
    with pytest.raises(ValueError, match="value_head"):
        build_cli(["--config", CONFIG, "--model.init_args.estimator=gae"], run=False)
    with pytest.raises(ValueError, match="estimator: gae"):
        build_cli(["--config", CONFIG, HEAD], run=False)


def test_gae_with_trainer_old_logprobs_takes_values_from_the_same_pass(tmp_path):
    cli = _cli(tmp_path, "--model.init_args.correction.old_logprobs=trainer")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    logged = cli.trainer.logged_metrics
    assert torch.isfinite(logged["train/value_loss"])
    assert "train/mismatch/kl" in logged  # the π_old pass ran, and gave V_old too
