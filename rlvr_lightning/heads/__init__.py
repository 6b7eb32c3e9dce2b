"""Heads on the policy's hidden states: the critic of the ``gae`` estimator (``ValueHead``)
and POISE's probe of the ``probe`` estimator (``ProbeHead``; its maths in ``probe.py``)."""

from rlvr_lightning.heads.probe_head import ProbeHead
from rlvr_lightning.heads.value import ValueBatch, ValueHead

__all__ = ["ProbeHead", "ValueBatch", "ValueHead"]
