"""The rounds generated ahead of the update, oldest first, and the deterministic schedule.

The in-process schedule is a delay line: the round composed at rollout step ``s`` is generated
(and scored) at once by the policy the trainer holds, version ``v``, and trained at step
``s + k`` (``k`` = ``max_staleness``), by version ``v + k``: the generator is exactly ``k``
versions ahead, never racing, so a run is a function of its seed and can be resumed bit for
bit (the first ``k`` rounds are drawn by version 0, before any update, and lag ``0 .. k-1``
versions). The first ``k`` steps only fill the queue (no optimiser step:
``trainer.max_steps``, which counts optimiser steps, still gives the same number of updates);
the last ``k`` rounds of a run are generated but never trained (they are in its last
checkpoint, for a resume).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from rlvr_lightning.algorithms.staleness import staleness, within_staleness
from rlvr_lightning.asynchrony.plain import from_plain, register, to_plain
from rlvr_lightning.types import PromptBatch, Scored


@register
@dataclass(frozen=True)
class QueuedRound:
    """One generated and scored round waiting for the update.

    Args:
        batch: the prompts as the rollout hooks left them ``[B]``.
        scored: their rows ``[N]``, scored and through ``on_after_score``.
        version: the policy version that generated every row.
        step: the rollout step that composed it.
        served: prompts the data module served again in that step (replays, bank refills),
            handed back when its outcome is reported.
    """

    batch: PromptBatch
    scored: Scored
    version: int
    step: int
    served: list[str] = field(default_factory=list)


class RolloutQueue:
    """Rounds waiting for the update, oldest first; dropped ones counted."""

    def __init__(self) -> None:
        self.rounds: deque[QueuedRound] = deque()
        self.dropped_rounds = 0  # over the run
        self.dropped_rows = 0

    def __len__(self) -> int:
        return len(self.rounds)

    def put(self, queued: QueuedRound) -> None:
        self.rounds.append(queued)

    def take(self, version: int, max_staleness: int, ahead: int) -> QueuedRound | None:
        """The oldest round that may train under ``version``, once more than ``ahead`` rounds
        wait (the delay line); None while the queue fills. A round any of whose rows lags more
        than ``max_staleness`` versions is dropped whole and counted (its groups were composed
        as one step): no row of it reaches the loss."""
        while len(self.rounds) > ahead:
            queued = self.rounds.popleft()
            versions = torch.full((queued.scored.rollouts.num_rows,), queued.version)  # [N]
            if bool(within_staleness(version, versions, max_staleness).all()):
                return queued
            self.dropped_rounds += 1
            self.dropped_rows += queued.scored.rollouts.num_rows
        return None

    def lags(self, version: int) -> list[int]:
        """Staleness each waiting round would have under ``version``."""
        versions = torch.tensor([q.version for q in self.rounds], dtype=torch.long)  # [R]
        return staleness(version, versions).tolist()

    def state_dict(self) -> dict[str, Any]:
        """Plain data (``asynchrony.plain``): loads with ``weights_only=True``."""
        return {
            "rounds": [to_plain(q) for q in self.rounds],
            "dropped_rounds": self.dropped_rounds,
            "dropped_rows": self.dropped_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = deque(from_plain(q) for q in state["rounds"])
        self.dropped_rounds = state["dropped_rounds"]
        self.dropped_rows = state["dropped_rows"]
