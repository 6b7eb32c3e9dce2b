"""The CLI around the Hub: validation before/after fit with validation inside fit too, and
``rlvr-lightning push`` of a checkpoint (exported first) to a loopback FakeHub."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from rlvr_lightning.callbacks import ExportModel
from torchmetrics import MeanMetric
from transformers import AutoModelForCausalLM

from rlvr_lightning.cli.main import build_cli, main, reset_metric_states

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
IDS = torch.tensor([[5, 6, 7, 8]])  # [1, 4]


def _fit(tmp_path: Path, *extra: str):
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", *extra]
    return build_cli(args)


def test_metric_states_left_by_inference_mode_are_reset_to_normal_tensors():
    metric = MeanMetric()
    with torch.inference_mode():  # what trainer.validate does: update, compute, reset
        metric.update(torch.tensor([1.0, 0.0]))
        metric.compute()
        metric.reset()  # re-creates the states, as inference tensors
    with torch.no_grad(), pytest.raises(RuntimeError, match="inference tensor"):
        metric.update(torch.tensor([1.0]))  # what a validation inside fit does
    reset_metric_states(torch.nn.ModuleDict({"m": metric}))
    with torch.no_grad():
        metric.update(torch.tensor([1.0, 0.0]))
    assert float(metric.compute()) == 0.5


def test_evaluate_before_after_with_validation_inside_fit(tmp_path, capsys):
    cli = _fit(
        tmp_path,
        "--evaluate_before_after=true",
        "--trainer.val_check_interval=1",  # validation after every step inside fit as well
        "--trainer.callbacks+=rlvr_lightning.callbacks.ExportModel",
    )
    assert "Validation before -> after training" in capsys.readouterr().out
    export = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ExportModel))
    # before fit (step 0), inside fit after steps 1 and 2, after fit (step 2).
    assert [v["step"] for v in export.record.validations] == [0, 1, 2, 2]
    card = ModelCard.load(tmp_path / "model" / "README.md")
    before, after = export.record.before_after()
    row = f"| val/reward | {before['val/reward']:.4f} | {after['val/reward']:.4f} |"
    assert row in card.text
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results == {k: round(v, 4) for k, v in after.items()}


def _checkpoint(tmp_path: Path, *extra: str):
    cli = _fit(tmp_path, "--trainer.callbacks+=rlvr_lightning.callbacks.ExportModel", *extra)
    ckpt = tmp_path / "run.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    return cli, ckpt


def test_push_a_checkpoint_exports_it_with_a_card_and_uploads(tmp_path, capsys, fake_hub):
    cli, ckpt = _checkpoint(tmp_path)
    with fake_hub() as hub:
        main(["push", str(ckpt), "--repo-id", "me/from-ckpt", "--endpoint", hub.url])
        received = hub.files("me/from-ckpt")
        private = hub.repos["me/from-ckpt"].private
    assert private is True  # private unless --public
    assert {"model.safetensors", "config.json", "README.md", "reward_curve.png"} <= set(received)
    folder = tmp_path / "run-export"
    assert received["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        expected = cli.model.policy.eval()(IDS).logits  # [1, 4, V]
        assert torch.allclose(loaded(IDS).logits, expected, atol=1e-5, rtol=0)
    card = ModelCard(received["README.md"].decode())
    assert "rlvr" in card.data.tags and 'from_pretrained("me/from-ckpt")' in card.text
    assert "| rollout steps | 2 |" in card.text  # the training record came from the checkpoint
    assert str(tmp_path) not in card.content
    assert "Pushed" in capsys.readouterr().out


def test_push_a_lora_checkpoint_as_an_adapter(tmp_path, fake_hub):
    _, ckpt = _checkpoint(tmp_path, "--model.init_args.lora.rank=2")
    with fake_hub() as hub:
        main(["push", str(ckpt), "--repo-id", "me/adapter", "--endpoint", hub.url, "--public"])
        main(
            [
                "push",
                str(ckpt),
                "--repo-id",
                "me/adapter",
                "--endpoint",
                hub.url,
                "--adapter-only",
                "--export-dir",
                str(tmp_path / "adapter"),
                "--revision",
                "lora",
            ]
        )
        repo = hub.repos["me/adapter"]
    assert repo.private is False
    assert "model.safetensors" in repo.branches["main"]
    lora = repo.branches["lora"]
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(lora)
    assert json.loads(lora["adapter_config.json"])["base_model_name_or_path"] is None  # tiny:0
    assert "PeftModel.from_pretrained" in lora["README.md"].decode()
