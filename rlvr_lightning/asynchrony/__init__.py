"""Asynchronous rollouts: the queue of rounds generated ahead of the update (with the policy
version that produced them), the deterministic schedule that fills and drains it, and the
weight-sync fingerprint. Between ``rollout`` and ``options``: it reads batch types and
engines, never the module; ``stages.asynchronous`` puts it into the step."""

from rlvr_lightning.asynchrony.fingerprint import WeightSync, WeightSyncError, fingerprint
from rlvr_lightning.asynchrony.plain import from_plain, to_plain
from rlvr_lightning.asynchrony.queue import QueuedRound, RolloutQueue

__all__ = [
    "QueuedRound",
    "RolloutQueue",
    "WeightSync",
    "WeightSyncError",
    "fingerprint",
    "from_plain",
    "to_plain",
]
