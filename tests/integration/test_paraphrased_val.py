"""``val/accuracy_paraphrased``: the second validation split, logged under its own name."""

from pathlib import Path

from rlvr_lightning.cli.main import build_cli

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
SPLIT_KEYS = {"val/accuracy_paraphrased", "val/reward_paraphrased"}


def test_a_tiny_fit_logs_both_splits_without_loader_suffixes(tmp_path, capsys):
    cli = build_cli(
        [
            "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
            "--evaluate_before_after=true",
        ]
    )  # fmt: skip
    logged = set(cli.trainer.logged_metrics)
    assert {"val/accuracy", "val/reward"} | SPLIT_KEYS <= logged
    assert not any("dataloader_idx" in key for key in logged)
    printed = capsys.readouterr().out
    assert "val/accuracy_paraphrased" in printed and "val/accuracy " in printed


def test_pass_at_k_of_the_split_has_its_own_name(tmp_path):
    cli = build_cli(
        [
            "validate", "--config", CONFIG, "--model.init_args.val_sampling.group_size=2",
            "--model.init_args.val_sampling.temperature=1.0",
        ]
    )  # fmt: skip
    metrics = set(cli.trainer.callback_metrics)
    assert {"val/pass@2", "val/pass@2_paraphrased", "val/pass@2_ci95_low_paraphrased"} <= metrics


def test_off_logs_no_split(tmp_path):
    cli = build_cli(["validate", "--config", CONFIG, "--data.init_args.paraphrased_val=false"])
    assert "val/accuracy" in cli.trainer.callback_metrics
    assert not SPLIT_KEYS & set(cli.trainer.callback_metrics)


def test_a_training_question_form_of_the_split_is_refused_by_the_cli(capsys):
    import pytest

    from rlvr_lightning.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main([
            "fit", "--config", CONFIG,
            "--data.init_args.task_config={digits: 1, question_forms: ['{a} + {b} = ?']}",
        ])  # fmt: skip
    err = capsys.readouterr().err
    assert stop.value.code == 1 and "Traceback" not in err, err
    assert "'{a} + {b} = ?' is a question form of the paraphrased validation split" in err
