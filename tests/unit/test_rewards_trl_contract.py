"""TRL's reward contract where it overlaps (rewards/trl_contract.py): message-list completions
for conversational prompts, strings otherwise; ``trainer_state``, ``log_extra``, ``log_metric``;
TRL's own ``trl.rewards`` functions unchanged on conversational and plain rows.

With ``trl`` installed the test imports its functions; without it, it runs copies written here
from TRL's documented contract (signatures, annotations and results as TRL's docs give them).
"""

from __future__ import annotations

import doctest
import logging
import pickle
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rlvr_lightning.rewards import (
    OverlongPenalty,
    RewardCombiner,
    RewardState,
    answer_accuracy,
    boxed_accuracy,
    boxed_format,
    completion_text,
    signature,
    trl_contract,
)
from rlvr_lightning.rewards.contract import call_isolated

try:
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

    TRL = True
except ImportError:  # copies of TRL 1.16's documented contract, written for this test
    TRL = False
    from math_verify import parse, verify

    def accuracy_reward(  # type: ignore[misc]
        completions: list[list[dict[str, str]]],
        solution: list[str],
        log_extra: Any = None,
        **kwargs: Any,
    ) -> list[float | None]:
        """1.0 when the completion's answer verifies against ``solution``; None when the
        solution does not parse; logs ``solution`` through ``log_extra``."""
        out: list[float | None] = []
        for completion, gold in zip(completions, solution, strict=True):
            gold_parsed = parse(gold)
            answer = parse(completion[0]["content"])
            out.append(float(verify(gold_parsed, answer)) if gold_parsed else None)
        if log_extra is not None:
            log_extra("solution", list(solution))
        return out

    def think_format_reward(  # type: ignore[misc]
        completions: list[list[dict[str, str]]], **kwargs: Any
    ) -> list[float]:
        """1.0 when the completion opens with one ``<think>...</think>`` block."""
        ok = re.compile(r"<think>((?!<think>).)*?</think>((?!<think>).)*", re.DOTALL)
        return [float(bool(ok.fullmatch(c[0]["content"]))) for c in completions]

    def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Any:  # type: ignore[misc]
        """DAPO's soft penalty on ``completion_ids`` lengths (completions arrive in kwargs)."""

        def soft_overlong_punishment(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
            start = max_completion_len - soft_punish_cache
            return [
                0.0
                if len(ids) <= start
                else (start - len(ids)) / soft_punish_cache
                if len(ids) <= max_completion_len
                else -1.0
                for ids in completion_ids
            ]

        return soft_overlong_punishment


CHAT = [{"role": "user", "content": "What is 2 + 2?"}]
TEXTS = ["<think>2 and 2</think> The answer is $\\boxed{4}$.", "I think \\boxed{5}"]


def _columns(prompt: object) -> dict[str, list[Any]]:
    return {"prompts": [prompt, prompt], "solution": ["$4$", "$4$"]}


@pytest.mark.parametrize("prompt", [CHAT, "What is 2 + 2?"], ids=["conversational", "plain"])
def test_trl_rewards_run_unchanged(prompt: object) -> None:
    combiner = RewardCombiner([accuracy_reward, think_format_reward], timeout_s=None)
    result = combiner(TEXTS, _columns(prompt))
    assert result.per_function["accuracy_reward"].tolist() == [1.0, 0.0]
    assert result.per_function["think_format_reward"].tolist() == [1.0, 0.0]
    assert result.metrics["reward/accuracy_reward/failures"] == 0.0
    assert result.metrics["reward/think_format_reward/failures"] == 0.0
    assert result.logged_columns["solution"] == ["$4$", "$4$"]  # through log_extra


def test_trl_reward_on_completion_ids_gets_them_not_the_completions() -> None:
    punish = get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)
    combiner = RewardCombiner([punish], names=["overlong"], timeout_s=None)
    ids = [[1, 2], [1, 2, 3], [1, 2, 3, 4, 5]]
    result = combiner(["a", "b", "c"], {"completion_ids": ids})
    # lengths 2, 3, 5 against start 2, max 4: 0, (2 - 3) / 2, -1
    assert result.per_function["overlong"].tolist() == [0.0, -0.5, -1.0]


def test_completions_follow_each_rows_prompt() -> None:
    seen: list[object] = []

    def record(completions: list[Any], **_: Any) -> list[float]:
        seen.extend(completions)
        return [0.0] * len(completions)

    combiner = RewardCombiner([record], timeout_s=None)
    combiner(["a", "b"], {"prompts": [CHAT, "plain text"]})
    assert seen == [[{"role": "assistant", "content": "a"}], "b"]
    seen.clear()
    combiner(["a", "b"], {"prompts": [CHAT, CHAT]}, conversational=[False, False])  # explicit
    assert seen == ["a", "b"]
    seen.clear()
    combiner(["a"], {})  # no prompts column: plain text, as before
    assert seen == ["a"]


