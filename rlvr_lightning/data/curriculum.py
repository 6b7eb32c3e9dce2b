"""Variance-based curriculum (VCRL, spec §2): train on high-variance groups, replay them.

A group's score is its normalised reward variance ``σ²/σ²_max`` (1 when half the group is right,
0 when all agree). Groups scoring below ``κ`` contribute no gradient; prompts scoring at least
``bank_min_score`` enter a bounded memory bank, which refills the slots the filter freed in the
next steps (their rollouts are regenerated). The paper's κ schedule and bank rules are not
public: every constant here is configurable and its default is this project's choice.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlvr_lightning.data.stats import Observation


def max_group_variance(group_size: int) -> float:
    """Largest unbiased variance of ``G`` binary rewards.

    ``G/(4(G-1))`` for even ``G`` (half right), ``(G+1)/(4G)`` for odd ``G``.
    """
    g = group_size
    return g / (4 * (g - 1)) if g % 2 == 0 else (g + 1) / (4 * g)


def normalized_variance(values: torch.Tensor) -> torch.Tensor:
    """``σ²/σ²_max`` per group of ``[B, G]`` values in [0, 1] (binary rewards: ``4k(G-k)/G²``).

    Uses the unbiased variance, as the paper does; ``G < 2`` gives 0. Values outside [0, 1]
    (shaped rewards) can score above 1: pass the binary ``correct`` matrix for the paper's score.
    """
    g = values.shape[-1]
    if g < 2:
        return torch.zeros(values.shape[:-1])
    return values.float().var(dim=-1, unbiased=True) / max_group_variance(g)  # [B]


def linear_kappa(step: int, start: float, end: float, ramp_steps: int) -> float:
    """κ moving linearly from ``start`` to ``end`` over ``ramp_steps`` steps, then constant."""
    if ramp_steps <= 0:
        return end
    return start + (end - start) * min(step / ramp_steps, 1.0)


@dataclass
class BankEntry:
    prompt_id: str
    score: float
    step: int  # data step at which the score was observed


class MemoryBank:
    """Bounded bank of high-score prompts; the best score is served first.

    When full, a new entry replaces the lowest-scoring one (ties: the oldest) only if it scores
    higher. A prompt appears once; re-admitting it updates its score and age.

    Args:
        capacity: most prompts held.
        max_age: entries older than this many steps are dropped (``<= 0``: never).
    """

    def __init__(self, capacity: int = 64, max_age: int = 50) -> None:
        if capacity < 1:
            raise ValueError(f"bank capacity must be >= 1, got {capacity}.")
        self.capacity, self.max_age = capacity, max_age
        self.entries: dict[str, BankEntry] = {}

    def add(self, prompt_id: str, score: float, step: int) -> None:
        self.entries.pop(prompt_id, None)
        if len(self.entries) >= self.capacity:
            worst = min(self.entries.values(), key=lambda e: (e.score, e.step))
            if score <= worst.score:
                return
            del self.entries[worst.prompt_id]
        self.entries[prompt_id] = BankEntry(prompt_id, score, step)

    def expire(self, step: int) -> None:
        if self.max_age > 0:
            old = [p for p, e in self.entries.items() if step - e.step > self.max_age]
            for pid in old:
                del self.entries[pid]

    def take(self, n: int, exclude: Container[str]) -> list[str]:
        """Remove and return up to ``n`` prompts, highest score first (ties: the newest)."""
        ranked = sorted(self.entries.values(), key=lambda e: (-e.score, -e.step, e.prompt_id))
        chosen = [e.prompt_id for e in ranked if e.prompt_id not in exclude][: max(n, 0)]
        for pid in chosen:
            del self.entries[pid]
        return chosen

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self.entries

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [[e.prompt_id, e.score, e.step] for e in self.entries.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = {pid: BankEntry(pid, s, t) for pid, s, t in state["entries"]}


class VarianceCurriculum:
    """VCRL-style variance filter plus a memory bank that refills the filtered slots.

    Defaults are this project's choice (the paper's are not public): κ ramps linearly from 0.3
    to 0.6 over 100 steps, so early training keeps most informative groups and later training
    focuses on those nearest a 50 % pass rate.

    Args:
        kappa_start: κ at step 0; groups with normalised variance below κ get no gradient.
        kappa_end: κ after ``ramp_steps`` (set equal to ``kappa_start`` for a constant κ).
        ramp_steps: steps of the linear ramp.
        score_on: ``correct`` scores the binary solved/unsolved matrix (the paper's score);
            ``reward`` scores the weighted total reward.
        bank_capacity: prompts the memory bank holds.
        bank_min_score: a prompt enters the bank when its score is at least this.
        bank_max_age: steps a bank entry stays valid.
        max_fill_fraction: at most this share of a step's prompts comes from the bank.
        judge: which rows the κ mask scores: ``trained`` (default), the group as the update
            sees it, injected members (a reference, a teacher) included, so a group that
            ``GroundTruthInjection`` rescues from ``k = 0`` is judged with its reference and
            can train; or ``sampled``, the policy's own ``G`` samples (then injection into
            all-wrong groups is refused at setup: every such group would score 0 and be
            masked). This project's choice; the bank always scores the sampled outcome.
    """

    def __init__(
        self,
        kappa_start: float = 0.3,
        kappa_end: float = 0.6,
        ramp_steps: int = 100,
        score_on: Literal["correct", "reward"] = "correct",
        bank_capacity: int = 64,
        bank_min_score: float = 0.75,
        bank_max_age: int = 50,
        max_fill_fraction: float = 0.5,
        judge: Literal["trained", "sampled"] = "trained",
    ) -> None:
        if score_on not in ("correct", "reward"):
            raise ValueError(f"score_on must be 'correct' or 'reward', got {score_on!r}.")
        if judge not in ("trained", "sampled"):
            raise ValueError(f"judge must be 'trained' or 'sampled', got {judge!r}.")
        if not 0.0 <= max_fill_fraction <= 1.0:
            raise ValueError(f"max_fill_fraction must be in [0, 1], got {max_fill_fraction}.")
        self.config = {k: v for k, v in locals().items() if k != "self"}  # plain data, for cards
        self.kappa_start, self.kappa_end, self.ramp_steps = kappa_start, kappa_end, ramp_steps
        self.score_on, self.bank_min_score = score_on, bank_min_score
        self.max_fill_fraction, self.judge = max_fill_fraction, judge
        self.bank = MemoryBank(bank_capacity, bank_max_age)
        self.freed = 0  # slots the filter freed at the last step, to refill from the bank

    def kappa(self, step: int) -> float:
        return linear_kappa(step, self.kappa_start, self.kappa_end, self.ramp_steps)

    def scores(self, correct: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """Normalised variance ``[B]`` of ``[B, G]`` groups."""
        return normalized_variance(correct.float() if self.score_on == "correct" else rewards)

    def observation_score(self, obs: Observation) -> float:
        """Normalised variance of an observed group, from its counts (no rewards needed)."""
        g = obs.group_size
        if g < 2:
            return 0.0
        if self.score_on == "correct":
            k = obs.num_correct
            return k * (g - k) / (g * (g - 1)) / max_group_variance(g)
        return obs.reward_variance / max_group_variance(g)

    def group_mask(self, step: int, correct: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: groups whose score reaches κ at data step ``step``."""
        return self.scores(correct, rewards) >= self.kappa(step) - 1e-9

    def observe(
        self, step: int, prompt_ids: Sequence[str], scores: Sequence[float], trained: Sequence[bool]
    ) -> None:
        """Bank the high-score prompts of a finished step and count the freed slots."""
        self.bank.expire(step)
        for pid, score in zip(prompt_ids, scores, strict=True):
            if score >= self.bank_min_score:
                self.bank.add(pid, float(score), step)
        self.freed = sum(not t for t in trained)

    def fill(self, prompts_per_step: int, exclude: Container[str]) -> list[str]:
        """Bank prompts for the next step: the freed slots, at most the fill cap."""
        cap = math.floor(prompts_per_step * self.max_fill_fraction)
        return self.bank.take(min(self.freed, cap), exclude)

    def state_dict(self) -> dict[str, Any]:
        return {"bank": self.bank.state_dict(), "freed": self.freed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bank.load_state_dict(state["bank"])
        self.freed = state["freed"]
