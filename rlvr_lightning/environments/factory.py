"""Sessions from TRL 1.16's two contracts: ``tools`` and ``environment_factory``.

``tools`` are plain functions, sync or async. ``environment_factory`` is a zero-argument
callable returning an environment: an object with ``reset(**row)`` (required; it may return a
string to append to the prompt), optionally ``get_reward()`` (sync or async; the environment
owns the trajectory's reward), and tools: its public methods, i.e. every function of its class
whose name does not start with ``_`` other than ``reset`` and ``get_reward``. This project adds
``feedback(answer) -> str | None`` (see ``session.py``), which is not a tool here either (TRL
itself would expose it as one). One environment instance per trajectory.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from rlvr_lightning.environments.calls import CallRunner
from rlvr_lightning.environments.session import DEFAULT_TIMEOUT_S, Session
from rlvr_lightning.environments.tools import tool_schemas

NOT_TOOLS = frozenset({"reset", "get_reward", "feedback"})
DEFAULT_MAX_TOOL_OUTPUT_CHARS = 4000  # this project's choice: ~1k tokens per tool message


def environment_tools(environment: object | None) -> list[Callable[..., Any]]:
    """The environment's tool methods, bound to it, found as TRL finds them (on the class)."""
    if environment is None:
        return []
    members = inspect.getmembers(type(environment), predicate=inspect.isfunction)
    return [
        getattr(environment, name)
        for name, _ in members
        if name not in NOT_TOOLS and not name.startswith("_")
    ]


class SessionFactory:
    """Builds one :class:`Session` per trajectory from the run's tools and environment.

    Args:
        tools: plain Python functions (sync or async) with type hints and a Google-style
            docstring (TRL's ``tools``).
        environment_factory: a zero-argument callable (e.g. the class) returning a fresh
            environment (TRL's ``environment_factory``); one instance is built here to check it
            and read its tools, and serves the first session.
        max_tool_output_chars: a tool message longer than this is cut, with a visible
            ``[truncated N characters]`` marker, and counted as a tool error (4000: this
            project's choice).
        max_abandoned_threads: sync tool calls abandoned on timeout whose threads may still
            be running, per tool, before the run stops; ``None``: never stop.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]] = (),
        environment_factory: Callable[[], object] | None = None,
        max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
        max_abandoned_threads: int | None = 16,
    ) -> None:
        self._check_args(tools, environment_factory, max_tool_output_chars)
        self.tools, self.environment_factory = list(tools), environment_factory
        self.max_tool_output_chars = max_tool_output_chars
        self._runner = CallRunner(max_abandoned_threads)
        self._spare = self._instance() if environment_factory is not None else None
        self.environment_name = None if self._spare is None else type(self._spare).__name__
        self.has_feedback = callable(getattr(self._spare, "feedback", None))
        self.has_reward = callable(getattr(self._spare, "get_reward", None))
        self._schemas = tool_schemas(self.tools + environment_tools(self._spare))
        self._check_names()

    @staticmethod
    def _check_args(
        tools: Sequence[Callable[..., Any]], factory: object, max_tool_output_chars: int
    ) -> None:
        if not tools and factory is None:
            raise ValueError("SessionFactory needs tools, an environment_factory, or both.")
        for tool in tools:
            if not callable(tool):
                raise TypeError(f"tools must be functions; got {tool!r}.")
        if factory is not None and not callable(factory):
            raise TypeError(
                f"environment_factory must be a zero-argument callable (e.g. the class); "
                f"got {factory!r}."
            )
        if max_tool_output_chars < 1:
            raise ValueError(f"max_tool_output_chars must be >= 1; got {max_tool_output_chars}.")

    def _instance(self) -> object:
        assert self.environment_factory is not None
        try:
            environment = self.environment_factory()
        except TypeError as error:  # a tool function or a class needing arguments
            name = getattr(self.environment_factory, "__qualname__", self.environment_factory)
            raise ValueError(
                f"environment_factory {name} must build an environment without arguments "
                f"(calling it failed: {error}). Pass the environment's class (or a function "
                "returning an instance); plain tool functions go in tools."
            ) from error
        if not callable(getattr(environment, "reset", None)):
            raise ValueError(
                f"The environment {type(environment).__name__} returned by environment_factory "
                "has no reset method. Define reset(self, **kwargs) -> str | None: it gets the "
                "dataset row's columns and may return text to append to the prompt."
            )
        return environment

    def _check_names(self) -> None:
        counts = Counter(self.tool_names)
        twice = sorted(name for name, n in counts.items() if n > 1)
        if twice:
            raise ValueError(
                f"Two tools share the name(s) {twice} (tools and the environment's methods "
                "together); the model calls a tool by name, so rename one."
            )

    def __getstate__(self) -> dict[str, Any]:
        # The spare instance may hold what cannot be pickled; a copy builds its own.
        return {**self.__dict__, "_spare": None}

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The JSON schemas of all tools, for ``apply_chat_template(tools=...)``."""
        return self._schemas

    @property
    def tool_names(self) -> list[str]:
        return [schema["function"]["name"] for schema in self._schemas]

    def describe(self) -> dict[str, Any]:
        """For the model card: the tools, the environment's class, what it defines."""
        return {
            "environment": self.environment_name,
            "tools": self.tool_names,
            "feedback": self.has_feedback,
            "reward": self.has_reward,
        }

    def new(self) -> Session:
        """A session with a fresh environment instance (call its ``reset(row)`` next)."""
        environment = None
        if self.environment_factory is not None:
            environment, self._spare = self._spare or self._instance(), None
        tools = self.tools + environment_tools(environment)
        by_name = dict(zip(self.tool_names, tools, strict=True))
        return Session(
            environment, by_name, self._schemas, self._runner, self.max_tool_output_chars
        )

    def restore(
        self, state: dict[str, Any], tokenizer: Any, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> Session:
        """A session re-created from ``Session.state_dict()``: new instance, ``reset`` with the
        same row, the model's turns replayed (see :class:`Session` for what that guarantees)."""
        session = self.new()
        if state.get("row") is not None:
            session.reset(state["row"])
        for text in state.get("texts", []):
            session.respond(text, tokenizer, timeout_s)
        return session

    def abandoned_threads(self) -> dict[str, int]:
        """Tool calls abandoned on timeout whose threads are still running, per tool."""
        return self._runner.abandoned()

    def close(self) -> None:
        """Stop the event loop of the environment calls (a later call starts a new one)."""
        self._runner.close()
