"""One trajectory's environment: what it says after each model turn.

A :class:`Session` holds one environment instance (TRL's rule: one per rollout) and the tools
its turns may call. After a model turn it answers with a :class:`Turn`: a tool message per call
(results, or an error message for a malformed, unknown, failing, hanging or too long call;
nothing raises), or, for a turn without a call, the environment's ``feedback`` (this project's
extension of TRL's contract): a string is the next user turn, ``None`` ends the trajectory, and
an environment without ``feedback`` ends it. :func:`respond_all` answers a batch of sessions at
once, every row's calls concurrently (``calls.py``).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlvr_lightning.environments.calls import LOOP_GRACE_S, CallRunner
from rlvr_lightning.environments.parsing import ParsedTurn, ToolCall, parse_turn

DEFAULT_TIMEOUT_S = 10.0  # per call; this project's choice, the code reward's row timeout
INVALID_CALL = "invalid_tool_call"  # the name of the tool message that answers a malformed call


@dataclass
class Turn:
    """What the environment says after one model turn.

    ``messages``: role ``tool`` messages (``{"role": "tool", "name": ..., "content": ...}``, one
    per call, in the calls' order, then one per malformed call) and/or one ``user`` feedback
    message. ``done``: the trajectory ends here. ``tool_calls``/``tool_errors``: calls made and
    calls that failed (malformed, unknown, wrong arguments, raised, timed out, truncated).
    ``errors``: what went wrong, in words. ``assistant``: the model's turn as a chat message
    (``content`` and ``tool_calls`` in the format chat templates take).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    errors: list[str] = field(default_factory=list)
    assistant: dict[str, Any] = field(default_factory=dict)


class Session:
    """One trajectory: an environment instance (or none, with plain tools) and its tools.

    Built by ``SessionFactory.new()``. Re-creation for resume: :meth:`state_dict` holds the row
    and the model's turns so far; ``SessionFactory.restore`` builds a new instance, calls
    ``reset`` with the same row and replays the turns. That gives the same state and the same
    turns when the environment is a function of its row and the model's turns (no clock, no
    unseeded randomness, no outside service), and it runs the tools again (side effects too).
    A session that has only been reset is re-created exactly by ``new()`` + ``reset(row)``.
    """

    def __init__(
        self,
        environment: object | None,
        tools: dict[str, Callable[..., Any]],
        schemas: list[dict[str, Any]],
        runner: CallRunner,
        max_tool_output_chars: int,
    ) -> None:
        self.environment, self.tools, self.schemas = environment, tools, schemas
        self.row: dict[str, Any] | None = None
        self.texts: list[str] = []  # the model's turns answered so far
        self._runner, self._max_chars = runner, max_tool_output_chars

    @property
    def runner(self) -> CallRunner:
        return self._runner

    def reset(self, row: Mapping[str, Any]) -> str | None:
        """``environment.reset(**row)``, as TRL 1.16 calls it: the dataset row's columns as
        keyword arguments. A returned string is for the caller to append to the last user
        message; without an environment this only records the row and returns None."""
        self.row, self.texts = dict(row), []
        if self.environment is None:
            return None
        observation = self.environment.reset(**self.row)
        if observation is not None and not isinstance(observation, str):
            name = type(self.environment).__name__
            raise TypeError(
                f"{name}.reset returned {type(observation).__name__}; return None or a string "
                "to append to the prompt's last user message."
            )
        return observation

    def respond(self, text: str, tokenizer: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Turn:
        """The environment's answer to one model turn (:func:`respond_all` for one row)."""
        return respond_all([self], [text], tokenizer, timeout_s)[0]

    def reward(self, timeout_s: float = 60.0) -> float | None:
        """The environment's ``get_reward()`` (sync or async, as TRL allows), else None."""
        fn = getattr(self.environment, "get_reward", None)
        if fn is None:
            return None
        if inspect.iscoroutinefunction(fn):
            name = f"{type(self.environment).__name__}.get_reward"
            outcome = self._runner.run(
                self._runner.call(fn, {}, timeout_s, name), timeout_s + LOOP_GRACE_S
            )
            if outcome.timed_out:
                raise TimeoutError(f"{name} did not return within {timeout_s:g} s.")
            if outcome.error is not None:
                raise outcome.error
            value = outcome.value
        else:
            value = fn()
        return None if value is None else float(value)

    def state_dict(self) -> dict[str, Any]:
        """The row and the model's turns so far: what ``SessionFactory.restore`` re-creates from."""
        return {"row": self.row, "texts": list(self.texts)}

    def calls_budget_s(self, parsed: ParsedTurn, timeout_s: float) -> float:
        """The longest this turn may take: each call after the other, or the feedback."""
        feedback_s = float(getattr(self.environment, "feedback_timeout_s", 0.0))
        return max(len(parsed.calls), 1) * max(timeout_s, feedback_s)

    async def answer(self, parsed: ParsedTurn, timeout_s: float) -> Turn:
        """The turn for a parsed model turn (on the runner's loop)."""
        turn = Turn(assistant=parsed.assistant_message())
        if not parsed.calls and not parsed.errors:
            await self._feedback(turn, parsed.content, timeout_s)
            return turn
        timed_out = False
        for call in parsed.calls:
            if timed_out:  # the environment may still be busy in the abandoned call
                content, error = "", "not run: an earlier call of this turn timed out"
            else:
                content, error, timed_out = await self._call(call, timeout_s)
            self._tool_message(turn, call.name, content, error)
        for error in parsed.errors:
            self._tool_message(turn, INVALID_CALL, "", error)
        return turn

    async def _call(self, call: ToolCall, timeout_s: float) -> tuple[str, str | None, bool]:
        """(content, error or None, timed out) of one call."""
        fn = self.tools.get(call.name)
        if fn is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return "", f"unknown tool {call.name!r}; the tools are: {known}", False
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none: let the call say
            signature = None
        if signature is not None:
            try:
                signature.bind(**call.arguments)
            except TypeError as exc:
                takes = self._parameters(call.name)
                error = f"wrong arguments for tool {call.name!r}: {exc}; it takes {takes}"
                return "", error, False
        outcome = await self._runner.call(fn, call.arguments, timeout_s, call.name)
        if outcome.timed_out:
            return "", f"tool {call.name} timed out after {timeout_s:g}s", True
        if outcome.error is not None:
            exc = outcome.error
            return "", f"tool {call.name} raised {type(exc).__name__}: {exc}", False
        return str(outcome.value), None, False

    def _parameters(self, name: str) -> str:
        """A tool's parameters as its schema gives them: ``(a: integer, b: integer (optional))``."""
        for schema in self.schemas:
            if schema["function"]["name"] == name:
                parameters = schema["function"].get("parameters", {})
                required = parameters.get("required", [])
                shown = [
                    f"{p}: {spec.get('type', 'any')}" + ("" if p in required else " (optional)")
                    for p, spec in parameters.get("properties", {}).items()
                ]
                return f"({', '.join(shown)})"
        return "(unknown parameters)"

    def _tool_message(self, turn: Turn, name: str, content: str, error: str | None) -> None:
        turn.tool_calls += 1
        if error is not None:
            content = f"Error: {error}"
        if len(content) > self._max_chars:
            cut = len(content) - self._max_chars
            content = f"{content[: self._max_chars]}\n[truncated {cut} characters]"
            if error is None:
                error = (
                    f"tool {name} returned {self._max_chars + cut} characters; kept the first "
                    f"{self._max_chars} (max_tool_output_chars)"
                )
        if error is not None:
            turn.tool_errors += 1
            turn.errors.append(error[: self._max_chars])
        turn.messages.append({"role": "tool", "name": name, "content": content})

    async def _feedback(self, turn: Turn, answer: str, timeout_s: float) -> None:
        """A turn without a tool call: the environment's feedback, or the end."""
        fn = getattr(self.environment, "feedback", None)
        turn.done = True
        if fn is None:
            return
        name = f"{type(self.environment).__name__}.feedback"
        limit = max(timeout_s, float(getattr(self.environment, "feedback_timeout_s", 0.0)))
        outcome = await self._runner.call(fn, {"answer": answer}, limit, name)
        if outcome.timed_out:
            turn.errors.append(f"{name} timed out after {limit:g}s")
        elif outcome.error is not None:
            turn.errors.append(f"{name} raised {type(outcome.error).__name__}: {outcome.error}")
        elif isinstance(outcome.value, str):
            turn.messages.append({"role": "user", "content": outcome.value})
            turn.done = False
        elif outcome.value is not None:
            turn.errors.append(f"{name} returned {type(outcome.value).__name__}, not str or None")


def respond_all(
    sessions: Sequence[Session],
    texts: Sequence[str],
    tokenizer: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Turn]:
    """The environments' answers to one model turn per session, all rows at once.

    Each call (and each ``feedback``) gets ``timeout_s`` (an environment's
    ``feedback_timeout_s`` attribute raises its own feedback's); a row's calls run one after the
    other, on its own environment, while the rows run concurrently on the factory's event loop,
    so no row waits on another row's hanging call. Raises ``ToolTimeoutError`` only once
    ``max_abandoned_threads`` of a tool's abandoned threads are still running.
    """
    parsed = _parse_all(sessions, texts, tokenizer, timeout_s)
    if not sessions:
        return []
    budget = max(s.calls_budget_s(p, timeout_s) for s, p in zip(sessions, parsed, strict=True))
    coro = arespond_all(sessions, texts, tokenizer, timeout_s, parsed)
    return sessions[0].runner.run(coro, budget + LOOP_GRACE_S)


async def arespond_all(
    sessions: Sequence[Session],
    texts: Sequence[str],
    tokenizer: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    parsed: list[ParsedTurn] | None = None,
) -> list[Turn]:
    """:func:`respond_all` awaited on the caller's event loop (for an async turn loop); an
    async tool that blocks without awaiting then blocks that loop. ``parsed``: the turns
    already read by :func:`parse_turn`, else they are read here."""
    if parsed is None:
        parsed = _parse_all(sessions, texts, tokenizer, timeout_s)
    rows = zip(sessions, parsed, strict=True)
    turns = list(await asyncio.gather(*(s.answer(p, timeout_s) for s, p in rows)))
    for session, text in zip(sessions, texts, strict=True):
        session.texts.append(text)
    return turns


def _parse_all(
    sessions: Sequence[Session], texts: Sequence[str], tokenizer: Any, timeout_s: float
) -> list[ParsedTurn]:
    """Check the arguments of a batch's turn and read its tool calls."""
    if len(sessions) != len(texts):
        raise ValueError(f"respond_all got {len(sessions)} sessions but {len(texts)} texts.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds; got {timeout_s}.")
    for session in sessions:
        if session.runner is not sessions[0].runner:
            raise ValueError("respond_all takes the sessions of one SessionFactory at a time.")
        if session.environment is not None and session.row is None:
            raise RuntimeError("Call session.reset(row) before the session's first respond().")
    return [parse_turn(t, tokenizer, s.schemas) for s, t in zip(sessions, texts, strict=True)]
