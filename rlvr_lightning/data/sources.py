"""User datasets as ``Example``s: rows from a reader, through a column mapping, with stable ids.

Rows come from the project's readers (``readers.py``: JSONL with line numbers, Parquet,
``save_to_disk`` folders) or from the ``datasets`` library (``library.py``); this module maps
their columns, checks conversational prompts, and splits off held-out validation.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlvr_lightning.data.errors import DataError
from rlvr_lightning.data.library import LoadOptions, library_rows, uses_library
from rlvr_lightning.data.readers import FILE_SUFFIXES, jsonl_records, read_rows

DEFAULT_COLUMNS: Mapping[str, str] = {"prompt": "prompt"}
"""Column mapping used when none is given: ``our name -> the dataset's column``. Unmapped
columns (``answer`` included) pass through under their own names; which of them must exist is
decided by the reward functions' signatures, checked when training starts."""

COLUMNS_HINT = "set the `columns` mapping of RLVRDataModule (CLI: --data.columns)"
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Example:
    """One prompt and the columns its reward functions need.

    Args:
        prompt_id: stable id, ``"<source>:<12 hex digits>"`` from the prompt and answer text, so
            the same example has the same id across runs, processes and resumes.
        prompt: the user question, without any instruction or system prompt; for a
            conversation, its messages' contents joined by blank lines (what de-duplication
            and the prompt length limit read).
        columns: ``answer``, optional ``solution``, task metadata and any other column.
        messages: the conversation of a conversational prompt (``{"role", "content"}`` dicts
            ending with a user turn); None for a text prompt.
    """

    prompt_id: str
    prompt: str
    columns: dict[str, Any]
    messages: Messages | None = None


def make_prompt_id(source: str, prompt: str, answer: object) -> str:
    """Stable id of an example from its source, prompt and answer.

    The NUL separator keeps ``("ab", "c")`` apart from ``("a", "bc")``.
    """
    text = f"{prompt}\x00{'' if answer is None else answer}"
    return f"{source}:{hashlib.sha1(text.encode('utf-8')).hexdigest()[:12]}"


def is_path_source(source: str) -> bool:
    """Whether ``source`` names data (a file, a folder or a Hub dataset ``org/name``) rather
    than a task."""
    named = source.endswith((*FILE_SUFFIXES, ".csv", ".json")) or "/" in source
    return named or Path(source).exists()


def source_name(path: str | Path) -> str:
    """Short name used in prompt ids: the file name without suffix, or the folder name."""
    return Path(path).stem


def resolve_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """The mapping to apply: the default when None; ``prompt`` defaults to ``"prompt"``."""
    if columns is None:
        return dict(DEFAULT_COLUMNS)
    return {"prompt": "prompt", **columns}


def _check_mapping(row: Mapping[str, Any], mapping: Mapping[str, str], where: str) -> None:
    """Raise when a mapped column is missing or a renamed column would overwrite another."""
    for ours, theirs in mapping.items():
        if theirs not in row:
            raise DataError(
                f"{where}: column {theirs!r} (mapped to {ours!r}) is missing; present columns: "
                f"{sorted(row)}. To fix, {COLUMNS_HINT}, e.g. columns: {{{ours}: <column>}}."
            )
    clashes = [name for name in mapping if name in row and name not in mapping.values()]
    if clashes:
        raise DataError(
            f"{where}: the mapping renames columns onto existing columns {clashes}, which would be "
            f"lost. To fix, {COLUMNS_HINT} so those columns get new names, e.g. "
            f"columns: {{raw_{clashes[0]}: {clashes[0]}}}."
        )


def _rename(row: Mapping[str, Any], mapping: Mapping[str, str]) -> dict[str, Any]:
    """Row with mapped columns renamed to our names; unmapped columns pass through."""
    renamed = {ours: row[theirs] for ours, theirs in mapping.items()}
    mapped = set(mapping.values())
    renamed.update({k: v for k, v in row.items() if k not in mapped})
    return renamed


def _not_text(where: str, column: str, prompt: object) -> DataError:
    shown = repr(prompt) if len(repr(prompt)) <= 40 else repr(prompt)[:37] + "..."
    return DataError(
        f"{where}: the prompt column {column!r} must hold text or a list of chat messages "
        f'({{"role": ..., "content": ...}}), got {type(prompt).__name__} {shown}. To fix, make it '
        f"a string in this row, or {COLUMNS_HINT} to a text column."
    )


def _bad_message(where: str, column: str, i: int, problem: str) -> DataError:
    return DataError(
        f"{where}: message {i} of the prompt column {column!r} {problem}. A conversational "
        'prompt is a list of {"role": "system" | "user" | "assistant", "content": "<text>"} '
        "objects ending with a user turn."
    )


def check_messages(prompt: list[Any], where: str, column: str) -> Messages:
    """A conversational prompt as plain ``{"role", "content"}`` dicts, or a ``DataError``."""
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise _bad_message(where, column, i, f"is {type(message).__name__}, not an object")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise _bad_message(where, column, i, "needs a text 'role' and a text 'content'")
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] != "user":
        raise _bad_message(
            where, column, len(messages) - 1, f"has role {messages[-1]['role']!r}, not 'user'"
        )
    return messages