def test_built_in_rewards_score_message_lists_like_text() -> None:
    functions = [boxed_accuracy, answer_accuracy, boxed_format, OverlongPenalty(4, 2)]
    combiner = RewardCombiner(functions, timeout_s=None, isolate=False)
    texts = ["so \\boxed{4}", "it is 4", "\\boxed{ }"]
    columns = {"answer": ["4", "4", "4"], "completion_length": [2, 3, 5]}
    chat = combiner(texts, {**columns, "prompts": [CHAT] * 3})
    plain = combiner(texts, {**columns, "prompts": ["q"] * 3})
    for name, values in plain.per_function.items():
        torch.testing.assert_close(chat.per_function[name], values, equal_nan=True)
    assert chat.per_function["boxed_accuracy"].tolist() == [1.0, 0.0, 0.0]
    assert chat.per_function["answer_accuracy"].tolist() == [1.0, 1.0, 0.0]
    assert chat.metrics["reward/boxed_format/failures"] == 0.0


def test_trainer_state_is_passed_and_never_a_required_column() -> None:
    states: list[object] = []

    def scheduled(completions: list[str], trainer_state: RewardState) -> list[float]:
        states.append(trainer_state)
        return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

    combiner = RewardCombiner([scheduled], timeout_s=1.0)
    assert combiner.required_columns() == {}
    combiner.check_available([], "training source 'd'")  # no column to find
    trainer = SimpleNamespace(global_step=5, max_steps=20, current_epoch=1)
    result = combiner(["a"], {}, trainer_state=RewardState.of(trainer))
    assert result.total.tolist() == [0.25]
    assert states == [RewardState(global_step=5, max_steps=20, epoch=1)]
    assert RewardState.of(None) == RewardState(0, -1, 0)  # a module used without a trainer


def logs_everything(completions: list[str], log_extra: Any, log_metric: Any) -> list[float]:
    if "bad" in completions:
        raise ValueError("bad row")
    log_extra("length", [len(c) for c in completions])
    log_metric("mean_length", sum(map(len, completions)) / len(completions))
    return [1.0] * len(completions)


def test_log_extra_and_log_metric_on_the_batch_and_on_the_row_retry() -> None:
    combiner = RewardCombiner([logs_everything], timeout_s=None, max_failure_share=None)
    batch = combiner(["ab", "abcd"], {})
    assert batch.logged_columns == {"length": [2, 4]}
    assert batch.metrics["reward/logs_everything/mean_length"] == 3.0
    retried = combiner(["ab", "bad", "abcd"], {})  # the batch raised: rows one by one
    assert retried.logged_columns == {"length": [2, None, 4]}  # the failed row logged nothing
    assert retried.metrics["reward/logs_everything/mean_length"] == 3.0  # mean of 2 and 4


def test_what_a_function_logs_travels_back_from_a_worker() -> None:
    # Workers return call_isolated's Outcome pickled: the log must survive the trip.
    outcome = call_isolated(logs_everything, ["ab"], {}, "", None, ("log_extra", "log_metric"))
    back = pickle.loads(pickle.dumps(outcome))
    assert back.log is not None and back.log.extra == {"length": [2]}
    assert back.log.metrics == {"mean_length": [2.0]}


def test_a_logged_column_of_the_wrong_length_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def short_column(completions: list[str], log_extra: Any) -> list[float]:
        log_extra("oops", [1])
        return [0.0] * len(completions)

    with caplog.at_level(logging.WARNING, logger="rlvr_lightning.rewards.combine"):
        result = RewardCombiner([short_column], timeout_s=None)(["a", "b"], {})
    assert result.logged_columns == {}
    assert "logged 1 values for column 'oops' of 2 completions" in caplog.text


def test_a_reward_without_completions_or_kwargs_is_refused() -> None:
    def only_ids(completion_ids: list[list[int]]) -> list[float]:
        return [0.0] * len(completion_ids)

    with pytest.raises(ValueError, match=r"'only_ids' takes no completions.*Add \*\*kwargs"):
        RewardCombiner([only_ids])


def test_completion_text() -> None:
    assert completion_text([{"role": "assistant", "content": "x"}]) == "x"
    with pytest.raises(TypeError, match="must be a string or a message list"):
        completion_text(3)  # type: ignore[arg-type]


def test_trl_functions_are_used_when_trl_is_installed() -> None:
    """Where ``trl`` is installed the copies must not stand in silently for a broken import."""
    import importlib.util

    assert TRL == (importlib.util.find_spec("trl") is not None)


@pytest.mark.parametrize("module", [trl_contract, signature])
def test_doctests(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0
