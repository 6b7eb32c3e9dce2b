"""Logging that works the first time, through ``rlvr-lightning fit``: train metrics every step,
the gradient norm before and after clipping, completions on file by default, and pass@k with its
interval and sample count in the log and the model card."""

import csv
import json
from pathlib import Path

import pytest
from rlvr_lightning.callbacks import CompletionsTable

from rlvr_lightning.cli.main import COMPLETIONS_ROWS, build_cli

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
STEPS = 3


def _fit(tmp_path: Path, *extra: str):
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.max_steps={STEPS}", *extra]  # fmt: skip
    return build_cli(args)


def test_train_metrics_are_logged_every_step_without_log_every_n_steps(tmp_path):
    logger = ["--trainer.logger=lightning.pytorch.loggers.CSVLogger",
              f"--trainer.logger.init_args.save_dir={tmp_path}"]  # fmt: skip
    cli = _fit(tmp_path, *logger)
    rows = list(csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")))
    steps = [r["step"] for r in rows if r.get("train/reward")]
    assert len(steps) == STEPS, steps  # Lightning's default of 50 logs only the last one


def test_grad_norm_is_logged_before_and_after_clipping(tmp_path):
    clip = 1e-4  # far below any gradient norm of the tiny model at lr 1e-3
    cli = _fit(tmp_path, f"--model.init_args.update.grad_clip={clip}")
    metrics = cli.trainer.logged_metrics
    assert float(metrics["train/grad_norm"]) > 100 * clip
    assert float(metrics["train/grad_norm_clipped"]) == pytest.approx(clip, rel=1e-3)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_completions_are_written_by_default_and_a_configured_table_replaces_it(tmp_path):
    cli = _fit(tmp_path / "default")
    tables = [cb for cb in cli.trainer.callbacks if isinstance(cb, CompletionsTable)]
    assert len(tables) == 1
    rows = _rows(tmp_path / "default" / "completions.jsonl")
    assert [r["step"] for r in rows] == [s for s in range(STEPS) for _ in range(COMPLETIONS_ROWS)]
    own = "--trainer.callbacks+=rlvr_lightning.callbacks.CompletionsTable"
    cli = _fit(tmp_path / "own", own, "--trainer.callbacks.max_rows=2",
               "--trainer.callbacks.every_n_steps=3")  # fmt: skip
    assert len([cb for cb in cli.trainer.callbacks if isinstance(cb, CompletionsTable)]) == 1
    assert len(_rows(tmp_path / "own" / "completions.jsonl")) == 2  # step 2 only, 2 rows
    _fit(tmp_path / "off", "--log_completions=false")
    assert not (tmp_path / "off" / "completions.jsonl").exists()


def test_pass_at_k_has_an_interval_and_counts_in_the_log_and_the_card(tmp_path):
    cli = _fit(
        tmp_path,
        "--evaluate_before_after=true",
        "--trainer.callbacks+=rlvr_lightning.callbacks.ExportModel",
        "--model.init_args.val_sampling={max_new_tokens: 8, temperature: 1.0, group_size: 4}",
    )
    m = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    assert m["val/pass@4_prompts"] == 8 and m["val/pass@4_samples"] == 32  # val_size 8, G 4
    assert 0 <= m["val/pass@4_ci95_low"] <= m["val/pass@4"] <= m["val/pass@4_ci95_high"] <= 1
    card = (tmp_path / "model" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| val/pass@4 |"))
    assert row.count("95% CI") == 2 and row.count("32 samples over 8 prompts") == 2, row
    assert "pass@4_ci95_low" not in card.split("## Training recipe")[0]
