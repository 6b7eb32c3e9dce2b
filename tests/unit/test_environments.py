"""Multi-turn environments (rlvr_lightning/environments): TRL's environment contract, the
robustness of a turn (malformed, raising, hanging, huge tool calls), feedback, resume and
execution feedback."""

from __future__ import annotations

import asyncio
import copy
import threading
import time

import pytest

from rlvr_lightning.environments import (
    ExecutionFeedback,
    SessionFactory,
    ToolTimeoutError,
    arespond_all,
    respond_all,
)
from rlvr_lightning.rewards.code import CodeTestsReward
from rlvr_lightning.testing import add
from rlvr_lightning.testing import tool_call as call


class IncrementEnv:
    """The shape of TRL's documentation example for ``environment_factory``."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.row = kwargs
        return f"The counter starts at {self.counter}."

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return 1.0 if self.counter == 3 else 0.0

    def _helper(self) -> None:
        """Private: not a tool."""


# --- a turn: results, errors, concurrency -------------------------------------------------


def test_trl_style_environment_runs_unchanged(tokenizer) -> None:
    factory = SessionFactory(environment_factory=IncrementEnv)
    assert factory.describe() == {
        "environment": "IncrementEnv",
        "tools": ["increment"],
        "feedback": False,
        "reward": True,
    }
    session = factory.new()
    assert session.reset({"prompt": "count to 3", "level": 2}) == "The counter starts at 0."
    assert session.environment.row == {"prompt": "count to 3", "level": 2}  # columns as kwargs
    turn = session.respond(call("increment", step=1) + call("increment", step=2), tokenizer)
    assert turn.messages == [
        {"role": "tool", "name": "increment", "content": "1"},
        {"role": "tool", "name": "increment", "content": "3"},
    ]
    assert (turn.tool_calls, turn.tool_errors, turn.done) == (2, 0, False)
    assert turn.assistant["tool_calls"][1]["function"] == {
        "name": "increment",
        "arguments": {"step": 2},
    }
    assert session.respond("I am done.", tokenizer).done  # no call, no feedback: the end
    assert session.reward() == 1.0


def test_each_session_has_its_own_environment(tokenizer) -> None:
    factory = SessionFactory(environment_factory=IncrementEnv)
    a, b = factory.new(), factory.new()
    a.reset({}), b.reset({})
    respond_all([a, b], [call("increment", step=3), call("increment", step=1)], tokenizer)
    assert (a.reward(), b.reward()) == (1.0, 0.0)


def test_environment_without_reset_is_refused_naming_it() -> None:
    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: anything.
            """
            return x

    with pytest.raises(ValueError, match=r"NoReset .* has no reset method"):
        SessionFactory(environment_factory=NoReset)


def test_tool_names_must_be_unique() -> None:
    def increment(step: int) -> int:
        """Same name as the environment's method.

        Args:
            step: anything.
        """
        return step

    with pytest.raises(ValueError, match=r"share the name\(s\) \['increment'\]"):
        SessionFactory(tools=[increment], environment_factory=IncrementEnv)


def test_unknown_tool_and_wrong_arguments_are_counted_errors(tokenizer) -> None:
    session = SessionFactory(tools=[add]).new()
    turn = session.respond(call("mul", a=1) + call("add", c=1) + call("add", a=1), tokenizer)
    contents = [m["content"] for m in turn.messages]
    assert "unknown tool 'mul'; the tools are: add" in contents[0]
    assert (
        "wrong arguments for tool 'add'" in contents[1]
        and "(a: integer, b: integer (optional))" in contents[1]
    )
    assert contents[2] == "1"
    assert (turn.tool_calls, turn.tool_errors) == (3, 2)


def test_malformed_call_reaches_the_model_in_a_tool_message(tokenizer) -> None:
    session = SessionFactory(tools=[add]).new()
    turn = session.respond('<tool_call>{"name": "add", "arguments": {a: 1}}</tool_call>', tokenizer)
    assert turn.messages[0]["role"] == "tool" and "not valid JSON" in turn.messages[0]["content"]
    assert (turn.tool_calls, turn.tool_errors, turn.done) == (1, 1, False)


def test_raising_tool_is_a_counted_error(tokenizer) -> None:
    def boom(x: int) -> str:
        """Fail.

        Args:
            x: anything.
        """
        raise RuntimeError("kaput")

    turn = SessionFactory(tools=[boom]).new().respond(call("boom", x=1), tokenizer)
    assert turn.messages[0]["content"] == "Error: tool boom raised RuntimeError: kaput"
    assert turn.tool_errors == 1 and turn.errors == ["tool boom raised RuntimeError: kaput"]


