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
            racing (in this process, or a worker process decoding one round during the
            update: ``rollout.process``), so a run resumes bit for bit.
        concurrent_rollouts: partial rollouts (CoPRIS), ``async`` only: at most this many
            groups decode at once; a step decodes until it has as many finished groups as it
            trains (early termination), trains those at once, and the unfinished rows keep
            their tokens and behaviour log-probs and continue under the next version
            (cross-stage IS). None: off (the delay line above). At least the step's prompts.
        partial_chunk_tokens: tokens decoded between two counts of finished groups (this
            project's choice: CoPRIS counts after every token in its engine; each chunk here
            costs one prefill of the rows' contexts).
    """

    rollout_mode: Literal["sync", "async"] = "sync"
    max_staleness: int = 1
    deterministic_schedule: bool = True
    concurrent_rollouts: int | None = None
    partial_chunk_tokens: int = 16

    @property
    def partial(self) -> bool:
        """Whether partial rollouts are on."""
        return self.rollout_mode == "async" and self.concurrent_rollouts is not None

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(
                f"max_staleness is {self.max_staleness}; use >= 1 (versions a sample may lag; "
                "rollout_mode: sync trains every sample on the version that drew it)."
            )
        if not self.deterministic_schedule:
            raise ValueError(
                "deterministic_schedule: false would let the generator race the trainer, and no "
                "such run could be resumed exactly, so it is not built; set it to true (the "
                "generator exactly max_staleness versions ahead, in a worker process or not)."
            )
        self._check_partial()

    def _check_partial(self) -> None:
        if self.concurrent_rollouts is None:
            return
        if self.rollout_mode != "async":
            raise ValueError(
                "concurrent_rollouts (partial rollouts) continues unfinished rows under the "
                "next policy version; set rollout_mode: async too, or leave it null."
            )
        if self.concurrent_rollouts < 1 or self.partial_chunk_tokens < 1:
            raise ValueError(
                f"concurrent_rollouts ({self.concurrent_rollouts}) and partial_chunk_tokens "
                f"({self.partial_chunk_tokens}) must be >= 1: groups decoding at once, and "
                "tokens between two counts of finished groups."
            )
