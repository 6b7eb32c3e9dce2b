"""Answer extraction and matching (rewards/math.py) and format rewards (rewards/format.py)."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest
import torch

from rlvr_lightning.rewards import format as format_rewards
from rlvr_lightning.rewards import math as math_rewards
from rlvr_lightning.rewards.format import OverlongPenalty, boxed_format, overlong_penalty
from rlvr_lightning.rewards.math import (
    answer_accuracy,
    answers_match,
    boxed_accuracy,
    extract_boxed,
    last_number,
    normalize_gold,
)


@pytest.mark.parametrize("module", [math_rewards, format_rewards], ids=lambda m: m.__name__)
def test_doctests(module: ModuleType) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),
        (r"\boxed {7} and \fbox{8}", "8"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{3} then \boxed{4", "3"),  # unclosed last box is ignored
        (r"\boxed{\boxed{5}}", r"\boxed{5}"),  # the outer box is the last top-level one
        (r"\boxed{}", ""),
        ("the answer is 3", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x = -3.5", "-3.5"),
        ("\u22127 degrees", "-7"),
        ("1,234,567 people", "1234567"),
        ("3/4 of 12 is 9.", "9"),
        ("it is 3/4", "3/4"),
        ("5-3", "3"),  # a hyphen after a digit is subtraction, not a sign
        ("1,2345", "2345"),  # not a thousands separator
        ("no digits", None),
    ],
)
def test_last_number(text: str, expected: str | None) -> None:
    assert last_number(text) == expected


@pytest.mark.parametrize(
    ("pred", "gold", "expected"),
    [
        ("10", "10.0", True),
        ("\u22124", "-4", True),
        ("-4", "4", False),
        ("1,234", "1234", True),
        ("3/4", "0.75", True),
        ("0.3333333", "1/3", True),  # within the 1e-6 tolerance
        ("0.33", "1/3", False),
        (r"\frac{1}{2}", "0.5", True),  # math-verify path
        ("x + 1", "1 + x", True),
        ("", "1", False),
        ("1/0", "1", False),
        ("{", "2", False),  # unparsable input never raises
        # the question's own arithmetic restated is not an answer to a numeric gold
        ("4 + 4", "8", False),
        ("9-1", "8", False),
        (r"2 \times 4", "8", False),
        ("2^3", "8", False),
        (r"9^{9^{9}}", "3", False),  # refused before sympy could evaluate 9**387420489
        (r"\frac{16}{2}", "8", True),  # a number written as a fraction is an answer
        (r"3 \times 10^{2}", "300", True),  # scientific notation too
        (r"2\sqrt{2}", "2.8284271", True),
        ("x = 8", "8", True),
        ("1 + x", "x + 1", True),  # a symbolic gold keeps math-verify's equivalence
    ],
)
def test_answers_match(pred: str, gold: str, expected: bool) -> None:
    assert answers_match(pred, gold) is expected


def test_boxes_that_disagree_are_a_hedge_and_score_zero() -> None:
    hedges = [r"4 + 4 = \boxed{2} = \boxed{4} = \boxed{8}", r"\boxed{7} or \boxed{8}"]
    agreed = [r"\boxed{8}. So the answer is \boxed{8}.", r"\boxed{8.0}, i.e. \boxed{8}"]
    answers = ["8"] * 4
    assert boxed_accuracy(hedges + agreed, answer=answers) == [0.0, 0.0, 1.0, 1.0]
    assert answer_accuracy(hedges + agreed, answer=answers) == [0.0, 0.0, 1.0, 1.0]
    assert answer_accuracy(["so 4 + 4 = 8"], answer=["8"]) == [1.0]  # no box: the last number


def test_normalize_gold() -> None:
    assert normalize_gold("Natalia sold 48/2 = 24 clips.\n#### 1,234") == "1234"
    assert normalize_gold(r"so \boxed{\frac{3}{4}}") == r"\frac{3}{4}"
    assert normalize_gold(42) == "42"
    assert normalize_gold(None) == ""


def test_boxed_accuracy_is_strict_and_skips_missing_gold() -> None:
    completions = [r"\boxed{1,234}", "1234", r"\boxed{5}", r"\boxed{5}"]
    answers = ["#### 1,234", "1234", "", None]
    assert boxed_accuracy(completions, answer=answers) == [1.0, 0.0, None, None]


def test_answer_accuracy_prefers_box_then_last_number() -> None:
    completions = [r"\boxed{2} although 3", "first 2 then 3", "no number"]
    assert answer_accuracy(completions, answer=["2", "3", "3"]) == [1.0, 1.0, 0.0]


def test_boxed_format() -> None:
    assert boxed_format([r"\boxed{x}", r"\boxed{}", r"\boxed{", "x"]) == [1.0, 0.0, 0.0, 0.0]


def test_format_reward_pays_no_nested_box():
    # Paid, nested boxes became what the policy wrote on one-digit addition (issue 40).
    completions = [r"4 \times 4 = \boxed{4 \times \boxed{4}}", r"\boxed{4 \boxed{8}}"]
    assert boxed_format(completions) == [0.0, 0.0]
    assert boxed_format([r"\boxed{4 + 4}", r"\boxed{Paris}", r"4 + 4 = \boxed{8}"]) == [1.0] * 3


def test_nested_box_never_earns_accuracy() -> None:
    # math-verify reads the inner box of \boxed{4 \boxed{8}}: it earned full reward in training.
    assert boxed_accuracy([r"\boxed{4 \boxed{8}}"], answer=["8"]) == [0.0]
    assert answers_match(r"4 \boxed{8}", "8") is False


def test_overlong_penalty_by_hand() -> None:
    # max_len 20, buffer 8 -> soft zone (12, 20]; penalty = (12 - len) / 8 * factor there.
    lengths = torch.tensor([5, 12, 14, 16, 20, 21, 100])  # [N]
    # len 14 -> -2/8 = -0.25; 16 -> -0.5; 20 -> -1; beyond 20 -> clamped at -1 (paper).
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer_len=8), expected)
    # factor scales inside the zone and the clamp: 16 -> -0.5 * 0.5 = -0.25; 100 -> -0.5.
    scaled = overlong_penalty(lengths, max_len=20, buffer_len=8, factor=0.5)
    torch.testing.assert_close(scaled, expected * 0.5)
    assert scaled.dtype == torch.float32


def test_overlong_penalty_full_buffer() -> None:
    # buffer_len == max_len: the whole range is soft; len 5 of 10 -> -5/10 = -0.5.
    out = overlong_penalty(torch.tensor([0, 5, 10]), max_len=10, buffer_len=10)
    torch.testing.assert_close(out, torch.tensor([0.0, -0.5, -1.0]))


@pytest.mark.parametrize(
    ("max_len", "buffer_len", "factor"), [(10, 0, 1.0), (10, 11, 1.0), (10, 4, -1.0)]
)
def test_overlong_penalty_validates(max_len: int, buffer_len: int, factor: float) -> None:
    with pytest.raises(ValueError, match="overlong penalty"):
        overlong_penalty(torch.tensor([1]), max_len, buffer_len, factor)
    with pytest.raises(ValueError, match="overlong penalty"):
        OverlongPenalty(max_len, buffer_len, factor)


def test_overlong_penalty_reward_object() -> None:
    reward = OverlongPenalty(max_len=20, buffer_len=8)
    assert reward.name == "overlong_penalty"
    assert reward(["a", "b", "c"], completion_length=[10, 16, 25]) == [0.0, -0.5, -1.0]
