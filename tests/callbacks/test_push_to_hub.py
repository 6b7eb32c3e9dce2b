"""PushToHub and ExportModel in tiny ``fit`` runs against a loopback FakeHub."""

import logging
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from rlvr_lightning.callbacks import ExportModel, PushToHub
from rlvr_lightning.callbacks.push_to_hub import push_due
from transformers import AutoModelForCausalLM

from rlvr_lightning.cli.main import build_cli, reset_metric_states

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def _cli(tmp_path, *extra):
    args = ["--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", *extra]
    return build_cli(args, run=False)


def _fit_with(tmp_path, callback, max_steps=3):
    cli = _cli(tmp_path, f"--trainer.max_steps={max_steps}")
    cli.trainer.callbacks.append(callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cli


def test_pushes_every_n_steps_to_a_branch_and_the_final_model_to_main(tmp_path, fake_hub):
    with fake_hub() as hub:
        push = PushToHub("me/tiny", every_n_steps=1, checkpoint_branch="training", endpoint=hub.url)
        cli = _fit_with(tmp_path, push, max_steps=3)
        repo = hub.repos["me/tiny"]
    assert [c["revision"] for c in repo.commits] == ["training", "training", "main"]
    assert [c["summary"] for c in repo.commits][:2] == ["Training step 1", "Training step 2"]
    main = repo.branches["main"]
    assert {"model.safetensors", "config.json", "README.md", "reward_curve.png"} <= set(main)
    assert repo.private is True
    local = tmp_path / "model"
    assert main["model.safetensors"] == (local / "model.safetensors").read_bytes()
    card = ModelCard(main["README.md"].decode())
    assert "rlvr" in card.data.tags and card.data.model_name == "tiny"
    assert 'from_pretrained("me/tiny")' in card.text
    loaded = AutoModelForCausalLM.from_pretrained(local)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, cli.model.policy(ids).logits, atol=1e-5)
    assert push.failed_pushes == 0 and len(push.pushed) == 3


def test_a_failing_hub_keeps_the_export_and_does_not_stop_training(tmp_path, caplog, fake_hub):
    slept: list[float] = []
    with fake_hub(fail_with=500) as hub:
        push = PushToHub("me/tiny", every_n_steps=1, retries=2, backoff_s=0.25, endpoint=hub.url)
        push._sleep = slept.append
        with caplog.at_level(logging.WARNING):
            cli = _fit_with(tmp_path, push, max_steps=3)
    assert cli.trainer.global_step == 3 and not cli.trainer.interrupted
    assert push.pushed == [] and push.failed_pushes == 3  # steps 1, 2 and the end of fit
    assert slept == [0.25, 0.5] * 3
    local = tmp_path / "model"
    assert (local / "model.safetensors").exists() and (local / "README.md").exists()
    assert AutoModelForCausalLM.from_pretrained(local) is not None
    assert "the export in" in caplog.text.lower() and "rlvr-lightning push" in caplog.text


def test_validation_after_fit_completes_and_repushes_the_card(tmp_path, fake_hub):
    with fake_hub() as hub:
        push = PushToHub("me/tiny", endpoint=hub.url)
        cli = _cli(tmp_path, "--trainer.max_steps=2")  # tiny.yaml validates inside fit too
        cli.trainer.callbacks.append(push)
        # What `evaluate_before_after` does: validate, fit, validate.
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        reset_metric_states(cli.model)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        repo = hub.repos["me/tiny"]
    assert sorted(repo.commits[-1]["files"]) == ["README.md", "reward_curve.png"]
    card = repo.branches["main"]["README.md"].decode()
    before, after = push.record.before_after()
    assert before is not None and after is not None
    row = f"| val/reward | {before['val/reward']:.4f} | {after['val/reward']:.4f} |"
    assert row in card
    assert card == (tmp_path / "model" / "README.md").read_text()


def test_only_global_rank_zero_exports(tmp_path, monkeypatch):
    export = ExportModel(dirpath="out")
    cli = _cli(tmp_path, "--trainer.max_steps=1")
    cli.trainer.callbacks.append(export)
    monkeypatch.setattr(type(cli.trainer), "is_global_zero", property(lambda self: False))
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert export.exported_to is None and not (tmp_path / "out").exists()


def test_record_survives_a_checkpoint_round_trip():
    export = ExportModel()
    export.record.add_step(0, 0.5, 0.25, tokens=40)
    export.record.add_validation(0, {"val/accuracy": 0.1})
    restored = ExportModel()
    restored.load_state_dict(export.state_dict())
    assert restored.record == export.record


@pytest.mark.parametrize(
    ("step", "last", "every", "due"),
    [
        (10, 0, 10, True),
        (9, 0, 10, False),
        (12, 9, 10, True),  # advanced by 3 (epochs_per_rollout=3) across step 10
        (18, 12, 10, False),
        (5, 0, 0, False),  # every_n_steps=0: only the end of fit
    ],
)
def test_push_due_when_a_multiple_is_crossed(step, last, every, due):
    assert push_due(step, last, every) is due
