"""Export of the trained policy as a folder ``from_pretrained`` loads."""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


def export_pretrained(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, dirpath: str | Path
) -> Path:
    """Save weights (safetensors), config, generation config and tokenizer to ``dirpath``.

    A LoRA policy is merged into a copy of its base model first, so the folder is a plain
    ``AutoModelForCausalLM`` checkpoint; the training model itself is left untouched.
    """
    path = Path(dirpath)
    path.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "merge_and_unload"):
        import copy

        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