def plain_text(messages: Messages) -> str:
    """A conversation as one text: the contents joined by blank lines, roles dropped."""
    return "\n\n".join(m["content"] for m in messages if m["content"])


def _example(
    source: str, prompt: str | list[Any], fields: dict[str, Any], where: str, column: str
) -> Example:
    """The example of one row whose prompt is text or a non-empty message list."""
    if isinstance(prompt, str):
        return Example(make_prompt_id(source, prompt, fields.get("answer")), prompt, fields)
    messages = check_messages(prompt, where, column)
    key = json.dumps(messages, ensure_ascii=False)
    pid = make_prompt_id(source, key, fields.get("answer"))
    return Example(pid, plain_text(messages), fields, messages)


def _blank_message(message: object) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
        and not message["content"].strip()
    )


def _has_text(prompt: str | list[Any]) -> bool:
    """False for blank text, an empty list, or messages that are all well formed and blank
    (skipped as empty prompts); a malformed message counts as text, so its error is raised."""
    if isinstance(prompt, str):
        return bool(prompt.strip())
    return not all(_blank_message(m) for m in prompt)


def examples_from_rows(
    rows: Iterable[Mapping[str, Any]],
    source: str,
    origin: str,
    columns: Mapping[str, str] | None = None,
    lines: Sequence[int] | None = None,
) -> list[Example]:
    """Examples from rows through a column mapping; empty prompts are skipped with a warning.

    Args:
        rows: dataset rows.
        source: prefix of the prompt ids.
        origin: where the rows come from (a path), for error messages.
        columns: ``our name -> the dataset's column``; see ``resolve_columns``.
        lines: the file line of each row (JSONL), so errors say ``origin:line``; else
            ``origin row i``.
    """
    mapping = resolve_columns(columns)
    examples, empty = [], 0
    for i, row in enumerate(rows, start=1):
        where = f"{origin}:{lines[i - 1]}" if lines is not None else f"{origin} row {i}"
        _check_mapping(row, mapping, where)
        fields = _rename(row, mapping)
        prompt = fields.pop("prompt")
        if prompt is None or (isinstance(prompt, str | list) and not _has_text(prompt)):
            empty += 1
            continue
        if not isinstance(prompt, str | list):
            raise _not_text(where, mapping["prompt"], prompt)
        examples.append(_example(source, prompt, fields, where, mapping["prompt"]))
    if empty:
        warnings.warn(f"{origin}: skipped {empty} rows with an empty prompt.", stacklevel=2)
    return examples


def _located_rows(
    path: str | Path, options: LoadOptions | None
) -> tuple[list[dict[str, Any]], list[int] | None]:
    """Rows of a source and, for a JSONL file, the line each row is on."""
    if uses_library(str(path)):
        return library_rows(str(path), options or LoadOptions()), None
    if Path(path).suffix == ".jsonl" and Path(path).is_file():
        records = list(jsonl_records(path))
        return [row for _, row in records], [lineno for lineno, _ in records]
    return read_rows(path), None


def load_examples(
    path: str | Path,
    columns: Mapping[str, str] | None = None,
    options: LoadOptions | None = None,
) -> list[Example]:
    """Examples of a ``.jsonl``/``.parquet`` file, a saved ``datasets`` folder, or a source
    read through the ``datasets`` library (Hub id, CSV/JSON, dataset repo folder; ``options``
    pick its config, split, revision, streaming and row limit: ``library.LoadOptions``).

    Errors name the file and, for JSONL, the line; a source without rows or without a
    non-empty prompt raises a ``DataError``.
    """
    rows, lines = _located_rows(path, options)
    if not rows:
        raise DataError(
            f"{path}: holds no rows. Point source at a non-empty dataset (JSONL: one JSON object "
            "per line) or remove it from the sources."
        )
    examples = examples_from_rows(rows, source_name(path), str(path), columns, lines)
    if not examples:
        column = resolve_columns(columns)["prompt"]
        raise DataError(
            f"{path}: all {len(rows)} rows have an empty prompt column {column!r}. To fix, fill "
            f"it, or {COLUMNS_HINT} to the column that holds the question."
        )
    return examples


def holdout_split(
    examples: list[Example], val_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Split off ``val_size`` examples chosen by a seeded permutation; both keep file order.

    Validation examples whose prompt also appears in train (duplicate rows) are dropped with a
    warning, so the two splits never share a question.
    """
    if val_size >= len(examples):
        raise ValueError(
            f"val_size={val_size} leaves no training examples out of {len(examples)}; lower "
            "val_size or pass a separate val_source."
        )
    perm = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))
    held = set(perm[:val_size].tolist())
    train = [e for i, e in enumerate(examples) if i not in held]
    val = [e for i, e in enumerate(examples) if i in held]
    return train, drop_overlap(val, train, "validation")


def drop_overlap(candidates: list[Example], reference: list[Example], what: str) -> list[Example]:
    """``candidates`` without prompts present in ``reference`` (or repeated), with a warning."""
    seen = {e.prompt for e in reference}
    kept = []
    for example in candidates:
        if example.prompt not in seen:
            kept.append(example)
            seen.add(example.prompt)
    if len(kept) < len(candidates):
        dropped = len(candidates) - len(kept)
        warnings.warn(
            f"Dropped {dropped} {what} examples that repeat a training prompt or an earlier one.",
            stacklevel=2,
        )
    return kept
