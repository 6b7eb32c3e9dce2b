"""Multi-turn tools (rlvr_lightning/environments): schemas, the calculator, the tools
instruction and tool-call parsing (the tokenizer's response parser and the fallback)."""

from __future__ import annotations

import copy

import pytest
from transformers.utils import get_json_schema

from rlvr_lightning.environments import (
    SessionFactory,
    ToolCall,
    calculator,
    parse_tool_calls,
    template_renders_tools,
    tool_schemas,
    tools_instruction,
)
from rlvr_lightning.testing import add
from rlvr_lightning.testing import tool_call as call

# --- tools and schemas --------------------------------------------------------------------


def test_schema_is_get_json_schemas_and_names_the_parameters() -> None:
    (schema,) = tool_schemas([add])
    assert schema == get_json_schema(add)
    properties = schema["function"]["parameters"]["properties"]
    assert set(properties) == {"a", "b"}
    assert properties["a"]["description"] == "The first summand."
    assert schema["function"]["parameters"]["required"] == ["a"]


def test_tool_without_docstring_is_refused_with_the_fix() -> None:
    def bare(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"'.*bare'.*\n.*Google-style docstring"):
        tool_schemas([bare])


@pytest.mark.parametrize(
    ("expression", "value"),
    [("127 + 385", "512"), ("(12 - 20) * 3", "-24"), ("7 / 2", "3.5"), ("2 ** 10 % 7", "2")],
)
def test_calculator_does_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os')", "not arithmetic"),
        ("(1).real", "not arithmetic"),
        ("x + 1", "not arithmetic"),
        ("True + 1", "not arithmetic"),
        ("[1, 2]", "not arithmetic"),
        ("9 ** 9 ** 9", "more than 1000 digits"),
        ("2 ** 100000", "more than 1000 digits"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculator_refuses_anything_but_arithmetic(expression: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        calculator(expression)


def test_calculator_error_reaches_the_model_as_a_counted_tool_error(tokenizer) -> None:
    session = SessionFactory(tools=[calculator]).new()
    turn = session.respond(
        call("calculator", expression="__import__('os').system('ls')"), tokenizer
    )
    assert turn.tool_errors == 1 and not turn.done
    assert "not arithmetic" in turn.messages[0]["content"]


def test_template_renders_tools(tokenizer) -> None:
    assert not template_renders_tools(tokenizer)  # the tiny template prints only the messages
    renders = copy.deepcopy(tokenizer)
    renders.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        + tokenizer.chat_template
    )
    assert template_renders_tools(renders)


def test_tools_instruction_describes_the_format_the_parser_reads(tokenizer) -> None:
    text = tools_instruction(tool_schemas([add, calculator]))
    assert '"name": "add"' in text and '"name": "calculator"' in text
    assert "<tool_call>" in text and "</tool_call>" in text
    calls, errors = parse_tool_calls(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', tokenizer
    )
    assert (
        calls == [ToolCall("add", {"a": 1}, '{"name": "add", "arguments": {"a": 1}}')]
        and not errors
    )


# --- parsing ------------------------------------------------------------------------------

QWEN_STYLE = {  # the response template TRL 1.16 sets for Qwen3's chat template
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


@pytest.mark.parametrize("template", [None, QWEN_STYLE], ids=["fallback", "response_template"])
def test_parse_several_calls(tokenizer, template) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.response_template = template
    text = "Sum first. " + call("add", a=1, b=2) + "\n" + call("calculator", expression="3*4")
    calls, errors = parse_tool_calls(text + "<|im_end|>", tok, tool_schemas([add, calculator]))
    assert [(c.name, c.arguments) for c in calls] == [
        ("add", {"a": 1, "b": 2}),
        ("calculator", {"expression": "3*4"}),
    ]
    assert errors == []


def test_parse_uses_the_tokenizers_response_parser(tokenizer) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.response_template = QWEN_STYLE
    # Only the template's parser drops the reasoning block; the fallback would keep it.
    text = "<think>hmm</think>" + call("add", a=1)
    calls, errors = parse_tool_calls(text, tok)
    assert [c.name for c in calls] == ["add"] and not errors


@pytest.mark.parametrize("template", [None, QWEN_STYLE], ids=["fallback", "response_template"])
@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('<tool_call>{"name": bad json}</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no string 'name'"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": {"a": 1}}', "no closing </tool_call>"),
    ],
)
def test_malformed_call_is_an_error_message(tokenizer, template, text: str, why: str) -> None:
    tok = copy.deepcopy(tokenizer)
    tok.response_template = template
    calls, errors = parse_tool_calls(text, tok)
    if template is not None and why.startswith("no closing"):
        # Qwen's parser reads an unclosed call to the end; the call itself is fine then.
        assert [c.name for c in calls] == ["add"]
        return
    assert calls == [] and len(errors) == 1 and why in errors[0]
