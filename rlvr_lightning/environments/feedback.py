r"""Execution feedback (MURPHY): the model answers, the environment checks the answer and, when
it is wrong, says what failed as the next user turn, so the model can refine it.

A code row (a ``tests`` column, in the code reward's formats: ``rewards/code.py``) runs the
answer's code in the code reward's sandbox and returns the failing tests, each with what went
wrong; a math row (an ``answer`` column, e.g. the built-in arithmetic tasks) checks the boxed
answer with ``rewards/math.py``. ``feedback`` returns None once the answer passes, which ends
the trajectory. This project's choice: the feedback never reveals the right answer (no gold
answer, no compared literal, no expected output: what the code returned or printed, and the
input it ran on, are shown), so a refinement must come from the model's own work.
"""

from __future__ import annotations

import functools
from typing import Any

from rlvr_lightning.rewards.code import Case, CodeTestsReward, extract_code, parse_tests
from rlvr_lightning.rewards.math import (
    answers_match,
    boxed_contents,
    committed_boxed,
    normalize_gold,
)

MAX_FEEDBACK_CHARS = 1500  # this project's choice: a few failing tests, a few hundred tokens


class ExecutionFeedback:
    """``environment_factory`` for retry-after-feedback on code and math rows.

    Args:
        sandbox: the code sandbox; default one sandbox shared by all instances (so a batch of
            rows runs at most its ``max_workers`` sandboxes at once), with the code reward's
            defaults except ``timeout_s=5``, ``case_timeout_s=2``.
        max_feedback_chars: the feedback text is cut to this length.
        code_timeout_s: how long the feedback on a code row may take. The sandbox kills each
            run at its own deadline (its ``timeout_s`` + 3 s), so what can take longer is the
            wait for one of its ``max_workers`` slots while other rows run; 300 s (this
            project's choice) covers about 40 runs per slot. A math row's feedback gets the
            turn's tool timeout.
    """

    def __init__(
        self,
        sandbox: CodeTestsReward | None = None,
        max_feedback_chars: int = MAX_FEEDBACK_CHARS,
        code_timeout_s: float = 300.0,
    ) -> None:
        if max_feedback_chars < 100:
            raise ValueError(f"max_feedback_chars must be >= 100; got {max_feedback_chars}.")
        if not code_timeout_s > 0:
            raise ValueError(f"code_timeout_s must be > 0 seconds; got {code_timeout_s}.")
        self.sandbox, self.code_timeout_s = sandbox, float(code_timeout_s)
        self.max_feedback_chars = max_feedback_chars
        self.row: dict[str, Any] = {}
        self.cases: list[Case] | None = None
        self.gold = ""
        self.passed = False
        self.answers = 0  # answers checked in this trajectory

    @property
    def feedback_timeout_s(self) -> float:
        """How long this row's ``feedback`` may take (read by the session; 0: the tool timeout)."""
        return self.code_timeout_s if self.cases is not None else 0.0

    def reset(self, **row: Any) -> None:
        """Keep the row: its ``tests`` (code) or ``answer`` (math) say how to check answers."""
        self.row, self.passed, self.answers = row, False, 0
        self.cases = parse_tests(row.get("tests"))
        self.gold = normalize_gold(row.get("answer")) if self.cases is None else ""
        if self.cases is None and not self.gold:
            raise ValueError(
                "ExecutionFeedback needs a 'tests' column (a code row, in the code reward's "
                "formats) or an 'answer' column (a math row) in every row; this row has "
                f"columns {sorted(row)}."
            )

    def feedback(self, answer: str) -> str | None:
        """None when ``answer`` passes, else what failed, as the next user turn."""
        self.answers += 1
        text = self._check_code(answer) if self.cases is not None else self._check_math(answer)
        self.passed = text is None
        if text is not None and len(text) > self.max_feedback_chars:
            text = text[: self.max_feedback_chars - 15] + "\n[...trimmed]"
        return text

    def get_reward(self) -> float:
        """1.0 when the last answer passed, else 0.0."""
        return 1.0 if self.passed else 0.0

    def _check_math(self, answer: str) -> str | None:
        pred = committed_boxed(answer)
        if pred is None:
            if boxed_contents(answer):
                return "Your boxed answers disagree. Give one final answer in \\boxed{}."
            return "I could not find your final answer. Give it in \\boxed{}."
        if answers_match(pred, self.gold):
            return None
        shown = pred.strip() if len(pred) <= 100 else pred.strip()[:100] + "..."
        return (
            f"Your answer {shown} is not correct. Check your work and give the final answer "
            "in \\boxed{}."
        )

    def _check_code(self, answer: str) -> str | None:
        assert self.cases is not None
        code = extract_code(answer)
        if not code.strip():
            return "I found no code. Write your whole solution in a ```python block."
        sandbox = self.sandbox or _shared_sandbox()
        failures = sandbox.failures(code, self.cases)
        failed = [(i, why) for i, why in enumerate(failures, 1) if why is not None]
        if not failed:
            return None
        lines = [f"Test {i}: {why}" for i, why in failed]
        return (
            f"Your code fails {len(failed)} of {len(failures)} tests:\n" + "\n".join(lines)
            + "\nFix the code and give the whole corrected solution in a ```python block."
        )  # fmt: skip


@functools.cache
def _shared_sandbox() -> CodeTestsReward:
    # One sandbox for every instance: its max_workers bounds the rows run at once, and its
    # host probe runs once.
    return CodeTestsReward(timeout_s=5.0, case_timeout_s=2.0)
