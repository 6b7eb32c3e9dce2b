"""Reward functions in worker processes: marking, kill on timeout, crashes, interrupts
(rewards/isolation.py, rewards/combine.py). One pool serves the whole module: starting the
forkserver imports the package once (seconds); a replacement worker is then a fork (~0.1 s)."""

from __future__ import annotations

import doctest
import os
import pickle
import signal
import sys
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from rlvr_lightning.rewards import (
    RewardCombiner,
    RewardContractError,
    RewardFailureError,
    RewardWorkers,
    boxed_accuracy,
    boxed_format,
    faults,
)
from rlvr_lightning.rewards import isolation as isolation_module


def defined_in_a_test_file(completions: list[str]) -> list[float]:
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def workers() -> Iterator[RewardWorkers]:
    pool = RewardWorkers(1, preload=["rlvr_lightning.rewards.faults", "math_verify"])
    pid_of_worker(pool)  # start it here, so that no test is timed with the start
    yield pool
    pool.close()


def pid_of_worker(workers: RewardWorkers) -> int:
    result = RewardCombiner([faults.worker_pid], timeout_s=5.0, workers=workers)(["x"], {})
    return int(result.per_function["worker_pid"][0])


def test_doctests() -> None:
    result = doctest.testmod(isolation_module)
    assert result.attempted > 0
    assert result.failed == 0


def test_marked_functions_run_in_workers_by_default() -> None:
    assert RewardCombiner([boxed_accuracy, boxed_format]).isolated == ["boxed_accuracy"]
    assert RewardCombiner([boxed_accuracy, boxed_format], isolate=False).isolated == []
    assert RewardCombiner([boxed_accuracy, boxed_format], isolate=True).isolated == [
        "boxed_accuracy",
        "boxed_format",
    ]
    assert RewardCombiner([boxed_accuracy, boxed_format], isolate=["boxed_format"]).isolated == [
        "boxed_format"
    ]
    with pytest.raises(ValueError, match=r"isolate names \['nope'\] are not reward function"):
        RewardCombiner([boxed_accuracy], isolate=["nope"])


def test_unpicklable_function_cannot_be_isolated() -> None:
    with pytest.raises(ValueError, match="'<lambda>' is set to run in a worker process but cannot"):
        RewardCombiner([lambda completions: [1.0] * len(completions)], isolate=True)


def test_isolated_scores_equal_in_process_scores(workers: RewardWorkers) -> None:
    completions = [r"\boxed{\frac{1}{2}}", r"\boxed{2}", "no box"]
    answers = ["0.5", "3", None]
    combiner = RewardCombiner([boxed_accuracy, boxed_format], workers=workers)
    result = combiner(completions, {"answer": answers})
    expected = torch.tensor([1.0, 0.0, float("nan")])
    torch.testing.assert_close(result.per_function["boxed_accuracy"], expected, equal_nan=True)
    assert boxed_accuracy(completions, answer=answers) == [1.0, 0.0, None]
    torch.testing.assert_close(result.total, torch.tensor([2.0, 1.0, 0.0]))


def test_spinning_reward_is_killed_and_does_not_slow_later_calls(workers: RewardWorkers) -> None:
    before = pid_of_worker(workers)
    combiner = RewardCombiner([faults.spin], timeout_s=0.3, workers=workers)
    start = time.monotonic()
    result = combiner(["spin", "x"], {})
    assert time.monotonic() - start < 3.0  # one timeout, plus the kill
    assert result.metrics["reward/spin/timeouts"] == 1.0
    torch.testing.assert_close(result.total, torch.tensor([0.0, 0.0]))
    with pytest.raises(ProcessLookupError):  # the spinning process is gone, not abandoned
        os.kill(before, 0)
    assert pid_of_worker(workers) != before
    assert combiner(["x"], {}).per_function["spin"].tolist() == [1.0]


def test_power_tower_costs_one_timeout(workers: RewardWorkers) -> None:
    combiner = RewardCombiner([boxed_accuracy], timeout_s=0.5, workers=workers)
    result = combiner(
        [faults.POWER_TOWER, r"\boxed{3}"], {"answer": [faults.POWER_TOWER_GOLD, "3"]}
    )
    assert result.metrics["reward/boxed_accuracy/timeouts"] == 1.0
    again = combiner([r"\boxed{3}"], {"answer": ["3"]})
    assert again.per_function["boxed_accuracy"].tolist() == [1.0]
    assert again.metrics["reward/boxed_accuracy/timeouts"] == 1.0  # nothing later


