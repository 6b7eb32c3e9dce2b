"""Exports that load anywhere, through the CLI: an adapter-only export of a LoRA run records
its base model (``AutoPeftModelForCausalLM`` loads it), ``--base-model`` names another, and
``export --import`` reads the checkpoint of a module subclass."""

import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from peft import AutoPeftModelForCausalLM

from rlvr_lightning.cli.main import build_cli, main
from rlvr_lightning.models.tiny import tiny_policy

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
IDS = torch.tensor([[5, 6, 7, 8]])  # [1, 4]
EXPORT = "--trainer.callbacks+=rlvr_lightning.callbacks.ExportModel"


def _fit(root: Path, *extra: str):
    return build_cli(["fit", "--config", CONFIG, f"--trainer.default_root_dir={root}", *extra])


def _local_base(tmp_path: Path) -> Path:
    model, tokenizer = tiny_policy(seed=0)
    base = tmp_path / "base"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


def test_an_adapter_only_export_loads_with_auto_peft(tmp_path, caplog, capsys):
    base = _local_base(tmp_path)
    lora = [f"--model.init_args.policy={base}", "--model.init_args.lora.rank=4"]
    with caplog.at_level(logging.WARNING):
        cli = _fit(tmp_path, *lora, EXPORT, "--trainer.callbacks.adapter_only=true")
    assert "will not resolve on another machine" in caplog.text
    folder = tmp_path / "model"
    recorded = json.loads((folder / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == str(base.resolve())
    loaded = AutoPeftModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        expected = cli.model.policy.eval()(IDS).logits  # [1, 4, V]
        assert torch.allclose(loaded(IDS).logits, expected, atol=1e-5, rtol=0)

    ckpt = tmp_path / "run.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    out = tmp_path / "named"
    main(["export", str(ckpt), "--adapter-only", "--base-model", "org/base", "--output", str(out)])
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "org/base"
    )
    assert 'AutoModelForCausalLM.from_pretrained("org/base")' in (out / "README.md").read_text()

    # An adapter folder without a base fails at once with the fix (not 30 s of Hub retries).
    recorded["base_model_name_or_path"] = None
    (folder / "adapter_config.json").write_text(json.dumps(recorded))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, f"--model.init_args.policy={folder}"])
    assert exit_info.value.code == 1
    assert "records no base model" in capsys.readouterr().err


SUBCLASS = """
import torch
from rlvr_lightning import RLVRModule


class SignAdvantages(RLVRModule):
    def compute_advantages(self, scored):
        return torch.sign(super().compute_advantages(scored))
"""


def test_export_reads_the_checkpoint_of_a_module_subclass_with_import(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "my_steps.py").write_text(textwrap.dedent(SUBCLASS))
    monkeypatch.syspath_prepend(str(src))
    cli = _fit(tmp_path, "--model.class_path=my_steps.SignAdvantages")
    assert type(cli.model).__name__ == "SignAdvantages"
    ckpt = tmp_path / "run.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    sys.modules.pop("my_steps")  # a fresh `rlvr-lightning export` has not imported it
    with pytest.raises(SystemExit, match=r"my_steps\.SignAdvantages.*`--import my_steps`"):
        main(["export", str(ckpt), "--output", str(tmp_path / "refused")])
    out = tmp_path / "exported"
    main(["export", str(ckpt), "--import", str(src / "my_steps.py"), "--output", str(out)])
    assert {"model.safetensors", "config.json", "README.md"} <= {p.name for p in out.iterdir()}
    sys.modules.pop("my_steps", None)
