"""The code reward's verdict (rewards/code_judge.py): the questions asked and how answers pass."""

from __future__ import annotations

import ast
import doctest
import json
import math
from pathlib import Path
from typing import Any

import pytest

from rlvr_lightning.rewards import code_judge
from rlvr_lightning.rewards.code_judge import Check, decode, judge_steps, plan_test, same_output

CHILD = Path(code_judge.__file__).parent / "_code_child.py"


def _child_encode() -> Any:
    """The sandbox side's ``encode``, taken from the harness text without running its main()."""
    source = CHILD.read_text().rsplit("\nmain()", 1)[0]
    scope: dict[str, Any] = {}
    exec(compile(source, str(CHILD), "exec"), scope)
    return scope["encode"]


def _answer(step: dict[str, str], **fields: object) -> str:
    return json.dumps({"id": step["id"], **fields})


def test_doctests() -> None:
    result = doctest.testmod(code_judge)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize(
    ("test", "kind", "src", "check"),
    [
        ("assert f(1) == 2", "value", "f(1)", Check("compare", 2, ast.Eq)),
        ("assert 2 == f(1)", "value", "f(1)", Check("compare", 2, ast.Eq, literal_left=True)),
        ("assert f(1) in (2, -3)", "value", "f(1)", Check("compare", (2, -3), ast.In)),
        ("assert f(0) is None", "value", "f(0)", Check("compare", None, ast.Is)),
        ("assert not g()", "truth", "g()", Check("truth", False)),
        ("assert g(1)", "truth", "g(1)", Check("truth", True)),
        ("assert f(1) == f(2)", "truth", "f(1) == f(2)", Check("truth", True)),  # no literal
        ("assert 0 < f(1) < 3", "truth", "0 < f(1) < 3", Check("truth", True)),  # chained
        ("x = f(3)", "exec", "x = f(3)", Check("exec")),
    ],
)
def test_plan_splits_each_statement(test: str, kind: str, src: str, check: Check) -> None:
    steps, checks = plan_test(test)
    assert [(s["kind"], s["src"]) for s in steps] == [(kind, src)]
    assert checks == [check]


def test_plan_ids_are_fresh_and_the_expected_value_is_not_sent() -> None:
    first, _ = plan_test("y = f(4)\nassert y == 12345")
    second, _ = plan_test("y = f(4)\nassert y == 12345")
    assert [s["kind"] for s in first] == ["exec", "value"]
    assert len({s["id"] for s in first + second}) == 4
    assert "12345" not in json.dumps(first)
    broken, checks = plan_test("assert f(")  # sent whole: the sandbox fails to compile it
    assert broken[0]["src"] == "assert f(" and checks == [Check("exec")]


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        0,
        -(10**30),
        2.5,
        math.inf,
        1 + 2j,
        "é",
        b"\x00\xff",
        [1, (2, 3)],
        {1, 2},
        frozenset({"a"}),
        {"k": [None, False]},
    ],
)
def test_encode_decode_round_trip(value: object) -> None:
    decoded = decode(json.loads(json.dumps(_child_encode()(value))))
    assert decoded == value and type(decoded) is type(value)


def test_subclasses_arrive_as_plain_data() -> None:
    class Sneaky(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    encode = _child_encode()
    assert decode(encode(Sneaky(3))) == 3 and type(decode(encode(Sneaky(3)))) is int
    with pytest.raises(ValueError, match="unsupported"):
        decode(encode(object()))  # an unknown type never compares equal to anything


def test_judge_needs_every_answer_with_its_id_and_the_right_value() -> None:
    steps, checks = plan_test("x = f(1)\nassert x == [2, 3]\nassert not g()")
    done = _answer(steps[0], done=True)
    right = _answer(steps[1], value=["l", [["i", "2"], ["i", "3"]]])
    falsy = _answer(steps[2], value=["b", False])
    assert judge_steps(steps, checks, [done, right, falsy])
    wrong = _answer(steps[1], value=["t", [["i", "2"], ["i", "3"]]])  # a tuple is not a list
    assert not judge_steps(steps, checks, [done, wrong, falsy])
    assert not judge_steps(steps, checks, [done, right])  # one missing
    assert not judge_steps(steps, checks, [done, right, _answer(steps[1], value=["b", False])])
    assert not judge_steps(steps, checks, [done, right, _answer(steps[2], error="Boom")])
    assert not judge_steps(steps, checks, [done, right, "ok"])
    assert not judge_steps(steps, checks, [done, right, _answer(steps[2], value=["?", "A"])])


def test_same_output() -> None:
    assert same_output("1\n2  \n\n", "\n1\n2")
    assert not same_output("1 2", "1\n2")
