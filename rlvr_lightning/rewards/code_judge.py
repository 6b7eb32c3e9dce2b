"""Trainer side of the code reward's verdict: what the sandbox is asked, and how its answers pass.

A test case never enters the sandbox whole. Each top-level ``assert <expr> <op> <literal>``
(either side literal, one comparison) becomes a question "what is ``<expr>``?": the sandbox
answers with the value as plain data and the trainer applies ``<op> <literal>`` itself, so the
expected value never reaches the model's code and a result whose ``__eq__`` says yes to
everything is just an unknown type. ``assert <expr>`` / ``assert not <expr>`` ask for the
truth value. Every other statement (an assignment, a ``for`` loop of asserts, ``check(f)``) is
run as it is and answers "done"; each question carries a fresh random id. A snippet that exits
early, writes to any descriptor or kills its parent answers nothing or the wrong thing; what it
can still do is answer the questions correctly, i.e. compute the values. The weak spots are the
truth values and "done": a snippet that hooks its interpreter to answer True, or "done" for a
statement it never ran, passes those, so plain ``assert f(x) == y`` tests are the strong case.
Programs (stdin/stdout cases) pass on exit status 0 and stdout equal to the expected output,
which also stays with the trainer.
"""

from __future__ import annotations

import ast
import json
import operator
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_MAX_DEPTH = 64
_OPS: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_SEQUENCES: dict[str, Callable[[list[Any]], Any]] = {
    "l": list,
    "t": tuple,
    "e": set,
    "z": frozenset,
}


@dataclass(frozen=True)
class Check:
    """How the trainer judges one answer: ``kind`` is ``exec``, ``truth`` or ``compare``."""

    kind: str
    expected: Any = None  # truth: the bool wanted; compare: the literal
    op: type[ast.cmpop] | None = None
    literal_left: bool = False


Step = dict[str, str]  # {"kind": "exec" | "truth" | "value", "src": ..., "id": ...}


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _split(stmt: ast.stmt) -> tuple[str, str, Check]:
    """One statement as (step kind, source sent to the sandbox, how its answer is judged)."""
    if not isinstance(stmt, ast.Assert):
        return "exec", ast.unparse(stmt), Check("exec")
    test = stmt.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = test.left, test.comparators[0]
        (left_is, left_val), (right_is, right_val) = _literal(left), _literal(right)
        if left_is != right_is:  # exactly one side is data: ask for the other one
            asked, value = (right, left_val) if left_is else (left, right_val)
            check = Check("compare", value, type(test.ops[0]), literal_left=left_is)
            return "value", ast.unparse(asked), check
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return "truth", ast.unparse(test.operand), Check("truth", False)
    return "truth", ast.unparse(test), Check("truth", True)


def plan_test(test: str) -> tuple[list[Step], list[Check]]:
    """The questions for one test case (each with a fresh id) and how each answer is judged.

    >>> steps, checks = plan_test("assert f(1) == 2")
    >>> steps[0]["kind"], steps[0]["src"], checks[0].expected
    ('value', 'f(1)', 2)
    """
    try:
        body = ast.parse(test).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        # sent as is: the sandbox fails to compile it, and the case fails
        return [{"kind": "exec", "src": test, "id": secrets.token_hex(8)}], [Check("exec")]
    steps, checks = [], []
    for stmt in body:
        kind, src, check = _split(stmt)
        steps.append({"kind": kind, "src": src, "id": secrets.token_hex(8)})
        checks.append(check)
    return steps, checks


