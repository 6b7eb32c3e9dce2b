"""Answer extraction, answer comparison and accuracy rewards for math problems.

Reward functions follow the package contract
``fn(completions: list[str], **columns) -> list[float | None]`` (a completion may also be
TRL's message list, for a conversational prompt); ``None`` marks a row the function does not
apply to (here: a row without a gold answer).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from fractions import Fraction

from rlvr_lightning.rewards.isolation import run_in_process
from rlvr_lightning.rewards.trl_contract import Completion, completion_text

BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A minus sign binds to a number only when it does not follow a word character, so "5-3" yields
# "3" and a date "2024-01-02" yields "02" rather than negative numbers. Every match holds a
# digit: a pattern of optional parts would match an empty string at every position of the text.
_NUMBER = re.compile(
    r"(?:(?<![\w.])[-\u2212])?"
    r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:(?<=\d)/\d+)?"
)
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_ABS_TOL = Fraction(1, 10**6)
# Two numbers joined by an arithmetic operator: the computation restated, not its result.
_UNEVALUATED = re.compile(
    r"\d[\s)}]*(?:[-+*^\u00d7\u00f7\u2212]|\\times|\\cdot|\\div)[\s({]*[-\u2212]?\d"
)
# ...except scientific notation, which is a number: 3 \times 10^{2}, 1.5 * 10^-3.
_SCIENTIFIC = re.compile(
    r"[-\u2212]?\d+(?:\.\d+)?\s*(?:\\times|\\cdot|\u00d7|\*)\s*10\s*\^\s*"
    r"(?:\{\s*[-\u2212]?\d+\s*\}|[-\u2212]?\d+)"
)
# math-verify's own limits (whole seconds: signal.alarm); a legitimate answer takes milliseconds.
_PARSE_TIMEOUT_S = 3
_VERIFY_TIMEOUT_S = 3


def _closing_braces(text: str, start: int) -> dict[int, int]:
    """Index of every ``{`` from ``start`` on -> index of its matching ``}`` (unclosed: absent).

    One pass, so a completion full of unclosed boxes stays linear. Escaped braces (``\\{``,
    ``\\}``) are skipped so that ``\\boxed{\\{1, 2\\}}`` stays whole.
    """
    pairs: dict[int, int] = {}
    stack: list[int] = []
    i = start
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


def boxed_contents(text: str) -> list[str]:
    r"""Contents of every top-level ``\boxed{...}`` (or ``\fbox{...}``), in order.

    Braces are matched, so nested groups such as ``\frac{1}{2}`` stay whole; a box without its
    closing brace is ignored, and a box nested inside another is part of the outer one.

    >>> boxed_contents(r"so \boxed{1} or rather \boxed {\frac{1}{2}}")
    ['1', '\\frac{1}{2}']
    """
    found, pos, pairs = [], 0, None
    while (match := BOX_OPEN.search(text, pos)) is not None:
        # A box's "{" never follows a backslash, so matching from the first box on is exact.
        pairs = _closing_braces(text, match.end() - 1) if pairs is None else pairs
        end = pairs.get(match.end() - 1)
        if end is None:
            pos = match.end()
            continue
        # Continue after the closing brace so a box nested inside this one is not counted.
        found.append(text[match.end() : end])
        pos = end + 1
    return found


def extract_boxed(text: str) -> str | None:
    r"""Content of the last top-level ``\boxed{...}`` (or ``\fbox{...}``), None if there is none.

    >>> extract_boxed(r"so \boxed{1} or rather \boxed {\frac{1}{2}}")
    '\\frac{1}{2}'
    >>> extract_boxed("no box") is None
    True
    """
    found = boxed_contents(text)
    return found[-1] if found else None


def committed_boxed(text: str) -> str | None:
    r"""The last box's content when every box of ``text`` gives the same answer, else None.

    Boxes that disagree are a hedge (``\boxed{2} = \boxed{4} = \boxed{8}``): the grader would
    otherwise reward listing candidates, and a policy learns to (this project's rule, seen on
    one-digit addition). Repeating the answer, or restating it in another form, is fine.

    >>> committed_boxed(r"\boxed{4}, so \boxed{4.0}"), committed_boxed(r"\boxed{2} = \boxed{8}")
    ('4.0', None)
    """
    return _agreed(boxed_contents(text))


def _agreed(boxes: list[str]) -> str | None:
    """The last of ``boxes`` when every other one matches it, else None (also when empty)."""
    if not boxes:
        return None
    last = boxes[-1]
    others = {box.strip() for box in boxes[:-1]} - {last.strip()}
    return last if all(answers_match(box, last) for box in others) else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` as normalised text, None if there is none.

    Thousands separators are removed, a Unicode minus becomes ``-``, fractions stay as text.

    >>> last_number("2 apples cost $1,234.50, i.e. -3/4 of the budget")
    '-3/4'
    >>> last_number("total: 1,234")
    '1234'
    >>> last_number("none") is None
    True
    """
    numbers = _NUMBER.findall(text)
    if not numbers:
        return None
    return numbers[-1].replace(",", "").replace("\u2212", "-")


def normalize_gold(answer: object) -> str:
    r"""Gold answer as a bare string: text after ``####``, content of a ``\boxed{}``, no commas.

    >>> normalize_gold("She pays 5 + 7 = 12.\n#### 1,234")
    '1234'
    >>> normalize_gold(r"The answer is \boxed{\frac{1}{2}}.")
    '\\frac{1}{2}'
    """
    text = "" if answer is None else str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    boxed = extract_boxed(text)
    if boxed is not None:
        text = boxed
    return _THOUSANDS_COMMA.sub("", text.strip())


