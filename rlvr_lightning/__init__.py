"""rlvr-lightning: reinforcement learning with verifiable rewards on PyTorch Lightning.

The public names are imported on first use (PEP 562), so that ``rlvr-lightning --help`` and
small submodules load without torch and Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlvr_lightning.data import RLVRDataModule
    from rlvr_lightning.module import RLVRModule
    from rlvr_lightning.stages.hooks import RLVRCallback
    from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored, StepOutput

_HOMES = {
    "PromptBatch": "rlvr_lightning.types",
    "RLVRCallback": "rlvr_lightning.stages.hooks",
    "RLVRDataModule": "rlvr_lightning.data",
    "RLVRModule": "rlvr_lightning.module",
    "Rollouts": "rlvr_lightning.types",
    "Sampling": "rlvr_lightning.types",
    "Scored": "rlvr_lightning.types",
    "StepOutput": "rlvr_lightning.types",
}
__all__ = [
    "PromptBatch",
    "RLVRCallback",
    "RLVRDataModule",
    "RLVRModule",
    "Rollouts",
    "Sampling",
    "Scored",
    "StepOutput",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'rlvr_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
