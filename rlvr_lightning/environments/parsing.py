"""Tool calls in a model's turn: read by the tokenizer's own response parser where it has one,
else in the documented fallback format.

Where the tokenizer has a ``response_template`` (transformers >= 5.13; TRL's
``add_response_schema`` sets one for the chat templates it knows), ``tokenizer.parse_response``
reads the turn, as TRL does. Otherwise, and to explain what went wrong where that parser fails
on a malformed call, the fallback format is Hermes/Qwen's: each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``, several per
turn allowed. A malformed call (bad JSON, no name, arguments that are not an object, an unclosed
tag) is an error message for the model, never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"
_SHOWN_CHARS = 200  # of a malformed call, in its error message (this project's choice)
FORMAT_HINT = 'write <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>'


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``raw`` is the call's text (the JSON between the tags; where
    the tokenizer's parser read it, the call as JSON)."""

    name: str
    arguments: dict[str, Any]
    raw: str


@dataclass
class ParsedTurn:
    """A model turn read: its text without the calls, the calls, and one error per bad call."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def assistant_message(self) -> dict[str, Any]:
        """The turn as a chat message, with ``tool_calls`` in the format chat templates take."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        return message


def parse_tool_calls(
    text: str, tokenizer: Any, tools: list[dict[str, Any]] | None = None, prefix: str = ""
) -> tuple[list[ToolCall], list[str]]:
    """The tool calls in one model turn and an error message for each malformed one.

    Args:
        text: the model's turn, decoded.
        tokenizer: its ``parse_response`` is used when it has a ``response_template``.
        tools: the tools' JSON schemas; the tokenizer's parser types the arguments with them.
        prefix: the rendered prompt before the turn (some response templates need it, e.g.
            when the template opens a ``<think>`` block itself).
    """
    parsed = parse_turn(text, tokenizer, tools, prefix)
    return parsed.calls, parsed.errors


def parse_turn(
    text: str, tokenizer: Any, tools: list[dict[str, Any]] | None = None, prefix: str = ""
) -> ParsedTurn:
    """:func:`parse_tool_calls` with the turn's text (calls removed) kept."""
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos:
        text = text.removesuffix(eos)
    if getattr(tokenizer, "response_template", None) is None:
        return _fallback(text)
    try:
        parsed = tokenizer.parse_response(text, prefix=prefix, tools=tools)
    except Exception as exc:  # the template's parser refuses a malformed call: say which
        turn = _fallback(text)
        if not turn.errors:
            turn.errors.append(
                f"Could not read your tool calls ({_short(str(exc))}); {FORMAT_HINT}."
            )
        return turn
    content = parsed.get("content") if isinstance(parsed, dict) else None
    turn = ParsedTurn(content if isinstance(content, str) else "")
    entries = parsed.get("tool_calls") if isinstance(parsed, dict) else None
    for entry in entries or []:
        function = entry.get("function", entry) if isinstance(entry, dict) else entry
        _add(turn, function, json.dumps(function, default=str))
    return turn


def _fallback(text: str) -> ParsedTurn:
    """The calls in Hermes/Qwen format, the text around them as the content."""
    turn = ParsedTurn(_CALL.sub("", text).strip())
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        try:
            function = json.loads(body)
        except ValueError as exc:
            turn.errors.append(
                f"Tool call {_short(body)!r} is not valid JSON ({exc}); {FORMAT_HINT}."
            )
            continue
        _add(turn, function, body)
    tail = _CALL.sub("", text)
    if _OPEN in tail:  # an opened call never closed, e.g. cut by the token budget
        start = tail.index(_OPEN)
        turn.content = tail[:start].strip()
        turn.errors.append(
            f"Tool call {_short(tail[start:])!r} has no closing </tool_call>; {FORMAT_HINT}."
        )
    return turn


def _add(turn: ParsedTurn, function: object, raw: str) -> None:
    """Append ``function`` as a call when it is one, else an error saying what is wrong."""
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        turn.errors.append(f"Tool call {_short(raw)!r} has no string 'name'; {FORMAT_HINT}.")
        return
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # some templates keep the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if arguments is None:  # a call without arguments (TRL normalises it the same way)
        arguments = {}
    if not isinstance(arguments, dict):
        turn.errors.append(
            f"Tool call {_short(raw)!r}: 'arguments' must be a JSON object; {FORMAT_HINT}."
        )
        return
    turn.calls.append(ToolCall(function["name"], arguments, raw))


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."
