"""NPO's quantities (spec §6): signal quality ``Q``, variance cost ``V``, ``S = Q / V``, the
online triggers of AutoNPO and its mistake pool. Pure functions on plain numbers and tensors;
``callbacks.NearFuturePolicyGuidance`` gathers the inputs.

The paper defines ``Q`` (among prompts the policy fails, the share a guide solves) and ``V``
(the gradient variance that importance weighting the guide's trajectories would cause) but its
estimators are not public. This project estimates ``Q`` as the share of mistake-pool prompts
with at least one verified-correct guide sample, and ``V`` as the variance of the token
log-ratio ``log π_t − log π_guide`` over the guide's own tokens on those prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlvr_lightning.algorithms.ops import masked_mean


def signal_quality(solved: Sequence[bool]) -> float:
    """``Q̂``: the share of failed prompts the guide solved at least once (0 for none)."""
    return sum(bool(s) for s in solved) / len(solved) if solved else 0.0


def logratio_variance(
    policy_logp: torch.Tensor, guide_logp: torch.Tensor, mask: torch.Tensor
) -> float:
    """``V̂``: variance (population) of ``log π_t − log π_guide`` over the valid tokens of the
    ``[n, T]`` inputs (the guide's trajectories); 0 with fewer than two tokens."""
    valid = mask.bool()
    if int(valid.sum()) < 2:
        return 0.0
    ratio = (policy_logp.float() - guide_logp.float()).detach()  # [n, T]
    mean = masked_mean(ratio, valid)
    return float(masked_mean((ratio - mean) ** 2, valid))


def effective_signal(q: float, v: float, eps: float = 1e-3) -> float:
    """``S = Q / max(V, eps)``; ``eps`` keeps a guide identical to the policy (``V = 0``)
    finite, so its ``S`` is ``Q / eps`` (this project's choice)."""
    return q / max(v, eps)


def best_candidate(scores: dict[int, float]) -> int:
    """The key with the largest score; ties go to the smallest key (the nearer guide)."""
    if not scores:
        raise ValueError("best_candidate needs at least one candidate.")
    return min(scores, key=lambda k: (-scores[k], k))


def plateaued(values: Sequence[float], window: int, min_gain: float) -> bool:
    """Whether the mean of the last ``window`` values exceeds the mean of the ``window``
    before them by no more than ``min_gain`` (False until ``2 * window`` values exist)."""
    if window < 1 or len(values) < 2 * window:
        return False
    recent = sum(values[-window:]) / window
    before = sum(values[-2 * window : -window]) / window
    return recent - before <= min_gain


def entropy_collapsed(
    values: Sequence[float], window: int, ratio: float, floor: float = 0.0
) -> bool:
    """Whether the mean of the last ``window`` entropies fell below ``ratio`` times the mean of
    the first ``window`` ones, or below ``floor`` (False until ``2 * window`` values exist)."""
    if window < 1 or len(values) < 2 * window:
        return False
    first = sum(values[:window]) / window
    recent = sum(values[-window:]) / window
    return recent < ratio * first or recent < floor


class MistakePool:
    """Prompts the policy recently failed (no sampled row correct), oldest dropped first.

    Each entry keeps what a guide needs to answer it again: the prompt id, its messages and
    its columns (one value each). A prompt leaves the pool when the policy solves it.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"mistake pool capacity must be >= 1, got {capacity}.")
        self.capacity = capacity
        self.entries: dict[str, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def observe(self, prompt_id: str, solved: int, prompt: dict[str, Any]) -> None:
        """Record one prompt's sampled outcome (``solved`` correct rows)."""
        self.entries.pop(prompt_id, None)
        if solved == 0:
            self.entries[prompt_id] = prompt
            while len(self.entries) > self.capacity:
                self.entries.pop(next(iter(self.entries)))

    def newest(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        """Up to ``n`` entries, the most recent failures first."""
        return list(reversed(self.entries.items()))[:n]

    def state_dict(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "ids": list(self.entries),
            "prompts": list(self.entries.values()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = dict(zip(state["ids"], state["prompts"], strict=True))
