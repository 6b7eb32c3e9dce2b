"""Two-step ``fit`` runs of the tiny in-process model through the CLI."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.testing import grouped

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")

EXPECTED_KEYS = {
    "train/reward",
    "train/reward_std",
    "train/accuracy",
    "train/zero_variance_frac",
    "train/adv_abs_mean",
    "train/clip_frac_low",
    "train/clip_frac_high",
    "train/approx_kl_old",
    "train/entropy",
    "train/completion_len",
    "train/truncated_frac",
    "train/gen_tokens_per_s",
    "train/step_time_s",
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/reward/digit_fraction",
    "val/accuracy",
    "val/reward",
}


def _fit(tmp_path, *extra):
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", *extra]
    return build_cli(args)


def test_two_steps_change_parameters_and_log_metrics(tmp_path):
    cli = build_cli(["--config", CONFIG], run=False)
    before = [p.detach().clone() for p in cli.model.policy.parameters()]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = list(cli.model.policy.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert cli.trainer.global_step == 2
    missing = EXPECTED_KEYS - set(cli.trainer.logged_metrics)
    assert not missing, f"not logged: {sorted(missing)}"


def test_export_folder_loads_with_auto_classes(tmp_path):
    cli = _fit(
        tmp_path,
        "--trainer.callbacks+=rlvr_lightning.callbacks.ExportModel",
        "--trainer.callbacks.dirpath=exported",
    )
    folder = tmp_path / "exported"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        expected = cli.model.policy(ids).logits
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)


def test_resume_restores_step_and_optimizer(tmp_path):
    ckpt_cb = [
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.save_last=true",
    ]
    _fit(tmp_path, *ckpt_cb)
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.exists()
    saved = torch.load(last, weights_only=False)
    assert saved["optimizer_states"][0]["state"], "optimiser moments were not saved"
    cli = _fit(tmp_path, *ckpt_cb, "--trainer.max_steps=3", f"--ckpt_path={last}")
    assert cli.trainer.global_step == 3
    assert cli.model._rollout_step == 3


def test_validate_subcommand_runs_without_training():
    cli = build_cli(["validate", "--config", CONFIG])
    assert "val/accuracy" in cli.trainer.callback_metrics
    assert cli.trainer.global_step == 0


def test_lora_with_kl_uses_the_disabled_adapter_as_reference(tmp_path):
    cli = build_cli(
        [
            "--config",
            CONFIG,
            "--model.init_args.lora.rank=4",
            "--model.init_args.loss.kl_coef=0.1",
            "--model.init_args.lora.target_modules=[q_proj,v_proj]",
        ],
        run=False,
    )
    assert cli.model.reference is None
    base = {
        n: p.detach().clone() for n, p in cli.model.policy.named_parameters() if "lora" not in n
    }
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    for n, p in cli.model.policy.named_parameters():
        if "lora" not in n:
            assert torch.equal(p, base[n]), f"base weight {n} changed under LoRA"
    assert "train/kl" in cli.trainer.logged_metrics


def test_kl_with_full_finetuning_keeps_a_frozen_copy():
    cli = build_cli(["--config", CONFIG, "--model.init_args.loss.kl_coef=0.1"], run=False)
    ref = cli.model.reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    assert not any(k.startswith("_reference") for k in cli.model.state_dict())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert "train/kl" in cli.trainer.logged_metrics


@pytest.mark.parametrize("algorithm", ["dapo", "dr_grpo", "gspo", "cispo"])
def test_presets_train(algorithm):
    # dapo drops groups whose accuracy does not vary, and digit_fraction is rarely 1 (correct)
    # on the random tiny model: judging by the dense reward makes its groups informative.
    args = ["--config", CONFIG, f"--model.init_args.algorithm={algorithm}"]
    if algorithm == "dapo":
        args.append("--model.init_args.selection.informative=reward")
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step >= 1


def test_several_epochs_and_minibatches_per_rollout_step_the_optimizer_each_time():
    cli = build_cli(
        [
            "--config",
            CONFIG,
            "--model.init_args.update.epochs_per_rollout=2",
            "--model.init_args.update.minibatches_per_rollout=2",
            "--trainer.max_steps=4",
        ],
        run=False,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # max_steps counts optimiser steps: 2 epochs x 2 mini-batches = 4 per rollout batch.
    assert cli.trainer.global_step == 4
    assert cli.model._rollout_step == 1


def test_validation_reports_pass_at_k_when_sampling_several():
    cli = build_cli(
        [
            "validate",
            "--config",
            CONFIG,
            "--model.init_args.val_sampling.group_size=3",
            "--model.init_args.val_sampling.temperature=1.0",
        ]
    )
    assert "val/pass@3" in cli.trainer.callback_metrics


def test_validate_from_a_checkpoint_keeps_the_configured_rewards(tmp_path):
    ckpt = [
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}",
        "--trainer.callbacks.save_last=true",
    ]
    _fit(
        tmp_path,
        *ckpt,
        "--model.init_args.rewards.functions=[rlvr_lightning.testing.digit_fraction,"
        "rlvr_lightning.rewards.boxed_format]",
        "--model.init_args.rewards.weights=[1.0,0.5]",
    )
    # LightningCLI re-reads the model's hyperparameters from the checkpoint; they must be complete.
    cli = build_cli(
        [
            "validate",
            "--config",
            CONFIG,
            f"--ckpt_path={tmp_path / 'ckpt' / 'last.ckpt'}",
            "--model.init_args.rewards.functions=[rlvr_lightning.testing.digit_fraction,"
            "rlvr_lightning.rewards.boxed_format]",
            "--model.init_args.rewards.weights=[1.0,0.5]",
        ]
    )
    assert cli.model.rewards.names == ["digit_fraction", "boxed_format"]
    assert "val/accuracy" in cli.trainer.callback_metrics


def test_python_api_checkpoint_resumes_with_function_arguments(tmp_path):
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rlvr_lightning import RLVRDataModule, RLVRModule, Sampling
    from rlvr_lightning.testing import digit_fraction

    def run(steps, ckpt_path=None):
        module = RLVRModule(
            "tiny:0",
            **grouped(
                reward_fns=[digit_fraction], sampling=Sampling(max_new_tokens=8, group_size=4)
            ),
        )
        data = RLVRDataModule(train_size=16, val_size=4, prompts_per_step=2)
        trainer = pl.Trainer(
            max_steps=steps,
            logger=False,
            enable_progress_bar=False,
            limit_val_batches=0,
            default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        )
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module, trainer

    module, _ = run(1)
    # Functions and dataclasses are stored as plain data: weights_only loading accepts them.
    assert module.hparams["rewards"]["functions"] == ["rlvr_lightning.testing.digit_fraction"]
    assert module.hparams["sampling"]["group_size"] == 4
    _, trainer = run(2, ckpt_path=tmp_path / "last.ckpt")
    assert trainer.global_step == 2