def test_worker_crash_counts_failures_and_is_replaced(workers: RewardWorkers) -> None:
    combiner = RewardCombiner([faults.crash], workers=workers)
    result = combiner(["a", "b"], {})
    torch.testing.assert_close(result.total, torch.tensor([0.0, 0.0]))
    assert result.metrics["reward/crash/failures"] == 2.0
    assert pid_of_worker(workers) > 0


def test_a_worker_that_dies_on_every_batch_stops_the_run(workers: RewardWorkers) -> None:
    combiner = RewardCombiner([faults.crash], workers=workers, failure_window=2)
    combiner(["a", "b"], {})  # one lost batch is not judged: the window needs two
    with pytest.raises(RewardFailureError) as info:
        combiner(["a", "b"], {})
    message = str(info.value)
    assert "'crash' failed or timed out on 4 of 4 rows over the last 2 batches" in message
    assert "first error: its worker process died" in message


def test_contract_checked_on_worker_results(workers: RewardWorkers) -> None:
    with pytest.raises(RewardContractError, match="'nan_values' returned nan for completion 0"):
        RewardCombiner([faults.nan_values], workers=workers)(["a"], {})
    failed = RewardCombiner([faults.nan_values], nan_policy="fail", workers=workers)(["a"], {})
    assert failed.metrics["reward/nan_values/failures"] == 1.0


def test_function_a_worker_cannot_import_fails_clearly(
    workers: RewardWorkers, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module that exists only in this process's sys.modules: pickled here by reference, it
    # cannot be imported in a worker however pytest was started (with the cwd on sys.path,
    # `tests.unit.test_rewards_isolation` itself would be importable there).
    here_only = types.ModuleType("rlvr_test_parent_only")
    monkeypatch.setitem(sys.modules, here_only.__name__, here_only)
    monkeypatch.setattr(defined_in_a_test_file, "__module__", here_only.__name__)
    here_only.defined_in_a_test_file = defined_in_a_test_file
    combiner = RewardCombiner([defined_in_a_test_file], isolate=True, workers=workers)
    with pytest.raises(RuntimeError, match="'defined_in_a_test_file' could not be loaded in a"):
        combiner(["a"], {})


class Interrupted(Exception):
    """Stands in for what a signal handler raises (KeyboardInterrupt, a SIGTERM stop)."""


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted


def test_signal_interrupts_the_wait_and_kills_the_worker(workers: RewardWorkers) -> None:
    combiner = RewardCombiner([faults.hang], timeout_s=60.0, workers=workers)
    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    start = time.monotonic()
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(Interrupted):
            combiner(["a"], {})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < 2.0
    assert pid_of_worker(workers) > 0  # the only worker is free again: the hang was killed


def test_combiner_pickles_without_its_pool() -> None:
    combiner = RewardCombiner([faults.worker_pid, boxed_format])
    first = combiner(["x"], {})
    copy = pickle.loads(pickle.dumps(combiner))
    combiner.close()
    second = copy(["x"], {})
    copy.close()
    assert first.per_function["worker_pid"] != second.per_function["worker_pid"]
    assert copy.isolated == ["worker_pid"]


def test_a_reward_past_the_workers_memory_budget_fails_its_rows_not_the_machine() -> None:
    # 1 GiB budget, 6 GiB asked: MemoryError in the worker, the rows fail and are counted.
    pool = RewardWorkers(1, preload=["rlvr_lightning.rewards.faults"], memory_mb=1024)
    try:
        combiner = RewardCombiner([faults.allocate_gigabytes], workers=pool, max_failure_share=None)
        result = combiner(["a", "b"], {})
        torch.testing.assert_close(result.total, torch.tensor([0.0, 0.0]))
        assert result.metrics["reward/allocate_gigabytes/failures"] == 2.0
    finally:
        pool.close()


def test_the_workers_memory_budget_is_checked() -> None:
    with pytest.raises(ValueError, match="memory_mb >= 64"):
        RewardWorkers(1, memory_mb=8)
    assert (
        RewardCombiner([boxed_accuracy]).worker_memory_mb
        == isolation_module.DEFAULT_WORKER_MEMORY_MB
    )
