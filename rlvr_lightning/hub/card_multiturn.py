"""The model card's multi-turn line: tools, environment and turns of a run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def multiturn_line(group: Mapping[str, Any] | None) -> str | None:
    """The card's multi-turn line (tools, environment, turns), None for single-turn runs."""
    group = dict(group or {})
    tools = [_callable_name(t) for t in group.get("tools") or []]
    env = group.get("environment")
    turns = int(group.get("max_turns") or 1)
    if not tools and env is None and turns <= 1:
        return None
    parts = [f"up to {turns} model turns per trajectory"]
    if tools:
        parts.append("tools: " + ", ".join(f"`{t}`" for t in tools))
    if env is not None:
        parts.append(f"environment: `{_callable_name(env)}`")
    return "; ".join(parts)


def _callable_name(value: Any) -> str:
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    return getattr(value, "__qualname__", None) or type(value).__name__
