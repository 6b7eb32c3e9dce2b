"""The asynchronous-rollout arguments of ``RLVRModule`` (top-level: ``rollout_mode``, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Asynchrony:
    """Asynchronous rollouts: the module's top-level arguments (``--model.init_args.rollout_mode
    =async``) kept together; ``asynchrony.queue`` has the schedule, README "Asynchronous rollouts".

    Args:
        rollout_mode: ``sync`` (each step trains what it generated) or ``async`` (the round
            composed at step ``s`` trains at step ``s + max_staleness``, under a policy that many
            versions newer, importance-corrected through ``correction``).
        max_staleness: policy versions a trained sample may lag (one version per update); a
            sample beyond it is dropped before the loss and counted (``async/dropped_rows``).
        deterministic_schedule: the generator is exactly ``max_staleness`` versions ahead, never
            racing (the in-process schedule), so a run resumes bit for bit.
    """

    rollout_mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1
    deterministic_schedule: bool = True

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(
                f"max_staleness is {self.max_staleness}; use >= 1 (versions a sample may lag; "
                "rollout_mode: sync trains every sample on the version that drew it)."
            )
        if not self.deterministic_schedule:
            raise ValueError(
                "deterministic_schedule: false needs a generator that races the trainer in its "
                "own process, which this version does not have; set it to true (the in-process "
                "schedule, exactly max_staleness versions ahead)."
            )