def test_huge_tool_output_is_truncated_and_counted(tokenizer) -> None:
    def flood(n: int) -> str:
        """Return n characters.

        Args:
            n: how many.
        """
        return "x" * n

    turn = SessionFactory(tools=[flood]).new().respond(call("flood", n=1_000_000), tokenizer)
    content = turn.messages[0]["content"]
    assert content == "x" * 4000 + "\n[truncated 996000 characters]"
    assert turn.tool_errors == 1 and "max_tool_output_chars" in turn.errors[0]
    small = SessionFactory(tools=[flood], max_tool_output_chars=10).new()
    assert (
        small.respond(call("flood", n=12), tokenizer)
        .messages[0]["content"]
        .endswith("[truncated 2 characters]")
    )


def test_hanging_tool_times_out_without_holding_up_the_other_rows(tokenizer) -> None:
    release = threading.Event()

    def hang(x: int) -> str:
        """Wait for the test to release it.

        Args:
            x: returned.
        """
        release.wait(30)
        return str(x)

    factory = SessionFactory(tools=[hang, add])
    sessions = [factory.new() for _ in range(3)]
    texts = [call("hang", x=1) + call("add", a=5), call("add", a=2), call("add", a=3)]
    start = time.monotonic()
    try:
        turns = respond_all(sessions, texts, tokenizer, timeout_s=0.5)
        took = time.monotonic() - start
        assert factory.abandoned_threads() == {"hang": 1}
    finally:
        release.set()
    assert took < 1.5  # the hang's own timeout, not one per row
    hung = turns[0]
    assert hung.messages[0]["content"] == "Error: tool hang timed out after 0.5s"
    assert "an earlier call of this turn timed out" in hung.messages[1]["content"]
    assert (hung.tool_calls, hung.tool_errors) == (2, 2)
    assert [t.messages[0]["content"] for t in turns[1:]] == ["2", "3"]


def test_too_many_abandoned_threads_stop_the_run_with_the_fix(tokenizer) -> None:
    release = threading.Event()

    def hang(x: int) -> str:
        """Wait.

        Args:
            x: anything.
        """
        release.wait(30)
        return ""

    factory = SessionFactory(tools=[hang], max_abandoned_threads=2)
    sessions = [factory.new() for _ in range(2)]
    try:
        with pytest.raises(ToolTimeoutError, match=r"(?s)Tool 'hang' ran past.*Fix: "):
            respond_all(sessions, [call("hang", x=1)] * 2, tokenizer, timeout_s=0.2)
    finally:
        release.set()


def test_async_tools_run_together_and_are_cancelled_on_timeout(tokenizer) -> None:
    cancelled = []

    async def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: how long.
        """
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            cancelled.append(seconds)
            raise
        return "slept"

    factory = SessionFactory(tools=[slow])
    sessions = [factory.new() for _ in range(4)]
    start = time.monotonic()
    turns = respond_all(
        sessions, [call("slow", seconds=0.4)] * 3 + [call("slow", seconds=9)], tokenizer, 1.0
    )
    assert time.monotonic() - start < 2.0  # 0.4 s rows together, the 9 s row cut at 1 s
    assert [t.messages[0]["content"] for t in turns[:3]] == ["slept"] * 3
    assert turns[3].messages[0]["content"] == "Error: tool slow timed out after 1s"
    assert cancelled == [9] and factory.abandoned_threads() == {}


# --- feedback, rewards, resume ------------------------------------------------------------


class Guess:
    """An environment with this project's ``feedback`` and an async ``get_reward``."""

    def reset(self, target: int, **_: object) -> None:
        self.target, self.tries = target, 0

    def feedback(self, answer: str) -> str | None:
        self.tries += 1
        return None if answer.strip() == str(self.target) else "Try again."

    async def get_reward(self) -> float:
        return 1.0 / self.tries


def test_feedback_is_the_next_user_turn_and_none_ends(tokenizer) -> None:
    factory = SessionFactory(environment_factory=Guess)
    assert factory.describe()["tools"] == [] and factory.describe()["feedback"]
    session = factory.new()
    session.reset({"target": 7})
    wrong = session.respond("5", tokenizer)
    assert wrong.messages == [{"role": "user", "content": "Try again."}] and not wrong.done
    assert session.respond("7", tokenizer).done
    assert session.reward() == 0.5


