"""Heads on the policy's hidden states: the critic of the ``gae`` estimator (``ValueHead``)
and the maths of POISE's probe (``probe.py``)."""

from rlvr_lightning.heads.value import ValueBatch, ValueHead

__all__ = ["ValueBatch", "ValueHead"]
