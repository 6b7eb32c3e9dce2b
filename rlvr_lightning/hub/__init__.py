"""The Hugging Face Hub: export, push and load models (``transfer``), model cards
(``model_card``, ``card_safety``) and the ``rlvr-lightning push`` / ``export`` commands
(``push_cli``).

``from rlvr_lightning import hub`` gives the transfer functions (``hub.push_folder``,
``hub.resolve_hub_model``, ...); the card modules are imported on their own
(``from rlvr_lightning.hub import model_card``) so that loading a model stays light.
"""

from rlvr_lightning.hub.transfer import (
    DEFAULT_HEADS,
    HEADS_SUFFIX,
    export_pretrained,
    folder_files,
    is_hub_name,
    is_retryable,
    load_head,
    module_heads,
    push_folder,
    resolve_hub_model,
    save_heads,
    split_revision,
    with_retries,
)

__all__ = [
    "DEFAULT_HEADS",
    "HEADS_SUFFIX",
    "export_pretrained",
    "folder_files",
    "is_hub_name",
    "is_retryable",
    "load_head",
    "module_heads",
    "push_folder",
    "resolve_hub_model",
    "save_heads",
    "split_revision",
    "with_retries",
]
