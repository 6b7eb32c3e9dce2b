"""Procedural tasks, generated offline from a seed: built-in arithmetic and reasoning-gym.

A task yields disjoint train and validation splits of ``Example``s. reasoning-gym is imported
only when a ``gym:<name>`` task is used, because it takes about a second to load.
"""

from __future__ import annotations

import dataclasses
import random
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlvr_lightning.data.phrasing import QUESTION_FORMS
from rlvr_lightning.data.sources import Example, make_prompt_id

BUILTIN_TASKS = ("addition", "multiplication")
GYM_PREFIX = "gym:"
GYM_VAL_SEED_OFFSET = 1_000_000_007
"""Validation seed offset for reasoning-gym tasks.

Item ``i`` of a reasoning-gym dataset is drawn from ``Random(seed + i)``, so train and validation
seeds must be far apart or validation would replay train items shifted by a few indices.
"""

_ADDITION_CONFIG = ("digits", "question_forms")
_GYM_RESERVED = ("size", "seed")
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def is_task_source(source: str) -> bool:
    """Whether ``source`` names a procedural task rather than a file."""
    return source in BUILTIN_TASKS or source.startswith(GYM_PREFIX)


def validate_task(source: str, config: Mapping[str, Any] | None) -> None:
    """Raise a ValueError that says how to fix an unknown task or a bad ``task_config``."""
    config = dict(config or {})
    if source in BUILTIN_TASKS:
        unknown = sorted(set(config) - set(_ADDITION_CONFIG))
        if unknown:
            raise ValueError(
                f"Unknown task_config keys {unknown} for {source}; valid: {list(_ADDITION_CONFIG)}."
            )
        _check_digits(config.get("digits", 1))
        _check_forms(config.get("question_forms"))
    elif source.startswith(GYM_PREFIX):
        _gym_config(source.removeprefix(GYM_PREFIX), config, size=1, seed=0)
    else:
        raise ValueError(
            f"Unknown task {source!r}. Valid sources: {', '.join(BUILTIN_TASKS)}, "
            f"'{GYM_PREFIX}<name>' (a reasoning-gym dataset, e.g. {GYM_PREFIX}chain_sum), or a "
            "path to a .jsonl/.parquet file or a folder written by datasets.save_to_disk."
        )


