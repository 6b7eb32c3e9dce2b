"""Export round trips: the folder loads back with the same logits (tiny fp32 models)."""

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlvr_lightning.hub import export_pretrained, load_head, module_heads, save_heads
from rlvr_lightning.models import add_lora
from rlvr_lightning.testing import tiny_policy

IDS = torch.tensor([[5, 6, 7, 8, 40, 41], [9, 10, 11, 12, 13, 14]])  # [2, 6]


def _logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits  # [2, 6, V]


def _lora_policy() -> nn.Module:
    model, _ = tiny_policy(seed=1)
    peft = add_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    # LoRA starts as a no-op (B = 0); random B makes the adapter change the logits.
    gen = torch.Generator().manual_seed(0)
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.5
    return peft


def test_full_export_round_trip_gives_equal_logits(tmp_path):
    model, tokenizer = tiny_policy(seed=0)
    export_pretrained(model, tokenizer, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.allclose(_logits(loaded), _logits(model), atol=1e-5, rtol=0)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.chat_template == tokenizer.chat_template
    assert (tmp_path / "generation_config.json").exists()
    assert (tmp_path / "model.safetensors").exists()


def test_lora_is_merged_into_a_copy(tmp_path):
    peft = _lora_policy()
    expected = _logits(peft)
    base_only = _logits(peft.get_base_model().__class__(peft.get_base_model().config))
    export_pretrained(peft, tiny_policy()[1], tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.allclose(_logits(loaded), expected, atol=1e-5, rtol=0)
    assert not torch.allclose(expected, base_only, atol=1e-3)  # the adapter mattered
    assert not (tmp_path / "adapter_config.json").exists()
    assert hasattr(peft, "peft_config"), "the training model must stay a PeftModel"
    assert any("lora_A" in n for n, _ in peft.named_parameters())


def test_adapter_only_round_trip_with_peft(tmp_path):
    from peft import PeftModel

    peft = _lora_policy()
    expected = _logits(peft)
    export_pretrained(
        peft, tiny_policy()[1], tmp_path, adapter_only=True, base_model="org/base-model"
    )
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/base-model"
    assert (tmp_path / "adapter_model.safetensors").exists()
    assert not (tmp_path / "model.safetensors").exists()
    base, _ = tiny_policy(seed=1)  # same seed, same base weights
    loaded = PeftModel.from_pretrained(base, tmp_path)
    assert torch.allclose(_logits(loaded), expected, atol=1e-5, rtol=0)
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template


def test_adapter_only_needs_a_lora_policy(tmp_path):
    model, tokenizer = tiny_policy()
    with pytest.raises(ValueError, match="lora_rank"):
        export_pretrained(model, tokenizer, tmp_path, adapter_only=True)


class _WithHeads(nn.Module):
    hub_heads = ("value_head", "probe_head", "missing_head")

    def __init__(self) -> None:
        super().__init__()
        self.value_head = nn.Linear(4, 1)
        self.probe_head = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
        self.missing_head = None


def test_listed_heads_are_saved_as_separate_safetensors(tmp_path):
    module = _WithHeads()
    heads = module_heads(module)
    assert list(heads) == ["value_head", "probe_head"]  # unset heads are skipped
    model, tokenizer = tiny_policy()
    export_pretrained(model, tokenizer, tmp_path, heads=heads)
    with safe_open(str(tmp_path / "value_head.safetensors"), "pt") as f:
        assert f.metadata()["class"] == "Linear"
        assert torch.equal(f.get_tensor("weight"), module.value_head.weight)
    with safe_open(str(tmp_path / "probe_head.safetensors"), "pt") as f:
        assert set(f.keys()) == {"0.weight", "0.bias"}


def test_value_and_probe_heads_are_found_without_hub_heads_and_load_back(tmp_path):
    module = nn.Module()
    module.value_head = nn.Linear(4, 1)
    module.probe_head = None  # absent: skipped
    heads = module_heads(module)
    assert list(heads) == ["value_head"]
    model, tokenizer = tiny_policy()
    export_pretrained(model, tokenizer, tmp_path, heads=heads)
    restored = load_head(nn.Linear(4, 1), tmp_path, "value_head")
    x = torch.randn(3, 4)
    assert torch.equal(restored(x), module.value_head(x))
    assert not (tmp_path / "probe_head.safetensors").exists()


def test_heads_must_be_modules_with_plain_names(tmp_path):
    class Bad(nn.Module):
        hub_heads = ("value_head",)
        value_head = 3

    with pytest.raises(TypeError, match="value_head"):
        module_heads(Bad())
    with pytest.raises(ValueError, match="plain file name"):
        save_heads({"../x": nn.Linear(1, 1)}, tmp_path)


def test_exported_config_keeps_no_local_path(tmp_path):
    model, tokenizer = tiny_policy()
    source = tmp_path / "source"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    reloaded = AutoModelForCausalLM.from_pretrained(source)  # _name_or_path = that folder
    export_pretrained(reloaded, tokenizer, tmp_path / "out")
    assert str(tmp_path) not in (tmp_path / "out" / "config.json").read_text()
