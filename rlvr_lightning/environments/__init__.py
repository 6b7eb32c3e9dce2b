"""Multi-turn: tools (TRL's ``tools``), environments (``environment_factory``) and execution
feedback, and the sessions that answer a model's turns.

The turn loop (``rollout/``) builds a :class:`SessionFactory` once, a :class:`Session` per
trajectory (``reset(row)``), and after each model turn calls :func:`respond_all` for the rows
still running: each :class:`Turn` holds the messages the environment adds and whether the
trajectory is done.
"""

from __future__ import annotations

from rlvr_lightning.environments.calls import ToolTimeoutError
from rlvr_lightning.environments.factory import (
    DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    SessionFactory,
    environment_tools,
)
from rlvr_lightning.environments.feedback import ExecutionFeedback
from rlvr_lightning.environments.parsing import ToolCall, parse_tool_calls, parse_turn
from rlvr_lightning.environments.session import (
    DEFAULT_TIMEOUT_S,
    Session,
    Turn,
    arespond_all,
    respond_all,
)
from rlvr_lightning.environments.tools import (
    calculator,
    template_renders_tools,
    tool_schemas,
    tools_instruction,
)

__all__ = [
    "DEFAULT_MAX_TOOL_OUTPUT_CHARS",
    "DEFAULT_TIMEOUT_S",
    "ExecutionFeedback",
    "Session",
    "SessionFactory",
    "ToolCall",
    "ToolTimeoutError",
    "Turn",
    "arespond_all",
    "calculator",
    "environment_tools",
    "parse_tool_calls",
    "parse_turn",
    "respond_all",
    "template_renders_tools",
    "tool_schemas",
    "tools_instruction",
]
