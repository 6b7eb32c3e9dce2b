"""Heads on the policy's hidden states: the critic of the ``gae`` estimator (``ValueHead``)."""

from rlvr_lightning.heads.value import ValueBatch, ValueHead

__all__ = ["ValueBatch", "ValueHead"]
