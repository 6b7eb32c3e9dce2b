"""Reward functions and the combiner that weights, isolates and times them out.

A reward function is ``fn(completions: list[str], **columns) -> list[float | None]``; ``None``
means the function does not apply to that row. Mark one with ``@run_in_process`` to run it in a
worker process that is killed and replaced on timeout (the built-in math verifiers are marked).
"""

from __future__ import annotations

from rlvr_lightning.rewards.code import CodeTestsReward, code_tests_pass
from rlvr_lightning.rewards.combine import RewardCombiner, RewardResult
from rlvr_lightning.rewards.contract import RewardContractError
from rlvr_lightning.rewards.format import OverlongPenalty, boxed_format, overlong_penalty
from rlvr_lightning.rewards.health import RewardFailureError
from rlvr_lightning.rewards.isolation import RewardWorkers, run_in_process
from rlvr_lightning.rewards.math import (
    answer_accuracy,
    answers_match,
    boxed_accuracy,
    committed_boxed,
    extract_boxed,
    last_number,
    normalize_gold,
)
from rlvr_lightning.rewards.threads import RewardTimeoutError
from rlvr_lightning.rewards.trl_contract import RewardState, completion_text

__all__ = [
    "CodeTestsReward",
    "OverlongPenalty",
    "RewardCombiner",
    "RewardContractError",
    "RewardFailureError",
    "RewardResult",
    "RewardState",
    "RewardTimeoutError",
    "RewardWorkers",
    "answer_accuracy",
    "answers_match",
    "boxed_accuracy",
    "boxed_format",
    "code_tests_pass",
    "committed_boxed",
    "completion_text",
    "extract_boxed",
    "last_number",
    "normalize_gold",
    "overlong_penalty",
    "run_in_process",
]
