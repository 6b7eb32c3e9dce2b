"""RewardCombiner in the trainer's process: weights, None, column filtering, row isolation,
thread timeouts and the return-value contract (rewards/combine.py). Worker processes:
test_rewards_isolation.py."""

from __future__ import annotations

import doctest
import logging
import math
import time
from typing import Any

import pytest
import torch

from rlvr_lightning.rewards import OverlongPenalty, RewardCombiner, RewardContractError
from rlvr_lightning.rewards import combine as combine_module

LOGGER = "rlvr_lightning.rewards.combine"


def length_reward(completions: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]


def exact(completions: list[str], answer: list[str | None]) -> list[float | None]:
    return [None if a is None else float(c == a) for c, a in zip(completions, answer, strict=True)]


def fails_on_bad(completions: list[str], **_: Any) -> list[float]:
    if any(c == "bad" for c in completions):
        raise RuntimeError("cannot score 'bad'")
    return [1.0] * len(completions)


def hangs(completions: list[str]) -> list[float]:
    time.sleep(5)
    return [1.0] * len(completions)


def test_doctests() -> None:
    result = doctest.testmod(combine_module)
    assert result.attempted > 0
    assert result.failed == 0


def test_weighted_total_with_none() -> None:
    combiner = RewardCombiner([exact, length_reward], weights=[2.0, 0.5], timeout_s=None)
    result = combiner(["ab", "abc", "x"], {"answer": ["ab", "zzz", None]})
    # row 0: 2*1 + 0.5*2 = 3; row 1: 2*0 + 0.5*3 = 1.5; row 2: exact is None -> 0.5*1 = 0.5
    torch.testing.assert_close(result.total, torch.tensor([3.0, 1.5, 0.5]))
    assert result.total.dtype == torch.float32
    assert math.isnan(result.per_function["exact"][2])
    assert result.metrics["reward/exact/mean"] == pytest.approx(0.5)  # nanmean of [1, 0]
    assert result.metrics["reward/length_reward/mean"] == pytest.approx(2.0)


def test_row_where_every_function_is_none_scores_zero() -> None:
    combiner = RewardCombiner([exact], timeout_s=None)
    result = combiner(["a", "b"], {"answer": [None, "b"]})
    torch.testing.assert_close(result.total, torch.tensor([0.0, 1.0]))
    all_none = combiner(["a"], {"answer": [None]})
    assert "reward/exact/mean" not in all_none.metrics  # nothing applicable, nothing to average


def test_columns_filtered_by_signature() -> None:
    seen: dict[str, set[str]] = {}

    def named(
        completions: list[str], answer: list[str], extra: list[int] | None = None
    ) -> list[float]:
        seen["named"] = {"answer"} | ({"extra"} if extra is not None else set())
        return [0.0] * len(completions)

    def takes_all(completions: list[str], **columns: list[Any]) -> list[float]:
        seen["takes_all"] = set(columns)
        return [0.0] * len(completions)

    combiner = RewardCombiner([named, takes_all])
    combiner(["a"], {"answer": ["a"], "solution": ["s"], "completion_length": [1]})
    # **kwargs also catches TRL's non-row arguments, as GRPOTrainer passes them to every reward.
    trl_args = {"trainer_state", "log_extra", "log_metric"}
    assert seen == {
        "named": {"answer"},
        "takes_all": {"answer", "solution", "completion_length", *trl_args},
    }


def test_default_names() -> None:
    combiner = RewardCombiner([exact, exact, OverlongPenalty(10, 4)])
    assert combiner.names == ["exact", "exact_2", "overlong_penalty"]
    with pytest.raises(ValueError, match="distinct name"):
        RewardCombiner([exact, length_reward], names=["a", "a"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weights": [1.0]}, "one weight per function"),
        ({"names": ["only_one"]}, "one distinct name per function"),
        ({"timeout_s": -1.0}, "timeout_s"),
    ],
)
def test_constructor_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RewardCombiner([exact, length_reward], **kwargs)


def test_missing_column_names_function_column_and_available() -> None:
    combiner = RewardCombiner([exact])
    with pytest.raises(ValueError) as info:
        combiner(["a"], {"solution": ["s"], "completion_length": [1]})
    message = str(info.value)
    assert "'exact'" in message
    assert "'answer'" in message
    assert "['completion_length', 'solution']" in message


