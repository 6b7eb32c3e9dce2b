"""Examples to ``PromptBatch``: chat messages with the system prompt and instruction applied.

Pure functions of the examples and the data module's text options; ``RLVRDataModule`` collates
with them, benchmarks build prompts with them.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlvr_lightning.data.sources import Example
from rlvr_lightning.types import PromptBatch

Messages = list[dict[str, str]]


def to_messages(prompt: str, system_prompt: str | None, instruction: str | None) -> Messages:
    """Chat messages of a prompt: optional system turn, then the user turn.

    The instruction follows the question after a blank line, so the question reads as written;
    ``None`` or ``""`` adds nothing.
    """
    content = f"{prompt}\n\n{instruction}" if instruction else prompt
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return [*system, {"role": "user", "content": content}]


def example_messages(
    example: Example, system_prompt: str | None, instruction: str | None
) -> Messages:
    """Chat messages of an example: ``to_messages`` for a text prompt; a conversation as
    written, with ``system_prompt`` prepended only when it has no system turn of its own and
    ``instruction`` appended to its last (user) turn after a blank line."""
    if example.messages is None:
        return to_messages(example.prompt, system_prompt, instruction)
    messages = [dict(m) for m in example.messages]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if instruction:
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{instruction}"
    return messages


def collate_examples(
    examples: Sequence[Example],
    system_prompt: str | None,
    instruction: str | Sequence[str | None] | None,
) -> PromptBatch:
    """A ``PromptBatch`` of examples; a column missing from some examples is ``None`` there.

    ``instruction`` is one text for every example or a list of one per example.

    The ``prompts`` column is what reward functions get as ``prompts`` (TRL's meaning): the
    user turn's text for a text prompt, the message list for a conversation, both with the
    system prompt and instruction applied and no chat template.
    """
    names = list(dict.fromkeys(name for e in examples for name in e.columns))
    per_example = (
        [instruction] * len(examples)
        if instruction is None or isinstance(instruction, str)
        else list(instruction)
    )
    if len(per_example) != len(examples):
        raise ValueError(f"{len(per_example)} instructions for {len(examples)} examples.")
    messages = [
        example_messages(e, system_prompt, text)
        for e, text in zip(examples, per_example, strict=True)
    ]
    columns = {name: [e.columns.get(name) for e in examples] for name in names}
    columns["prompts"] = [
        m[-1]["content"] if e.messages is None else m
        for e, m in zip(examples, messages, strict=True)
    ]
    return PromptBatch(
        prompt_ids=[e.prompt_id for e in examples], messages=messages, columns=columns
    )


def source_columns(examples: Sequence[Example]) -> dict[str, list[str]]:
    """The columns each source's examples have (any row), the source read from the id."""
    found: dict[str, dict[str, None]] = {}
    for e in examples:
        names = found.setdefault(e.prompt_id.rsplit(":", 1)[0], {})
        names.update(dict.fromkeys(e.columns))
    return {source: list(names) for source, names in found.items()}
