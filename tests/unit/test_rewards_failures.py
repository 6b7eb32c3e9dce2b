"""Rewards that fail loudly (rewards/health.py, rewards/threads.py): a function that raises on
every row, or on most rows over a window, stops the run naming it, its error and the fix;
occasional failures stay counted warnings; a thread-run function that times out is reported once
with the fix and stops the run once too many of its threads still run."""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rlvr_lightning.rewards import RewardCombiner, RewardFailureError, RewardTimeoutError
from rlvr_lightning.rewards.health import last_line
from rlvr_lightning.rewards.threads import AbandonedThreads

LOGGER = "rlvr_lightning.rewards.combine"


def short_and_right(completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    """The README's old example: ``a in c`` raises TypeError when the answers are ints (CSV)."""
    rows = zip(completions, answer, strict=True)
    return [1.0 if a in c and len(c) < 20 else 0.0 for c, a in rows]


def test_raising_on_every_row_stops_naming_function_error_and_fix() -> None:
    combiner = RewardCombiner([short_and_right], timeout_s=None)
    with pytest.raises(RewardFailureError) as info:
        combiner(["4", "5", "x"], {"answer": [4, 5, 6]})
    first, fix = str(info.value).splitlines()
    assert first.startswith("Reward function 'short_and_right' raised on all 3 rows of a batch: ")
    # The first traceback's last line, and where it was raised.
    assert "TypeError: 'in <string>' requires string as left operand, not int" in first
    assert "(at test_rewards_failures.py:" in first
    assert fix.startswith("Fix: make the function return 0.0 (or None")
    assert "rewards.max_failure_share: null" in fix


def test_a_missing_column_caught_by_kwargs_stops_too() -> None:
    def needs_solution(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(c == s) for c, s in zip(completions, kwargs["solution"], strict=True)]

    with pytest.raises(RewardFailureError, match="KeyError: 'solution'"):
        RewardCombiner([needs_solution], timeout_s=1.0)(["a", "b"], {"answer": ["a", "b"]})


def fails_on_bad(completions: list[str], **_: Any) -> list[float]:
    if "bad" in completions:
        raise ValueError("cannot parse 'bad'")
    return [1.0] * len(completions)


def test_occasional_failures_stay_counted_warnings(caplog: pytest.LogCaptureFixture) -> None:
    combiner = RewardCombiner([fails_on_bad], timeout_s=None, failure_window=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(12):  # 1 of 4 rows fails: 25% <= 50%, window full from the 4th call
            result = combiner(["ok", "bad", "ok", "ok"], {})
    assert result.metrics["reward/fails_on_bad/failures"] == 12.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "'fails_on_bad' raised on 1 row(s)" in warnings[0].getMessage()


def test_most_rows_failing_over_the_window_stops_once_it_is_full() -> None:
    combiner = RewardCombiner([fails_on_bad], timeout_s=None, failure_window=3)
    batch = ["bad", "bad", "ok"]  # 2 of 3 rows fail (67% > 50%), never all of them
    combiner(batch, {})
    combiner(batch, {})  # the window is not full yet: no judgement on two batches
    with pytest.raises(RewardFailureError) as info:
        combiner(batch, {})
    message = str(info.value)
    assert "'fails_on_bad' failed or timed out on 6 of 9 rows over the last 3 batches" in message
    assert "max_failure_share=0.5" in message
    assert "first error: ValueError: cannot parse 'bad'" in message


def test_the_window_forgets_old_batches() -> None:
    combiner = RewardCombiner([fails_on_bad], timeout_s=None, failure_window=2)
    combiner(["bad", "bad", "ok"], {})
    combiner(["ok", "ok", "ok"], {})  # 2 of 6 over the window
    for _ in range(3):
        combiner(["ok", "bad", "ok"], {})  # 1 of 3 per batch: 2 of 6
    # Over all six batches 7 of 18 rows failed; the window holds this batch and the last: 3 of
    # 6 = 50%, not more, so no stop (the first batch's 2 failures were forgotten).
    result = combiner(["bad", "bad", "ok"], {})
    assert result.metrics["reward/fails_on_bad/failures"] == 7.0


@pytest.mark.parametrize(
    ("kwargs", "batch"),
    [
        pytest.param({"max_failure_share": None}, ["bad", "bad"], id="stop-rules-off"),
        pytest.param({}, ["bad"], id="one-row-batch"),
    ],
)
def test_no_stop_when_off_or_on_a_single_row(kwargs: dict[str, Any], batch: list[str]) -> None:
    combiner = RewardCombiner([fails_on_bad], timeout_s=None, **kwargs)
    result = combiner(batch, {})
    assert result.metrics["reward/fails_on_bad/failures"] == len(batch)


def test_nan_under_nan_policy_fail_never_stops() -> None:
    def all_nan(completions: list[str]) -> list[float]:
        return [float("nan")] * len(completions)

    combiner = RewardCombiner([all_nan], timeout_s=None, nan_policy="fail", failure_window=1)
    for _ in range(3):
        result = combiner(["a", "b"], {})
    assert result.metrics["reward/all_nan/failures"] == 6.0  # counted, as the user asked


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_failure_share": 1.5}, "max_failure_share must be in"),
        ({"failure_window": 0}, "failure_window must be >= 1"),
        ({"max_abandoned_threads": 0}, "max_abandoned_threads must be >= 1"),
    ],
)
def test_limits_are_validated(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardCombiner([fails_on_bad], **kwargs)


def test_last_line_of_a_traceback() -> None:
    error = (
        "Traceback (most recent call last):\n"
        '  File "/x/contract.py", line 80, in _call\n    return fn(completions)\n'
        '  File "/home/u/my_rewards.py", line 3, in short_and_right\n    return [a in c]\n'
        "TypeError: 'in <string>' requires string as left operand, not int\n"
    )
    assert last_line(error) == (
        "TypeError: 'in <string>' requires string as left operand, not int "
        "(at my_rewards.py:3 in short_and_right)"
    )
    assert last_line(None) == "its worker process died"


# --- thread-run rewards that time out -------------------------------------------------------


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """Set at the end of a test: lets the spinning threads it abandoned return."""
    event = threading.Event()
    yield event
    event.set()


def test_spinning_thread_reward_reported_once_then_stops(
    release: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    def spin(completions: list[str]) -> list[float]:
        while not release.is_set():  # `while True: pass` that the test can end
            pass
        return [0.0] * len(completions)

    combiner = RewardCombiner([spin], timeout_s=0.1, max_abandoned_threads=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = combiner(["a", "b"], {})
        with pytest.raises(RewardTimeoutError) as info:
            combiner(["a", "b"], {})
    assert first.metrics["reward/spin/timeouts"] == 1.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # reported once, with the fix
    assert "its thread keeps running" in warnings[0] and "module level" in warnings[0]
    message = str(info.value)
    assert "'spin' ran past timeout_s=0.1 in 2 calls whose threads are still running" in message
    assert "max_abandoned_threads=2" in message
    assert "rewards.isolate" in message  # the fix


def slow(completions: list[str]) -> list[float]:
    time.sleep(0.3)
    return [1.0] * len(completions)


def test_a_slow_call_that_finishes_does_not_count_toward_the_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    combiner = RewardCombiner([slow], timeout_s=0.05, max_abandoned_threads=2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            result = combiner(["a"], {})
            time.sleep(0.5)  # the abandoned thread returns in the meantime
    assert result.metrics["reward/slow/timeouts"] == 3.0
    # A module-level function: the fix names rewards.isolate / run_in_process directly.
    assert "list 'slow' in model.init_args.rewards.isolate" in caplog.text


def test_timing_out_on_most_batches_stops_like_failing() -> None:
    combiner = RewardCombiner([slow], timeout_s=0.05, max_abandoned_threads=None, failure_window=2)
    combiner(["a", "b"], {})
    with pytest.raises(RewardFailureError) as info:
        combiner(["a", "b"], {})
    assert "failed or timed out on 4 of 4 rows over the last 2 batches" in str(info.value)
    assert "first error: ran past timeout_s=0.05" in str(info.value)


def test_abandoned_threads_do_not_stop_a_copy(release: threading.Event) -> None:
    threads = AbandonedThreads(max_abandoned=2)
    assert threads.run(release.wait, 0.05, "waits", "Fix: none") is None
    assert threads.running("waits") == 1
    copy = pickle.loads(pickle.dumps(threads))  # a combiner copied with its module
    assert copy.running("waits") == 0 and copy.max_abandoned == 2


def test_a_copy_pickled_before_tools_counted_threads_still_stops(release: threading.Event) -> None:
    old = AbandonedThreads.__new__(AbandonedThreads)
    old.__setstate__({"max_abandoned": 1, "_abandoned": {}})  # the state pickled before
    with pytest.raises(RewardTimeoutError, match="Reward function 'waits' ran past"):
        old.run(release.wait, 0.05, "waits", "Fix: none")
