"""The ``multiturn`` argument group of ``RLVRModule`` (tools, environments, turn limits)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiTurn:
    """Multi-turn rollouts: tools, an environment and their limits (on when ``tools`` or
    ``environment`` is set).

    Args:
        tools: tool functions (import paths in YAML), TRL's ``tools``: type hints and a
            Google-style docstring give the JSON schema the chat template takes.
        environment: a class or zero-argument factory (import path in YAML), TRL's
            ``environment_factory``: public methods are tools, ``reset(**row)`` may return text
            appended to the prompt, ``get_reward()`` (optional) is a reward source, and
            ``feedback(answer) -> str | None`` (this project's extension) answers a turn without
            a tool call (None: done). One instance per trajectory.
        max_turns: model turns per trajectory (TRL's ``max_tool_calling_iterations`` + 1).
        max_total_tokens: tokens after the prompt, model and environment together; an
            environment turn that would pass it ends the trajectory (None: no limit besides
            ``sampling.max_new_tokens`` a turn and ``max_tool_output_chars`` a tool result).
        tool_timeout_s: seconds a tool call (or ``feedback``) may run before it is an error.
        max_tool_output_chars: a tool result longer than this is cut, marked and counted as an
            error (4000 is this project's choice).
        turn_discount: ``gamma`` of the per-turn returns ``gamma ** (turns left) * R``
            (Semi-online RL); used by the step-level advantages.
        step_weight: ``w`` of ``(1 - w) * A_episode + w * A_step`` per turn (0: trajectory-level
            GRPO, every token of a trajectory gets its group advantage).
    """

    tools: Sequence[Callable] | None = None
    environment: type | Callable[[], Any] | None = None
    max_turns: int = 1
    max_total_tokens: int | None = None
    tool_timeout_s: float = 10.0
    max_tool_output_chars: int = 4000
    turn_discount: float = 1.0
    step_weight: float = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    def __post_init__(self) -> None:
        problems = [
            f"{name} is {value!r}; {need}"
            for name, value, bad, need in (
                ("max_turns", self.max_turns, self.max_turns < 1, "use >= 1"),
                (
                    "turn_discount",
                    self.turn_discount,
                    not 0 < self.turn_discount <= 1,
                    "use 0 < turn_discount <= 1",
                ),
                (
                    "step_weight",
                    self.step_weight,
                    not 0 <= self.step_weight <= 1,
                    "use 0 <= step_weight <= 1",
                ),
                ("tool_timeout_s", self.tool_timeout_s, self.tool_timeout_s <= 0, "use > 0"),
            )
            if bad
        ]
        if self.max_turns > 1 and not self.enabled:
            problems.append(
                f"max_turns is {self.max_turns} but no tools or environment answer the turns; "
                "set multiturn.tools or multiturn.environment, or max_turns: 1"
            )
        if problems:
            raise ValueError("multiturn: " + "; ".join(problems) + ".")