def task_examples(
    source: str, config: Mapping[str, Any] | None, train_size: int, val_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Disjoint ``(train, validation)`` examples of a procedural task."""
    validate_task(source, config)
    config = dict(config or {})
    if source == "addition":
        return addition_examples(**config, train_size=train_size, val_size=val_size, seed=seed)
    if source == "multiplication":
        return multiplication_examples(
            **config, train_size=train_size, val_size=val_size, seed=seed
        )
    name = source.removeprefix(GYM_PREFIX)
    return gym_examples(name, config, train_size=train_size, val_size=val_size, seed=seed)


# --- addition ------------------------------------------------------------------------------


def _check_digits(digits: object) -> None:
    # 10**(2*9) pairs is the largest population random.sample can index (it needs len(range)).
    if not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"task_config.digits must be an int in [1, 9], got {digits!r}.")


def _check_forms(forms: object) -> None:
    """``question_forms``: None or a list of templates with ``{a}``, ``{b}`` (and optionally
    ``{op}``), none of them a form of the paraphrased validation split."""
    if forms is None:
        return
    reserved = {f for group in QUESTION_FORMS.values() for f in group}
    for form in forms if isinstance(forms, list | tuple) and forms else [None]:
        if not isinstance(form, str) or "{a}" not in form or "{b}" not in form:
            raise ValueError(
                f"task_config.question_forms must be a non-empty list of templates with {{a}} "
                f"and {{b}} (e.g. 'Find {{a}} + {{b}}.'), got {forms!r}."
            )
        if form.replace("{op}", "+") in reserved or form.replace("{op}", "*") in reserved:
            raise ValueError(
                f"task_config.question_forms: {form!r} is a question form of the paraphrased "
                "validation split, which must stay unseen in training; choose another wording."
            )


def _arithmetic_example(a: int, b: int, op: str, form: str | None = None) -> Example:
    task = "addition" if op == "+" else "multiplication"
    question = f"What is {a} {op} {b}?" if form is None else form.format(a=a, b=b, op=op)
    prompt, answer = question, str(a + b if op == "+" else a * b)
    # A worked reference (for guidance callbacks such as GroundTruthInjection): the result
    # written out, then boxed. SmolLM2-135M-Instruct greedily completes "7 + 4 = " with the right
    # sum for 83 of the 100 one-digit sums but "7 + 4 = \boxed{" for 6, and copies a written
    # sum into the box every time, so a policy that imitates this form computes where it is
    # good at it (issue 40; the form is this project's choice).
    worked = f"{a} {op} {b} = {answer}, so the answer is \\boxed{{{answer}}}."
    columns = {"answer": answer, "solution": worked, "task": task}
    return Example(make_prompt_id(task, prompt, answer), prompt, columns)


def _operand_pairs(digits: int, train_size: int, val_size: int, seed: int) -> list[tuple[int, int]]:
    _check_digits(digits)
    base = 10**digits
    if val_size >= base * base:
        raise ValueError(
            f"val_size={val_size} leaves no training problems out of {base * base} with "
            f"digits={digits}; lower val_size or raise task_config.digits."
        )
    codes = random.Random(seed).sample(range(base * base), min(base * base, val_size + train_size))
    return [(code // base, code % base) for code in codes]


def _arithmetic_split(
    op: str, digits: int, forms: list[str] | None, train_size: int, val_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """``(train, validation)``: validation asks ``What is a op b?``; each training problem is
    asked with one of ``forms`` (drawn once per problem from ``seed``), else the same way."""
    pairs = _operand_pairs(digits, train_size, val_size, seed)
    pick = random.Random(f"question_forms:{seed}")
    val = [_arithmetic_example(a, b, op) for a, b in pairs[:val_size]]
    train = [
        _arithmetic_example(a, b, op, pick.choice(forms) if forms else None)
        for a, b in pairs[val_size:]
    ]
    return train, val


def addition_examples(
    digits: int = 1,
    question_forms: list[str] | None = None,
    *,
    train_size: int,
    val_size: int,
    seed: int,
) -> tuple[list[Example], list[Example]]:
    """``"What is a + b?"`` problems with operands of up to ``digits`` digits, split disjointly.

    Pairs are drawn without replacement from all ``(10**digits)**2`` ordered pairs with a seeded
    RNG; the first ``val_size`` form validation, the next ``train_size`` train. With ``digits=1``
    there are only 100 pairs, so train gets ``min(train_size, 100 - val_size)``.

    Args:
        digits: operands range over ``0 .. 10**digits - 1``.
        question_forms: templates (``{a}``, ``{b}``, ``{op}``) training problems are asked
            with, one drawn per problem, e.g. ``"Find {a} + {b}."``; None: ``What is a + b?``.
            Validation always asks ``What is a + b?`` (the paraphrased split rewords it with
            forms training may not use: refused here).
        train_size: training problems wanted.
        val_size: validation problems.
        seed: seed of the draw.
    """
    return _arithmetic_split("+", digits, question_forms, train_size, val_size, seed)


def multiplication_examples(
    digits: int = 1,
    question_forms: list[str] | None = None,
    *,
    train_size: int,
    val_size: int,
    seed: int,
) -> tuple[list[Example], list[Example]]:
    """``"What is a * b?"`` problems, drawn and split like ``addition_examples``.

    A second built-in task with another difficulty profile: the embedded SmolLM2-135M solves
    one-digit products less often than sums, and two-digit products rarely.
    """
    return _arithmetic_split("*", digits, question_forms, train_size, val_size, seed)


# --- reasoning-gym -------------------------------------------------------------------------


def _gym_config(name: str, config: Mapping[str, Any], size: int, seed: int) -> Any:
    """The validated reasoning-gym config object of task ``name``."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(
            f"Unknown reasoning-gym task {name!r}; available: {', '.join(sorted(DATASETS))}."
        )
    reserved = sorted(set(config) & set(_GYM_RESERVED))
    if reserved:
        raise ValueError(
            f"task_config must not set {reserved}: use train_size, val_size and seed of "
            "RLVRDataModule instead."
        )
    config_cls = DATASETS[name][1]
    valid = sorted({f.name for f in dataclasses.fields(config_cls)} - set(_GYM_RESERVED))
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise ValueError(f"Unknown task_config keys {unknown} for gym:{name}; valid: {valid}.")
    try:
        gym_config = config_cls(**config, size=size, seed=seed)
        if hasattr(gym_config, "validate"):
            gym_config.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise ValueError(f"Invalid task_config {dict(config)} for gym:{name}: {e}") from e
    return gym_config


