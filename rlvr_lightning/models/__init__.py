"""Models: loading a policy by name (local folder, Hub id, the embedded default, ``tiny:``),
LoRA, the frozen reference copy, the embedded GGUF conversion and the in-process tiny model.

May import: ``types``, ``algorithms``, ``device`` (``prepare_model``) and ``hub``.
"""

from rlvr_lightning.models.embedded import (
    CACHE_ENV,
    EMBEDDED_DEFAULT,
    cache_dir,
    embedded_model_path,
    gguf_parsed_once,
)
from rlvr_lightning.models.loading import add_lora, frozen_copy, load_policy, resolve_dtype

__all__ = [
    "CACHE_ENV",
    "EMBEDDED_DEFAULT",
    "add_lora",
    "cache_dir",
    "embedded_model_path",
    "frozen_copy",
    "gguf_parsed_once",
    "load_policy",
    "resolve_dtype",
]
