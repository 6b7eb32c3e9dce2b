"""Property tests: every answer parser and verifier of rewards/math.py and rewards/format.py takes
any string without raising, returns the documented type, and stays within the time it is
allowed (math-verify's own timeouts are on here: pytest runs tests on the main thread)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlvr_lightning.rewards import math as math_rewards
from rlvr_lightning.rewards.format import boxed_format
from rlvr_lightning.rewards.math import (
    answer_accuracy,
    answers_match,
    boxed_accuracy,
    extract_boxed,
    last_number,
    normalize_gold,
)

# Fragments models write in maths answers, so that examples reach the parsers' deeper branches.
PIECES = [
    *"0123456789-+*/^_{}()[],.=<> xyn",
    r"\boxed{",
    r"\boxed {",
    r"\fbox{",
    r"\frac",
    r"\sqrt",
    r"\{",
    r"\}",
    r"\\",
    r"\infty",
    r"\pi",
    "^{",
    "####",
    "1,234",
    "\u2212",
    "$",
]
mathy = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)
texts = st.text(max_size=200) | mathy
# Without the timeout, the row's parse of gold and prediction and their comparison can each run
# to math-verify's limit; the slack covers a loaded CI machine.
SYMBOLIC_BUDGET_S = 2 * math_rewards._PARSE_TIMEOUT_S + math_rewards._VERIFY_TIMEOUT_S + 3.0
PARSER_BUDGET_S = 1.0
NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/\d+)?")

fast = settings(max_examples=150, deadline=None, database=None)
symbolic = settings(
    max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


def timed(fn: Callable[..., Any], *args: Any, budget_s: float, **kwargs: Any) -> Any:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    elapsed = time.perf_counter() - start
    assert elapsed < budget_s, f"{fn.__name__} took {elapsed:.2f} s (budget {budget_s} s)"
    return out


@fast
@given(texts)
def test_extract_boxed_returns_a_substring_or_none(text: str) -> None:
    out = timed(extract_boxed, text, budget_s=PARSER_BUDGET_S)
    assert out is None or out in text
    if "boxed" not in text and "fbox" not in text:
        assert out is None


@fast
@given(texts)
def test_last_number_returns_a_plain_number_or_none(text: str) -> None:
    out = timed(last_number, text, budget_s=PARSER_BUDGET_S)
    assert out is None or NUMBER.fullmatch(out), out


@fast
@given(texts)
def test_normalize_gold_and_boxed_format_never_raise(text: str) -> None:
    assert isinstance(timed(normalize_gold, text, budget_s=PARSER_BUDGET_S), str)
    assert timed(boxed_format, [text], budget_s=PARSER_BUDGET_S) in ([0.0], [1.0])


@symbolic
@given(texts, texts)
def test_answers_match_is_a_bool_within_the_timeouts(pred: str, gold: str) -> None:
    assert timed(answers_match, pred, gold, budget_s=SYMBOLIC_BUDGET_S) in (True, False)
    if pred.strip():
        assert answers_match(pred, pred)


@symbolic
@given(texts, texts | st.none())
@pytest.mark.parametrize("reward", [boxed_accuracy, answer_accuracy], ids=lambda f: f.__name__)
def test_accuracy_rewards_score_any_row(reward: Callable[..., Any], text: str, gold: Any) -> None:
    out = timed(reward, [text], answer=[gold], budget_s=SYMBOLIC_BUDGET_S)
    expected = ([None],) if not normalize_gold(gold) else ([0.0], [1.0])
    assert out in expected


@pytest.mark.parametrize(
    "text",
    [
        "\\boxed{" * 20_000,  # the old brace matcher rescanned to the end per box: minutes
        "\\boxed{" + "x{" * 50_000,
        "1,111," * 20_000,
        "-.-.1" * 40_000,
        "1/2/3/" * 40_000,
    ],
    ids=["unclosed-boxes", "unclosed-groups", "commas", "signs-and-dots", "slashes"],
)
def test_parsers_are_linear_on_degenerate_completions(text: str) -> None:
    for fn in (extract_boxed, last_number, normalize_gold):
        timed(fn, text, budget_s=PARSER_BUDGET_S)