def _gym_entries(name: str, config: Mapping[str, Any], size: int, seed: int) -> Iterable[dict]:
    """Lazily generated entries of a reasoning-gym dataset."""
    import reasoning_gym

    _gym_config(name, config, size, seed)  # clear errors before create_dataset's bare asserts
    return reasoning_gym.create_dataset(name, size=size, seed=seed, **config)


def _gym_example(name: str, entry: dict[str, Any]) -> Example:
    # The whole entry travels with the prompt: the task's own verifier needs its metadata.
    columns = {"answer": entry["answer"], "task": name, "gym_entry": entry}
    pid = make_prompt_id(f"{GYM_PREFIX}{name}", entry["question"], entry["answer"])
    return Example(pid, entry["question"], columns)


def _new_examples(
    name: str, entries: Iterable[dict[str, Any]], seen: set[str], limit: int
) -> list[Example]:
    """Up to ``limit`` examples whose question is not in ``seen`` (which grows as we go)."""
    examples: list[Example] = []
    for entry in entries:
        if len(examples) == limit:
            break
        if entry["question"] not in seen:
            seen.add(entry["question"])
            examples.append(_gym_example(name, entry))
    return examples


def gym_examples(
    name: str, config: Mapping[str, Any], *, train_size: int, val_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Train and validation examples of reasoning-gym task ``name``, with disjoint questions.

    Train uses ``seed``; validation uses ``seed + GYM_VAL_SEED_OFFSET`` and skips any question
    that train (or an earlier validation item) already has, drawing up to ``4 * val_size + 100``
    candidates; a warning says so when fewer than ``val_size`` distinct ones exist.
    """
    train = [_gym_example(name, e) for e in _gym_entries(name, config, train_size, seed)]
    if val_size == 0:
        return train, []
    candidates = _gym_entries(name, config, 4 * val_size + 100, seed + GYM_VAL_SEED_OFFSET)
    val = _new_examples(name, candidates, {e.prompt for e in train}, val_size)
    if len(val) < val_size:
        warnings.warn(
            f"gym:{name} produced only {len(val)} validation questions not seen in train "
            f"(wanted {val_size}); widen task_config or lower val_size.",
            stacklevel=2,
        )
    return train, val


def extract_final_answer(completion: str) -> str | None:
    r"""The answer a completion commits to.

    The content of the last ``\boxed{}``, else of the last ``<answer>`` tag, else the last line.
    """
    # Imported here because rlvr_lightning.rewards may load heavy scorers at import time.
    from rlvr_lightning.rewards.math import extract_boxed

    boxed = extract_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return lines[-1] if lines else None


def gym_verifier(
    completions: list[str], gym_entry: list[Mapping[str, Any] | None], **_: object
) -> list[float | None]:
    """Reward from each reasoning-gym task's own ``score_answer`` (``None`` for rows without entry).

    Args:
        completions: ``[N]`` completion texts.
        gym_entry: ``[N]`` the ``gym_entry`` column of the prompts, repeated per group member.
    """
    from reasoning_gym import get_score_answer_fn

    # get_score_answer_fn builds a dataset object per call, so build one per task per batch.
    scorers: dict[str, Callable[[str | None, Mapping[str, Any]], float]] = {}
    scores: list[float | None] = []
    for completion, entry in zip(completions, gym_entry, strict=True):
        if entry is None:
            scores.append(None)
            continue
        task = entry["metadata"]["source_dataset"]
        if task not in scorers:
            scorers[task] = get_score_answer_fn(task)
        scores.append(float(scorers[task](extract_final_answer(completion), entry)))
    return scores
