"""Per-prompt training history, filled from every ``StepOutput`` and saved in checkpoints.

The data module owns one ``PromptStats``; replay, the curriculum and callbacks read it through
``RLVRDataModule.stats``. Under DDP each rank sees only its share of a step, so the data module
gathers the observations of all ranks (``gather_observations``) before recording them: every
rank then holds the same statistics and makes the same data decisions.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlvr_lightning.types import StepOutput

Outcome = Literal["all_correct", "all_wrong", "mixed"]


def group_outcome(num_correct: int, group_size: int) -> Outcome:
    """``all_correct`` when ``k == G``, ``all_wrong`` when ``k == 0``, else ``mixed``."""
    if num_correct <= 0:
        return "all_wrong"
    return "all_correct" if num_correct >= group_size else "mixed"


@dataclass
class Observation:
    """What one step says about one prompt (plain data, so it crosses ranks cheaply).

    Args:
        prompt_id: the stable prompt id.
        num_correct: ``k``, correct members of the group.
        group_size: ``G``.
        reward_variance: unbiased variance of the group's rewards.
        trained: whether the group contributed to the update (filters may drop it).
        replayed: whether the data module served it as a replay (not as a fresh prompt).
    """

    prompt_id: str
    num_correct: int
    group_size: int
    reward_variance: float
    trained: bool = True
    replayed: bool = False

    @property
    def pass_rate(self) -> float:
        return self.num_correct / max(self.group_size, 1)


def observations(
    output: StepOutput, replayed: set[str] | frozenset[str] = frozenset()
) -> list[Observation]:
    """One ``Observation`` per group of a step output: the ``G`` rows the policy sampled
    (``StepOutput`` never holds injected members)."""
    k = output.correct.sum(dim=1).tolist()  # [B]
    trained = output.trained.tolist() if output.trained is not None else [True] * len(k)
    return [
        Observation(pid, int(k_i), output.group_size, float(v), bool(t), pid in replayed)
        for pid, k_i, v, t in zip(
            output.prompt_ids, k, output.group_variance.tolist(), trained, strict=True
        )
    ]


def gather_observations(local: list[Observation]) -> list[Observation]:
    """All ranks' observations in rank order (the local list when not distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(local)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [vars(o) for o in local])
    return [Observation(**o) for rank_obs in gathered for o in rank_obs]


@dataclass
class PromptRecord:
    """The history of one prompt.

    ``last_step`` is the data step at which it was last trained on (-1: never); ``seen`` counts
    every group generated for it, ``reused`` the times it was served as a replay. The bounded
    deques keep the most recent pass rates and outcomes, newest last.
    """

    last_step: int = -1
    seen: int = 0
    reused: int = 0
    last_variance: float = 0.0
    pass_rates: deque[float] = field(default_factory=deque)
    outcomes: deque[str] = field(default_factory=deque)

    @property
    def pass_rate(self) -> float | None:
        """The most recent pass rate (None before the first observation)."""
        return self.pass_rates[-1] if self.pass_rates else None


class PromptStats:
    """Per-prompt statistics keyed by the stable prompt id.

    Args:
        history: how many recent pass rates and outcomes each prompt keeps.
    """

    def __init__(self, history: int = 8) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}.")
        self.history = history
        self.records: dict[str, PromptRecord] = {}

    def record(self, step: int, observed: Sequence[Observation]) -> None:
        """Add the observations of data step ``step``."""
        for obs in observed:
            rec = self.records.get(obs.prompt_id)
            if rec is None:
                rec = self.records[obs.prompt_id] = PromptRecord(
                    pass_rates=deque(maxlen=self.history), outcomes=deque(maxlen=self.history)
                )
            rec.seen += 1
            rec.reused += int(obs.replayed)
            rec.last_variance = obs.reward_variance
            rec.pass_rates.append(obs.pass_rate)
            rec.outcomes.append(group_outcome(obs.num_correct, obs.group_size))
            if obs.trained:
                rec.last_step = step

    def get(self, prompt_id: str) -> PromptRecord | None:
        return self.records.get(prompt_id)

    def pass_rate(self, prompt_id: str) -> float | None:
        rec = self.records.get(prompt_id)
        return None if rec is None else rec.pass_rate

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self.records

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[str]:
        return iter(self.records)

    def outcome_fractions(self) -> dict[str, float]:
        """Fraction of tracked prompts whose latest group was all-correct / all-wrong / mixed."""
        latest = [rec.outcomes[-1] for rec in self.records.values() if rec.outcomes]
        n = max(len(latest), 1)
        return {name: latest.count(name) / n for name in ("all_correct", "all_wrong", "mixed")}

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "records": {
                pid: {
                    "last_step": r.last_step,
                    "seen": r.seen,
                    "reused": r.reused,
                    "last_variance": r.last_variance,
                    "pass_rates": list(r.pass_rates),
                    "outcomes": list(r.outcomes),
                }
                for pid, r in self.records.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = state["history"]
        self.records = {
            pid: PromptRecord(
                last_step=r["last_step"],
                seen=r["seen"],
                reused=r["reused"],
                last_variance=r["last_variance"],
                pass_rates=deque(r["pass_rates"], maxlen=self.history),
                outcomes=deque(r["outcomes"], maxlen=self.history),
            )
            for pid, r in state["records"].items()
        }
