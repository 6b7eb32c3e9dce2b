"""rlvr-lightning: reinforcement learning with verifiable rewards on PyTorch Lightning."""

from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.hooks import RLVRCallback
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored, StepOutput

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
