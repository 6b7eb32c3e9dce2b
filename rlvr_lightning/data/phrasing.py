r"""How a question is worded: varied training instructions and validation asked in other words.

Two things live here, both pure functions of examples, a seed and fixed word lists:

- ``pick_instructions``: with a list of instructions, each training prompt gets one drawn
  afresh every step, so the policy learns the answer format rather than one sentence.
- ``paraphrased_examples``: the *paraphrased* validation split of the built-in arithmetic tasks.
  Each held-out sum or product is asked again with another question form ("Add 4 and 8.",
  "4 + 8 = ?") and an instruction phrasing that training never uses (some with an example,
  some without, some before the question). A model that only learned to copy the training
  instruction's example, or that writes an empty ``\boxed{}`` without it, fails here while
  ``val/accuracy`` stays high (issue 40). The phrasings are this project's choice; a training
  instruction equal to one of them is refused (``check_disjoint``), so the split stays unseen.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Sequence

from rlvr_lightning.data.sources import Example, make_prompt_id

PARAPHRASED = "paraphrased"
"""Name of the split: its metrics are ``val/<metric>_paraphrased``."""

QUESTION_FORMS: dict[str, tuple[str, ...]] = {
    "+": (
        "Add {a} and {b}.", "Compute {a} + {b}.", "What is the sum of {a} and {b}?",
        "{a} + {b} = ?",
    ),
    "*": (
        "Multiply {a} by {b}.", "Compute {a} * {b}.", "What is the product of {a} and {b}?",
        "{a} * {b} = ?",
    ),
}  # fmt: skip
"""Question forms of the paraphrased split; the training tasks ask ``What is a + b?``."""

VAL_INSTRUCTIONS: tuple[str, ...] = (
    "{q}\n\nWrite the final answer inside \\boxed{{}}.",
    "{q}\n\nGive the result in \\boxed{{}}, for example \\boxed{{blue}} if the answer were blue.",
    "Answer the question below and put your answer in \\boxed{{}}.\n\n{q}",
    "{q}\n\nEnclose the answer in \\boxed{{}}, e.g. The largest planet is \\boxed{{Jupiter}}.",
    "Solve this and box the result with \\boxed{{}}: {q}",
    "{q}\n\nReply with the answer in \\boxed{{}}.",
)
"""Whole-prompt templates (``{q}``: the question) of the paraphrased split: instructions after
or before the question, with and without an example, none of them used in training."""

_ARITHMETIC = re.compile(r"What is (\d+) ([+*]) (\d+)\?")
_TASKS = ("addition", "multiplication")


def instruction_texts() -> list[str]:
    """The instruction sentences of ``VAL_INSTRUCTIONS``, without the question."""
    texts = []
    for template in VAL_INSTRUCTIONS:
        filled = template.format(q="\x00").replace("\x00", "")
        texts.append(filled.strip(" :\n"))
    return texts


def check_disjoint(instructions: Sequence[str]) -> None:
    """Raise a ValueError if a training instruction is one the paraphrased split asks with."""
    reserved = set(instruction_texts())
    clash = [text for text in instructions if text.strip() in reserved]
    if clash:
        raise ValueError(
            f"The instruction {clash[0]!r} is one of the paraphrased validation phrasings, "
            "which must stay unseen in training: choose another instruction, or set "
            "data.paraphrased_val: false."
        )


def is_arithmetic(example: Example) -> bool:
    """Whether ``example`` is a built-in addition/multiplication problem the split can reword."""
    return example.columns.get("task") in _TASKS and bool(_ARITHMETIC.fullmatch(example.prompt))


def paraphrased_examples(examples: Sequence[Example], seed: int) -> list[Example]:
    """The arithmetic ``examples`` asked in other words, one paraphrase each, same answers.

    Every (question form, instruction) pair is used in turn, in an order shuffled by ``seed``,
    so 24 examples or more use each pair and the split is the same on every run. The
    instruction is part of the prompt: collate these with ``instruction=None``.
    """
    rng = random.Random(f"{PARAPHRASED}:{seed}")
    pairs = {
        op: list(itertools.product(forms, VAL_INSTRUCTIONS)) for op, forms in QUESTION_FORMS.items()
    }
    for combos in pairs.values():
        rng.shuffle(combos)
    out = []
    for i, example in enumerate(e for e in examples if is_arithmetic(e)):
        a, op, b = _ARITHMETIC.fullmatch(example.prompt).groups()  # type: ignore[union-attr]
        form, template = pairs[op][i % len(pairs[op])]
        prompt = template.format(q=form.format(a=a, b=b))
        task = f"{example.columns['task']}-{PARAPHRASED}"
        columns = {**example.columns, "task": task}
        out.append(Example(make_prompt_id(task, prompt, columns["answer"]), prompt, columns))
    return out


def pick_instructions(
    examples: Sequence[Example], instructions: Sequence[str | None], seed: int, step: int
) -> list[str | None]:
    """One of ``instructions`` per example, drawn from ``(seed, step, prompt id)``.

    Seeded by text (``random.Random`` hashes a string with SHA-512), so the draw is the same in
    every process and after a resume, and a prompt served again at a later step may get another.
    """
    return [
        random.Random(f"{seed}:{step}:{e.prompt_id}").choice(list(instructions)) for e in examples
    ]


def instruction_list(instruction: str | Sequence[str] | None) -> list[str | None]:
    """The data module's ``instruction`` as a non-empty list (``None``: no instruction)."""
    if instruction is None or isinstance(instruction, str):
        return [instruction]
    if not instruction or not all(isinstance(text, str) for text in instruction):
        raise ValueError(
            f"instruction must be a text, a non-empty list of texts or null, got {instruction!r}."
        )
    return list(instruction)


def paraphrased_split(
    val: Sequence[Example], enabled: bool | None, builtin_task: bool, seed: int
) -> list[Example]:
    """The paraphrased split of ``val`` (empty when off); ``enabled=None`` means on when a
    source is a built-in arithmetic task (``builtin_task``)."""
    if enabled is False or (enabled is None and not builtin_task):
        return []
    split = paraphrased_examples(val, seed)
    if enabled and not split:
        raise ValueError(
            "paraphrased_val: true rewords the built-in addition/multiplication validation "
            "problems, but this validation split has none: use source addition or "
            "multiplication with val_size > 0, or set paraphrased_val: false."
        )
    return split
