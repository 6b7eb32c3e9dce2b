"""Tools as TRL 1.16 takes them: plain Python functions whose schema comes from their type hints
and Google-style docstring (``transformers.utils.get_json_schema``), the calculator tool, and
the system text that describes the tools where the chat template does not render them.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

from transformers.utils import get_json_schema

# This project's bounds for the calculator: a sum a model cannot do in its head is far inside
# them, and nothing inside them takes more than microseconds.
MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_DIGITS = 1000
_OPERATORS: dict[type[ast.AST], Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
_ALLOWED = "numbers, + - * / // % ** and parentheses"


def tool_schemas(fns: Sequence[Callable[..., Any]]) -> list[dict[str, Any]]:
    """The JSON schema of each tool, as ``transformers.utils.get_json_schema`` builds it.

    Raises:
        ValueError: a tool without type hints or a Google-style docstring, naming it and the fix.
    """
    schemas = []
    for fn in fns:
        try:
            schemas.append(get_json_schema(fn))
        except Exception as exc:  # transformers' TypeHint/DocstringParsingException
            name = getattr(fn, "__qualname__", repr(fn))
            raise ValueError(
                f"Tool {name!r} has no JSON schema: {exc}\nFix: give every parameter a type hint "
                "and write a Google-style docstring with a one-line description and an 'Args:' "
                "section describing each parameter (transformers.utils.get_json_schema reads them)."
            ) from exc
    return schemas


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The arithmetic to evaluate, e.g. "(127 + 385) * 3". Only numbers, the
            operators + - * / // % ** and parentheses are allowed.
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string such as '12 + 30'; got {expression!r}.")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters.")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        value = _evaluate(tree.body)
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression ({exc.msg}); use {_ALLOWED}.") from None
    except ZeroDivisionError:
        raise ValueError("division by zero.") from None
    except (OverflowError, RecursionError, MemoryError):
        raise ValueError("the result is too large.") from None
    if isinstance(value, float):
        return format(value, ".12g")
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    """Value of an expression tree made only of numbers and arithmetic operators."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        value = _OPERATORS[type(node.op)](left, right)
        if isinstance(value, complex):
            raise ValueError("the result is not a real number.")
        if isinstance(value, int) and value.bit_length() > MAX_RESULT_DIGITS * 3.33:
            raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits.")
        return value
    shown = ast.unparse(node) if isinstance(node, ast.expr) else type(node).__name__
    raise ValueError(f"{shown!r} is not arithmetic; only {_ALLOWED} are allowed.")


def _check_power(base: float, exponent: float) -> None:
    # Refused before computing it: 9 ** 9 ** 9 would take minutes and gigabytes.
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > MAX_RESULT_DIGITS:
        raise ValueError(f"the result has more than {MAX_RESULT_DIGITS} digits.")


def tools_instruction(schemas: Sequence[dict[str, Any]]) -> str:
    """System text that describes the tools and the call format, for chat templates that do not
    render ``tools=`` (see :func:`template_renders_tools`).

    The format is the Hermes/Qwen one that :func:`parse_tool_calls` reads without a response
    template: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn.
    """
    listed = "\n".join(json.dumps(schema, sort_keys=True) for schema in schemas)
    return (
        "You may call one or more functions to help with the task. Their signatures, as JSON "
        f"schemas, are within <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call a function, write a JSON object with the function name and its arguments "
        'within <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, '
        '"arguments": <args-json-object>}\n</tool_call>\nEach result comes back in a tool '
        "message. When you have the answer, reply without a tool call."
    )


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders the ``tools=`` schemas into the prompt.

    The prompt is rendered with and without one probe tool: the template renders tools when the
    two differ and the probe's name is in the first. A template that fails to render counts as
    not rendering them.
    """
    name = "rlvr_probe_tool_5c1e"
    schema = {
        "type": "function",
        "function": {
            "name": name,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}, "required": []},
        },
    }
    messages = [{"role": "user", "content": "hi"}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(
            messages, tools=[schema], tokenize=False, add_generation_prompt=True
        )
    except Exception:  # jinja2's TemplateError, a template without chat support, ...
        return False
    return with_tools != plain and name in str(with_tools)
