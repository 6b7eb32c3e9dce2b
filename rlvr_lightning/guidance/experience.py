"""ExGRPO's experience pool: the run's own correct trajectories, bucketed by correct count.

Spec §4.2 (``ExGRPO/.../experience_bucket_manager.py``, ``weighted_bucket_sampler.py``). After
each step a question with ``k`` of ``K`` on-policy samples correct is retired when ``k == K``,
leaves the pool when ``k == 0``, and otherwise moves to bucket ``k``, its correct trajectories
stored with their behaviour log-probs. Questions are replayed by drawing buckets with
``P(k) ∝ N(k; K/2, sigma)`` (``sigma`` in counts, as the code; the paper's summaries use
accuracy units) and questions uniformly within a bucket. The state is plain data, so it goes
into checkpoints as is.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Trajectory:
    """A stored completion: tokens up to and including EOS, their behaviour log-probs and the
    temperature they were sampled at."""

    token_ids: list[int]
    behaviour_logp: list[float]
    temperature: float
    text: str


def bucket_probabilities(buckets: Sequence[int], group_size: int, sigma: float) -> list[float]:
    """``P(bucket k) ∝ exp(-(k - K/2)**2 / (2 sigma**2))`` over the given buckets.

    Hand check (``K = 4``, ``sigma = 1``): buckets 1, 2, 3 have densities ``e^-0.5, 1, e^-0.5``,
    so ``P = 0.2741, 0.4519, 0.2741``.
    """
    if sigma <= 0:
        raise ValueError(f"bucket sigma must be > 0, got {sigma}.")
    dens = [math.exp(-((k - group_size / 2) ** 2) / (2 * sigma**2)) for k in buckets]
    total = sum(dens)
    return [d / total for d in dens]


class ExperiencePool:
    """Bounded store of questions with their correct trajectories.

    Args:
        max_questions: questions kept; the oldest-inserted is dropped beyond it (this project's
            bound; ExGRPO's pool is bounded by the dataset).
        max_trajectories: trajectories kept per question, the newest ones.
        group_size: on-policy samples per question ``K`` (the centre of the bucket weights).
        sigma: width of the bucket weights, in correct counts.
    """

    def __init__(
        self, max_questions: int, max_trajectories: int, group_size: int, sigma: float = 1.0
    ) -> None:
        if max_questions < 1 or max_trajectories < 1:
            raise ValueError("max_questions and max_trajectories must both be >= 1.")
        self.max_questions, self.max_trajectories = max_questions, max_trajectories
        self.group_size, self.sigma = group_size, sigma
        self.entries: dict[str, dict[str, Any]] = {}  # prompt id -> question, bucket, trajectories
        self.retired: set[str] = set()

    def __len__(self) -> int:
        return sum(1 for e in self.entries.values() if e["trajectories"])

    def record(
        self,
        prompt_id: str,
        prompt: dict[str, Any],
        correct: int,
        total: int,
        trajectories: Sequence[Trajectory],
    ) -> None:
        """One question's step result: ``correct`` of ``total`` on-policy samples.

        ``prompt`` is what is needed to ask the question again (messages and columns). A
        question solved ``K/K`` retires; one seen at ``k = 0`` is not stored, and a pooled one
        loses its bucket and stored trajectories (they would replay a solution the policy can
        no longer find as if it were still in reach; ExGRPO keeps only ``0 < k < K``).
        """
        if correct >= total:
            self.entries.pop(prompt_id, None)
            self.retired.add(prompt_id)
            return
        if correct == 0:  # outside (0, K): not stored, and what was stored goes (spec §4.2)
            self.entries.pop(prompt_id, None)
            return
        entry = self.entries.get(prompt_id)
        if entry is None:
            if prompt_id in self.retired:
                return
            entry = self.entries[prompt_id] = {"prompt": prompt, "trajectories": []}
        entry["bucket"] = correct
        seen = {t["text"] for t in entry["trajectories"]}
        for traj in trajectories:
            if traj.text not in seen:
                entry["trajectories"].append(asdict(traj))
                seen.add(traj.text)
        entry["trajectories"] = entry["trajectories"][-self.max_trajectories :]
        while len(self.entries) > self.max_questions:
            self.entries.pop(next(iter(self.entries)))

    def trajectories(self, prompt_id: str) -> list[Trajectory]:
        return [Trajectory(**t) for t in self.entries[prompt_id]["trajectories"]]

    def prompt(self, prompt_id: str) -> dict[str, Any]:
        return self.entries[prompt_id]["prompt"]

    def sample(self, n: int, rng: random.Random, exclude: Sequence[str] = ()) -> list[str]:
        """Up to ``n`` distinct prompt ids: buckets by weight, questions uniformly within one.

        Draws that exceed a bucket's size are redrawn over the remaining buckets.
        """
        remaining: dict[int, list[str]] = {}
        for pid, entry in self.entries.items():
            if entry["trajectories"] and pid not in exclude:
                remaining.setdefault(entry["bucket"], []).append(pid)
        chosen: list[str] = []
        while len(chosen) < n and remaining:
            buckets = sorted(remaining)
            probs = bucket_probabilities(buckets, self.group_size, self.sigma)
            draws = rng.choices(buckets, weights=probs, k=n - len(chosen))
            for k in buckets:
                take = min(draws.count(k), len(remaining[k]))
                picked = rng.sample(remaining[k], take)
                chosen += picked
                remaining[k] = [p for p in remaining[k] if p not in picked]
                if not remaining[k]:
                    del remaining[k]
        return chosen

    def state_dict(self) -> dict[str, Any]:
        return {
            "group_size": self.group_size,
            "entries": self.entries,
            "retired": sorted(self.retired),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_size = int(state["group_size"])
        self.entries = dict(state["entries"])
        self.retired = set(state["retired"])