def decode(data: Any, depth: int = 0) -> Any:
    """The value an answer encodes (the format of ``_code_child.encode``); raises when invalid."""
    if depth > _MAX_DEPTH or not isinstance(data, list) or not data:
        raise ValueError("not an encoded value")
    tag, rest = data[0], data[1:]
    if tag == "n":
        return None
    if tag == "b" and isinstance(rest[0], bool):
        return rest[0]
    if tag == "i":
        return int(rest[0])
    if tag == "f":
        return float(rest[0])
    if tag == "c":
        return complex(float(rest[0][0]), float(rest[0][1]))
    if tag == "s" and isinstance(rest[0], str):
        return rest[0]
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag in _SEQUENCES:
        return _SEQUENCES[tag]([decode(item, depth + 1) for item in rest[0]])
    if tag == "d":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in rest[0]}
    raise ValueError(f"unsupported answer type {tag!r}")


def _passes(step: Step, check: Check, line: str) -> bool:
    try:
        reply = json.loads(line)
        if not isinstance(reply, dict) or reply.get("id") != step["id"] or "error" in reply:
            return False
        if check.kind == "exec":
            return reply.get("done") is True
        value = decode(reply.get("value"))
        if check.kind == "truth":
            return value is check.expected
        if check.op is None:
            return False
        left, right = (check.expected, value) if check.literal_left else (value, check.expected)
        return bool(_OPS[check.op](left, right))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return False


def judge_steps(steps: list[Step], checks: list[Check], answers: list[str]) -> bool:
    """True when every question got an answer with its id that passes its check."""
    if len(answers) < len(steps):
        return False
    return all(_passes(s, c, a) for s, c, a in zip(steps, checks, answers, strict=False))


def same_output(got: str, want: str) -> bool:
    """Equal after stripping trailing whitespace of each line and blank lines at both ends.

    >>> same_output("4 \\n\\n", "4")
    True
    """
    return [s.rstrip() for s in got.strip().splitlines()] == [
        s.rstrip() for s in str(want).strip().splitlines()
    ]


def explain_steps(steps: list[Step], checks: list[Check], answers: list[str]) -> str | None:
    """Why a test case fails, in words, for execution feedback; None when it passes.

    Only the first failing question is named. What the test expects never appears: a compared
    value's question is shown without its literal (``f(1)`` for ``assert f(1) == 2``).

    >>> steps, checks = plan_test("assert f(1) == 2")
    >>> explain_steps(steps, checks, ['{"id": "%s", "value": ["i", "1"]}' % steps[0]["id"]])
    '`f(1)` returned 1, which is not the expected value'
    """
    for i, (step, check) in enumerate(zip(steps, checks, strict=True)):
        if i >= len(answers):
            return f"`{step['src']}` gave no answer (the code crashed, exited or ran out of time)"
        if not _passes(step, check, answers[i]):
            return _why(step, check, answers[i])
    return None


def _why(step: Step, check: Check, line: str) -> str:
    src = step["src"]
    try:
        reply = json.loads(line)
        error = reply.get("error") if isinstance(reply, dict) else None
    except ValueError:
        reply, error = None, None
    if error is not None:
        return f"`{src}` raised {str(error)[:100]}"
    if check.kind == "exec" or not isinstance(reply, dict):
        return f"`{src}` did not run"
    if check.kind == "truth":
        return f"`assert {'not ' if check.expected is False else ''}{src}` failed"
    try:
        shown = repr(decode(reply.get("value")))
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return f"`{src}` returned a value that is not plain data"
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return f"`{src}` returned {shown}, which is not the expected value"


def explain_program(stdin: str | None, want: str, result: dict[str, Any]) -> str | None:
    """Why a stdin/stdout case fails, in words (never the expected output); None when it passes.

    >>> explain_program("2\\n", "4", {"exit": 0, "out": "5\\n"})
    "on input '2\\\\n' the program printed '5\\\\n', which is not the expected output"
    """
    given = repr(stdin or "")[:200]
    if result.get("exit") != 0:
        return f"on input {given} the program exited with status {result.get('exit')}"
    out = str(result.get("out"))
    if same_output(out, want):
        return None
    printed = repr(out)[:200]
    return f"on input {given} the program printed {printed}, which is not the expected output"