def test_feedback_that_raises_or_hangs_ends_the_trajectory_with_an_error(tokenizer) -> None:
    release = threading.Event()

    class Broken:
        feedback_timeout_s = 0.3  # raises the turn's 0.1 s timeout for feedback only

        def reset(self, **_: object) -> None:
            pass

        def feedback(self, answer: str) -> str | None:
            if answer == "hang":
                release.wait(30)
            raise KeyError(answer)

    factory = SessionFactory(environment_factory=Broken)
    sessions = [factory.new(), factory.new()]
    for session in sessions:
        session.reset({})
    start = time.monotonic()
    try:
        raised, hung = respond_all(sessions, ["oops", "hang"], tokenizer, timeout_s=0.1)
    finally:
        release.set()
    assert 0.3 <= time.monotonic() - start < 1.5
    assert raised.done and raised.errors == ["Broken.feedback raised KeyError: 'oops'"]
    assert hung.done and hung.errors == ["Broken.feedback timed out after 0.3s"]


def test_restore_replays_the_turns(tokenizer) -> None:
    factory = SessionFactory(environment_factory=IncrementEnv)
    session = factory.new()
    session.reset({"prompt": "p"})
    session.respond(call("increment", step=2), tokenizer)
    session.respond(call("increment", step=1), tokenizer)
    state = copy.deepcopy(session.state_dict())
    restored = factory.restore(state, tokenizer)
    assert restored.environment.counter == 3 and restored.reward() == session.reward() == 1.0
    assert restored.state_dict() == session.state_dict()


def test_factory_survives_a_copy_after_use(tokenizer) -> None:
    factory = SessionFactory(tools=[add])
    factory.new().respond(call("add", a=1), tokenizer)
    twin = copy.deepcopy(factory)
    assert twin.new().respond(call("add", a=2, b=3), tokenizer).messages[0]["content"] == "5"


def test_execution_feedback_on_math(tokenizer) -> None:
    factory = SessionFactory(environment_factory=ExecutionFeedback)
    session = factory.new()
    session.reset({"prompt": "What is 12 + 45?", "answer": "57"})
    wrong = session.respond(r"12 + 45 = \boxed{56}", tokenizer)
    assert wrong.messages[0]["content"] == (
        r"Your answer 56 is not correct. Check your work and give the final answer in \boxed{}."
    )
    assert "57" not in wrong.messages[0]["content"] and session.reward() == 0.0
    unboxed = session.respond("It is 57.", tokenizer)
    assert "final answer" in unboxed.messages[0]["content"] and session.reward() == 0.0
    right = session.respond(r"So \boxed{57}.", tokenizer)
    assert right.done and right.messages == [] and session.reward() == 1.0


def test_execution_feedback_needs_tests_or_answer() -> None:
    with pytest.raises(ValueError, match=r"'tests' column .* 'answer' column .* \['prompt'\]"):
        ExecutionFeedback().reset(prompt="p")


def test_execution_feedback_on_code_shows_failures_not_expected_values(tokenizer) -> None:
    sandbox = CodeTestsReward(timeout_s=3.0, case_timeout_s=2.0)
    factory = SessionFactory(environment_factory=lambda: ExecutionFeedback(sandbox=sandbox))
    session = factory.new()
    session.reset({"prompt": "Write f.", "tests": ["assert f(1) == 12", "assert f(0) == 11"]})
    wrong = session.respond("```python\ndef f(x):\n    return x + 10\n```", tokenizer)
    text = wrong.messages[0]["content"]
    assert text.startswith("Your code fails 2 of 2 tests:\nTest 1: `f(1)` returned 11, which is")
    assert "12" not in text and not wrong.done and session.reward() == 0.0
    right = session.respond("```python\ndef f(x):\n    return x + 11\n```", tokenizer)
    assert right.done and session.reward() == 1.0


def test_arespond_all_runs_on_the_callers_loop(tokenizer) -> None:
    factory = SessionFactory(tools=[add])
    sessions = [factory.new(), factory.new()]
    texts = [call("add", a=1, b=1), "no call"]
    turns = asyncio.run(arespond_all(sessions, texts, tokenizer, timeout_s=1.0))
    assert turns[0].messages[0]["content"] == "2" and turns[1].done
    assert sessions[0].state_dict()["texts"] == [texts[0]]
