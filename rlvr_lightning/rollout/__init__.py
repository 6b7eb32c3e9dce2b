"""Rollout engines. The vLLM engine is imported only when it is chosen."""

from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.hf import HFEngine

__all__ = ["HFEngine", "RolloutEngine"]
