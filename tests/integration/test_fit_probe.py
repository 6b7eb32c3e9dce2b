"""POISE (estimator probe, G = 2): a tiny fit past the bootstrap, the checkpoint and resume
round trips, the export, and the setup errors."""

from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.heads import ProbeHead
from rlvr_lightning.hub import export_pretrained, module_heads
from rlvr_lightning.testing import checkpointing_args

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
HEAD = (
    '--model.init_args.probe_head={"class_path": "rlvr_lightning.heads.ProbeHead", '
    '"init_args": {"bootstrap_steps": 1, "warmup_steps": 1, "prompt_pca": 4, '
    '"response_pca": 4, "last_tokens": 3, "buffer_rows": 6}}'
)
G2 = "--model.init_args.sampling={max_new_tokens: 8, temperature: 1.0, group_size: 2}"


def _cli(tmp_path, *extra, run=False):
    args = [
        "--config",
        CONFIG,
        "--model.init_args.estimator=probe",
        HEAD,
        G2,
        *checkpointing_args(tmp_path),
        *extra,
    ]
    return build_cli(["fit", *args] if run else args, run=run)


def _probe_state(module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if k.startswith("probe_head.")}


def test_probe_fit_with_g2_runs_past_the_bootstrap_and_the_checkpoint_restores_it(tmp_path):
    cli = _cli(tmp_path)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    head = cli.model.probe_head
    assert cli.trainer.global_step == 2 and int(head.steps_observed) == 2
    assert head.active  # fitted after step 0; step 1 used the probe's baseline
    logged = cli.trainer.logged_metrics
    for key in ("fitted", "active", "buffer_rows", "fit_r2", "fit_corr"):
        assert torch.isfinite(logged[f"train/probe/{key}"]), key
    assert float(logged["train/probe/fitted"]) == 1.0
    # 2 steps x 2 prompts x G = 2 = 8 rows over a capacity of 6: the oldest group went.
    assert float(logged["train/probe/buffer_rows"]) == 6.0
    assert head.buffer_groups[:6].tolist() == [1, 1, 2, 2, 3, 3]
    assert torch.isfinite(logged["train/adv_abs_mean"])
    assert module_heads(cli.model) == {"probe_head": head}  # ExportModel writes it
    assert list(cli.model.optimizers().param_groups[0]["params"]) == [
        p for p in cli.model.policy.parameters() if p.requires_grad
    ]  # the probe has buffers only, no optimiser group

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    trained = _probe_state(cli.model)
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in trained.items())
    fresh = _cli(tmp_path / "fresh").model
    assert not fresh.probe_head.fitted
    fresh.load_state_dict(saved["state_dict"])
    assert all(torch.equal(v, trained[k]) for k, v in _probe_state(fresh).items())
    assert fresh.probe_head.active

    # The export loads on its own and scores rollouts as the trained head does.
    export_pretrained(
        cli.model.policy, cli.model.tokenizer, tmp_path / "model", heads=module_heads(cli.model)
    )
    loaded = ProbeHead.from_pretrained(tmp_path / "model")
    batch = next(iter(cli.datamodule.val_dataloader()[0]))  # [1]: val asked in other words
    rows = cli.model.rollout(batch)
    policy = cli.model.policy
    torch.testing.assert_close(
        loaded.score_rollouts(policy, rows), head.score_rollouts(policy, rows)
    )


def test_probe_fit_resumes_with_its_buffer_and_counters(tmp_path):
    _cli(tmp_path, run=True)
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=True)["state_dict"]
    assert int(saved["probe_head.steps_observed"]) == 2
    cli = _cli(tmp_path, "--trainer.max_steps=3", f"--ckpt_path={last}", run=True)
    head = cli.model.probe_head
    assert cli.trainer.global_step == 3 and int(head.steps_observed) == 3
    # The resumed buffer went on from the saved one: its newest group (rows 4-5) is now the
    # oldest, then the step's 2 groups, numbered on from the saved counter.
    assert torch.equal(head.buffer_features[:2], saved["probe_head.buffer_features"][4:6])
    assert head.buffer_groups[:6].tolist() == [3, 3, 4, 4, 5, 5]


def test_probe_with_trainer_old_logprobs_takes_features_from_the_same_pass(tmp_path):
    cli = _cli(tmp_path, "--model.init_args.correction.old_logprobs=trainer")
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    logged = cli.trainer.logged_metrics
    assert "train/mismatch/kl" in logged  # the π_old pass ran, and gave the features too
    assert float(logged["train/probe/fitted"]) == 1.0


def test_probe_without_a_head_and_a_head_without_probe_are_setup_errors():
    with pytest.raises(ValueError, match="probe_head"):
        build_cli(["--config", CONFIG, "--model.init_args.estimator=probe"], run=False)
    with pytest.raises(ValueError, match="estimator: probe"):
        build_cli(["--config", CONFIG, HEAD], run=False)
    gae_head = '--model.init_args.value_head={"class_path": "rlvr_lightning.heads.ValueHead"}'
    with pytest.raises(ValueError, match="estimator: gae"):
        build_cli(
            ["--config", CONFIG, "--model.init_args.estimator=probe", HEAD, gae_head], run=False
        )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_poise_probe_config_runs_with_a_tiny_model(tmp_path):
    config = Path(__file__).parents[2] / "configs" / "poise_probe.yaml"
    cli = build_cli(
        [
            "fit", "--config", str(config), "--evaluate_before_after=false",
            "--model.init_args.policy=tiny:0", "--model.init_args.engine=hf",
            "--model.init_args.sampling={max_new_tokens: 6, temperature: 1.0, group_size: 2}",
            "--trainer.precision=32-true", "--trainer.max_steps=2",
            f"--trainer.default_root_dir={tmp_path}", "--trainer.logger=false",
            "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
            "--data.init_args.val_size=4", "--data.init_args.prompts_per_step=4",
        ]
    )  # fmt: skip
    head = cli.model.probe_head
    assert cli.model.estimator == "probe" and cli.model.sampling.group_size == 2
    assert int(head.steps_observed) == 2 and head.fitted  # warm-up 2: fitted after step 2
    assert head.reward_range == (0.0, 1.5)
