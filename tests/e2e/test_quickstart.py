"""The quickstart on the embedded model, shortened to two steps (slow tier)."""

from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.cli.main import main

ROOT = Path(__file__).parents[2]
pytestmark = pytest.mark.slow


def test_quickstart_two_steps_evaluates_trains_and_exports(tmp_path, capsys):
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.max_steps=2",
            "--data.init_args.val_size=8",
            "--data.init_args.prompts_per_step=4",
            "--model.init_args.sampling.group_size=4",
            "--model.init_args.sampling.max_new_tokens=24",
            "--model.init_args.val_sampling.max_new_tokens=24",
        ]
    )
    out = capsys.readouterr().out
    assert "Validation before -> after training" in out
    assert "val/accuracy" in out
    folder = tmp_path / "model"
    card = ModelCard.load(folder / "README.md")  # the rendered model card
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"rlvr", "grpo"} <= set(card.data.tags)
    assert {r.metric_name for r in card.data.eval_results} >= {"val/accuracy", "val/reward"}
    assert (folder / "reward_curve.png").exists() and str(tmp_path) not in card.content
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    with torch.no_grad():
        out_ids = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out_ids.shape[1] > ids.shape[1]


def test_embedded_conversion_parses_the_gguf_once(tmp_path, monkeypatch):
    """transformers looks GGUFReader up on the gguf module at call time; if it ever imports it
    at module level, gguf_parsed_once stops saving the two extra parses (~8 s of ~13 s)."""
    import gguf

    from rlvr_lightning import models

    opened = []

    class Counting(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            opened.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path))
    folder = models.embedded_model_path()
    assert len(opened) == 1, opened
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 30
    assert AutoTokenizer.from_pretrained(folder)("What is 8 + 2?")["input_ids"]
    assert torch.isfinite(model.get_input_embeddings().weight).all()
