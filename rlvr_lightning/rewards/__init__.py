"""Reward functions and the combiner that weights, isolates and times them out.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``; ``None``
means the function does not apply to that row.
"""

from __future__ import annotations

from rlvr_lightning.rewards.combine import RewardCombiner, RewardResult
from rlvr_lightning.rewards.format import OverlongPenalty, boxed_format, overlong_penalty
from rlvr_lightning.rewards.math import (
    answer_accuracy,
    answers_match,
    boxed_accuracy,
    extract_boxed,
    last_number,
    normalize_gold,
)

__all__ = [
    "OverlongPenalty",
    "RewardCombiner",
    "RewardResult",
    "answer_accuracy",
    "answers_match",
    "boxed_accuracy",
    "boxed_format",
    "extract_boxed",
    "last_number",
    "normalize_gold",
    "overlong_penalty",
]