def test_raising_function_isolated_per_row(caplog: pytest.LogCaptureFixture) -> None:
    combiner = RewardCombiner([fails_on_bad, length_reward], timeout_s=1.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = combiner(["ok", "bad", "ok"], {})
        second = combiner(["bad", "ok"], {})
    torch.testing.assert_close(first.per_function["fails_on_bad"], torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(second.per_function["fails_on_bad"], torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(first.total, torch.tensor([3.0, 3.0, 3.0]))  # 1+2, 0+3, 1+2
    assert first.metrics["reward/fails_on_bad/failures"] == 1.0
    assert second.metrics["reward/fails_on_bad/failures"] == 2.0  # cumulative over calls
    assert second.metrics["reward/length_reward/failures"] == 0.0
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'fails_on_bad' raised on 1 row(s)" in warnings[0].getMessage()
    assert "RuntimeError: cannot score 'bad'" in warnings[0].getMessage()  # with its traceback


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        (["x"], r"'broken' returned str 'x' for completion 0; expected a float, or None"),
        ([1.0, 2.0], r"'broken' returned 2 values for 1 completion\(s\); expected one float"),
        ({"a": 1.0}, r"'broken' returned dict \{'a': 1.0\}; expected a list of 1 float or None"),
        ("1", r"'broken' returned str '1'; expected a list of 1 float or None"),
        (None, r"'broken' returned NoneType None; expected a list"),
    ],
)
def test_bad_return_raises_naming_the_function(returned: Any, match: str) -> None:
    def broken(completions: list[str]) -> Any:
        return returned

    combiner = RewardCombiner([length_reward, broken], timeout_s=None)
    with pytest.raises(RewardContractError, match=match):
        combiner(["a"], {})


def test_bad_return_on_the_row_retry_raises() -> None:
    def raises_then_garbage(completions: list[str]) -> list[Any]:
        if len(completions) > 1:
            raise RuntimeError("batch")
        return ["oops"]

    combiner = RewardCombiner([raises_then_garbage], timeout_s=1.0)
    with pytest.raises(RewardContractError, match="returned str 'oops' for completion 0"):
        combiner(["a", "b"], {})


def test_hanging_function_times_out(caplog: pytest.LogCaptureFixture) -> None:
    combiner = RewardCombiner([hangs, length_reward], timeout_s=0.2)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = combiner(["ab", "c"], {})
    assert time.monotonic() - start < 2.0
    torch.testing.assert_close(result.per_function["hangs"], torch.tensor([0.0, 0.0]))
    torch.testing.assert_close(result.total, torch.tensor([2.0, 1.0]))
    assert result.metrics["reward/hangs/timeouts"] == 1.0
    assert result.metrics["reward/length_reward/timeouts"] == 0.0
    assert "timeout_s=0.2" in caplog.text


def test_tensor_returns_accepted() -> None:
    def as_tensor(completions: list[str]) -> torch.Tensor:
        return torch.tensor([[1.0], [0.5]])  # [N, 1] is flattened

    result = RewardCombiner([as_tensor])(["a", "b"], {})
    torch.testing.assert_close(result.total, torch.tensor([1.0, 0.5]))


def nan_second(completions: list[str]) -> list[float | None]:
    return [1.0, math.nan, None, math.inf][: len(completions)]


def test_nan_is_an_error_by_default() -> None:
    combiner = RewardCombiner([nan_second], timeout_s=None)
    with pytest.raises(RewardContractError) as info:
        combiner(["a", "b", "c", "d"], {})
    message = str(info.value)
    assert "'nan_second' returned nan for completion 1 (2 of 4 rows)" in message  # NaN and inf
    assert "nan_policy='fail'" in message  # says how to opt out


def test_nan_policy_fail_scores_zero_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    combiner = RewardCombiner([nan_second], timeout_s=None, nan_policy="fail")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = combiner(["a", "b", "c", "d"], {})
    # NaN and inf rows score 0.0 and count; None stays "not applicable" (NaN in per_function).
    torch.testing.assert_close(
        result.per_function["nan_second"], torch.tensor([1.0, 0.0, math.nan, 0.0]), equal_nan=True
    )
    torch.testing.assert_close(result.total, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert result.metrics["reward/nan_second/failures"] == 2.0
    assert "nan_second" in caplog.text


def test_nan_policy_validated() -> None:
    with pytest.raises(ValueError, match="nan_policy must be 'error' or 'fail'"):
        RewardCombiner([exact], nan_policy="skip")  # type: ignore[arg-type]


# --- the TRL-compatible part of the contract ------------------------------------------------


def trl_order(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
    return [float(c.startswith(p)) for p, c in zip(prompts, completions, strict=True)]


def keyword_only(*, completions: list[str], answer: list[str]) -> list[float]:
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


async def async_reward(completions: list[str], answer: list[str]) -> list[float]:
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


async def async_fails_on_bad(completions: list[str]) -> list[float]:
    if "bad" in completions:
        raise RuntimeError("cannot score 'bad'")
    return [1.0] * len(completions)


def test_completions_by_keyword_when_a_parameter_is_named_completions() -> None:
    combiner = RewardCombiner([trl_order, keyword_only], timeout_s=None)
    result = combiner(["ab", "x"], {"prompts": ["a", "a"], "answer": ["ab", "y"]})
    torch.testing.assert_close(result.per_function["trl_order"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(result.per_function["keyword_only"], torch.tensor([1.0, 0.0]))
    assert combiner.required_columns() == {"trl_order": ("prompts",), "keyword_only": ("answer",)}


@pytest.mark.parametrize("timeout_s", [None, 5.0])  # inline, and in a thread
def test_async_rewards_are_awaited(timeout_s: float | None) -> None:
    combiner = RewardCombiner([async_reward, async_fails_on_bad], timeout_s=timeout_s)
    result = combiner(["a", "bad"], {"answer": ["a", "b"]})
    torch.testing.assert_close(result.per_function["async_reward"], torch.tensor([1.0, 0.0]))
    # The batch raised, the row retry (awaited too) costs only the bad row.
    torch.testing.assert_close(result.per_function["async_fails_on_bad"], torch.tensor([1.0, 0.0]))
    assert result.metrics["reward/async_fails_on_bad/failures"] == 1.0


def test_async_reward_inside_a_running_event_loop() -> None:
    import asyncio

    async def inside() -> torch.Tensor:
        return RewardCombiner([async_reward], timeout_s=None)(["a"], {"answer": ["a"]}).total

    torch.testing.assert_close(asyncio.run(inside()), torch.tensor([1.0]))


def test_check_available_names_reward_column_and_columns() -> None:
    combiner = RewardCombiner([exact, trl_order], timeout_s=None)
    combiner.check_available(["answer"], "training source 'd'")  # prompts: the module's
    with pytest.raises(ValueError) as info:
        combiner.check_available(["topic"], "training source 'd'")
    message = str(info.value)
    assert "Reward function 'exact' needs column 'answer'" in message
    assert "training source 'd' has only ['topic'] (plus prompts, completion_ids" in message