def as_number(text: str) -> Fraction | None:
    """Exact value of a plain int, decimal or simple fraction, None for anything else."""
    cleaned = _THOUSANDS_COMMA.sub("", text.strip().replace("\u2212", "-")).rstrip(".")
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


class _KnownTimeoutNotice(logging.Filter):
    """Drops math-verify's "Timeout is disabled" warning, which it logs on every call made off
    the main thread: there the bound is the caller's own timeout (said in ``_symbolic_match``),
    and the warning would fill a run's console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_KnownTimeoutNotice())


def _symbolic_match(pred: str, gold: str) -> bool:
    r"""Equivalence according to math-verify, within its own timeouts where they can work.

    They use ``signal.alarm``, which only works on a process's main thread: on in
    ``RewardCombiner``'s worker processes (so ``\boxed{9^{9^{9}}}`` costs 3 s, not minutes),
    off in a thread, where only the combiner's timeout bounds the call. The import is local
    because sympy takes about a second to load and the numeric path never needs it.
    """
    from math_verify import parse, verify

    on_main = threading.current_thread() is threading.main_thread()
    parse_s, verify_s = (_PARSE_TIMEOUT_S, _VERIFY_TIMEOUT_S) if on_main else (None, None)
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=parse_s)
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=parse_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_s))


def unevaluated(pred: str) -> bool:
    r"""Whether ``pred`` joins numbers with an arithmetic operator (scientific notation aside):
    a restated computation such as ``4 + 4`` rather than its result.

    >>> unevaluated("4 + 4"), unevaluated(r"2 \times 3"), unevaluated(r"\frac{4+4}{2}")
    (True, True, True)
    >>> unevaluated("-8"), unevaluated(r"\frac{1}{2}"), unevaluated(r"3 \times 10^{2}")
    (False, False, False)
    """
    text = pred.strip()
    return bool(_UNEVALUATED.search(text)) and not _SCIENTIFIC.fullmatch(text)


def answers_match(pred: str, gold: str) -> bool:
    r"""Whether ``pred`` is equivalent to ``gold``; never raises, returns False on odd input.

    Plain numbers compare exactly up to an absolute tolerance of 1e-6; anything else goes
    through math-verify. When the gold answer is a plain number, a prediction that is an
    unevaluated computation (``unevaluated``: ``4 + 4`` for 8) does not match, although
    math-verify would simplify it: otherwise a policy learns to box the question's own
    arithmetic instead of answering it (this project's rule, seen on one-digit addition). Nor
    does a box nested in the prediction (``4 \boxed{8}`` for 8: math-verify reads the inner box,
    so the outer one could hold anything).

    >>> answers_match("10.0", "10"), answers_match("\u22124", "-4"), answers_match("3", "4")
    (True, True, False)
    >>> answers_match(r"\frac{1}{2}", "0.5"), answers_match("4 + 4", "8")
    (True, False)
    >>> answers_match(r"4 \boxed{8}", "8")
    False
    """
    try:
        pred, gold = str(pred).strip(), str(gold).strip()
        if not pred or not gold:
            return False
        if pred == gold:
            return True
        pred_value, gold_value = as_number(pred), as_number(gold)
        if pred_value is not None and gold_value is not None:
            return abs(pred_value - gold_value) <= _ABS_TOL
        if gold_value is not None and (unevaluated(pred) or BOX_OPEN.search(pred)):
            return False
        return _symbolic_match(pred, gold)
    except Exception:  # a grader crash on model output must not stop training
        return False


def _score(pred: str | None, answer: object) -> float | None:
    """1.0 / 0.0 for a prediction against a raw gold answer; None when there is no gold."""
    gold = normalize_gold(answer)
    if not gold:
        return None
    return float(pred is not None and answers_match(pred, gold))


@run_in_process(preload=["math_verify"])
def boxed_accuracy(
    completions: list[Completion], answer: Sequence[object], **_: object
) -> list[float | None]:
    r"""1.0 when the last ``\boxed{}`` matches ``answer``, else 0.0; None without a gold answer.

    Strict: an answer given outside a box scores 0.0, and so do boxes that disagree with each
    other (``committed_boxed``).

    >>> boxed_accuracy([r"\boxed{42}", "42", r"\boxed{7}"], answer=["#### 42", "42", None])
    [1.0, 0.0, None]
    """
    texts = map(completion_text, completions)
    return [_score(committed_boxed(c), a) for c, a in zip(texts, answer, strict=True)]


@run_in_process(preload=["math_verify"])
def answer_accuracy(
    completions: list[Completion], answer: Sequence[object], **_: object
) -> list[float | None]:
    r"""1.0 when the boxed answer (``committed_boxed``), or without a box the last number,
    matches ``answer``.

    None for rows without a gold answer.

    >>> answer_accuracy([r"\boxed{42}", "so it is 1,234.", "no idea"], answer=["42", "1234", "1"])
    [1.0, 1.0, 0.0]
    """
    preds = [_boxed_or_last_number(completion_text(c)) for c in completions]
    return [_score(p, a) for p, a in zip(preds, answer, strict=True)]


def _boxed_or_last_number(text: str) -> str | None:
    boxes = boxed_contents(text)  # a hedge between boxes is not rescued by the last number
    return _agreed(boxes) if boxes else last_number(text)
