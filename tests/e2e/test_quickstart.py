"""The quickstart on the embedded model, shortened to two steps (slow tier)."""

from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.cli import main

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
