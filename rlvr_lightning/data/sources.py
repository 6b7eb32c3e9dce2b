"""User datasets: JSONL, Parquet and folders written by ``datasets.Dataset.save_to_disk``.

Every loader returns plain rows (dicts); ``examples_from_rows`` turns them into ``Example``s
through a column mapping. The ``datasets`` package is never imported: a saved folder is a set of
Arrow IPC *stream* files listed in ``state.json``, which pyarrow reads directly.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rlvr_lightning.data.library import LoadOptions

DEFAULT_COLUMNS: Mapping[str, str] = {"prompt": "prompt"}
"""Column mapping used when none is given: ``our name -> the dataset's column``. Unmapped
columns (``answer`` included) pass through under their own names; which of them must exist is
decided by the reward functions' signatures, checked when training starts."""

FILE_SUFFIXES = (".jsonl", ".parquet")
COLUMNS_HINT = "set the `columns` mapping of RLVRDataModule (CLI: --data.columns)"
_BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of U+D800..U+DFFF
_SURROGATE = re.compile("[\ud800-\udfff]")
Messages = list[dict[str, str]]


class DataError(ValueError):
    """A dataset the loader cannot use; the message names the file (and line) and the fix.

    A ``ValueError``, so existing handlers still catch it; a CLI can print just the message.
    """


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


def _decode_line(raw: bytes, path: str | Path, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x}, byte {e.start + 1} of "
            "the line). Re-encode the file as UTF-8, e.g. `iconv -f <its encoding> -t utf-8 "
            "in.jsonl > out.jsonl` (cp1252 or latin1 for files saved by older Windows tools)."
        ) from None


def _replace_surrogates(value: Any) -> tuple[Any, int]:
    """``value`` with lone UTF-16 surrogates (in strings, keys included) replaced by U+FFFD."""
    if isinstance(value, str):
        return _SURROGATE.subn("\ufffd", value)
    if isinstance(value, list):
        pairs = [_replace_surrogates(v) for v in value]
        return [v for v, _ in pairs], sum(n for _, n in pairs)
    if isinstance(value, dict):
        keys, in_keys = _replace_surrogates(list(value))
        values, in_values = _replace_surrogates(list(value.values()))
        return dict(zip(keys, values, strict=True)), in_keys + in_values
    return value, 0


def _parse_line(raw: bytes, path: str | Path, lineno: int) -> dict[str, Any]:
    try:
        row = json.loads(_decode_line(raw, path, lineno))
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}). Each line must hold "
            "one complete JSON object."
        ) from None
    if not isinstance(row, dict):
        raise DataError(
            f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}. Write "
            'one object per line, e.g. {"prompt": "...", "answer": "..."}.'
        )
    return row


def jsonl_records(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, row)`` of a JSON-lines file; blank lines and a UTF-8 BOM are skipped.

    Invalid UTF-8 or JSON raises a ``DataError`` naming file and line. A lone surrogate
    escape (``"\\ud800"``: valid JSON, but no UTF-8 text can hold it, so the tokenizer would
    fail later) is replaced by U+FFFD, with one warning counting the rows (this project's
    choice: it is usually a cut emoji, and the rest of the row is fine).
    """
    fixed, first = 0, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            raw = raw.removeprefix(_BOM) if lineno == 1 else raw
            if not raw.strip():
                continue
            row = _parse_line(raw, path, lineno)
            if _SURROGATE_ESCAPE.search(raw):  # cheap test first: rows without escapes are fine
                row, replaced = _replace_surrogates(row)
                if replaced:
                    fixed, first = fixed + 1, first or lineno
            yield lineno, row
    if fixed:
        warnings.warn(
            f"{path}: replaced lone UTF-16 surrogates (invalid text, e.g. a cut emoji) with "
            f"U+FFFD in {fixed} rows (first: line {first}). Fix the text to silence this.",
            stacklevel=2,
        )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSON-lines file; see ``jsonl_records`` for what is checked."""
    return [row for _, row in jsonl_records(path)]


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a Parquet file."""
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _arrow_files(folder: Path) -> list[Path]:
    """Arrow files of a saved dataset, in the order ``state.json`` lists them."""
    if (folder / "dataset_dict.json").exists():
        splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        raise ValueError(
            f"{folder} holds a DatasetDict with splits {splits}; point the source at one split "
            f"folder, e.g. {folder / splits[0]}."
        )
    state = folder / "state.json"
    if state.exists():
        return [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise ValueError(
            f"{folder} has neither state.json nor .arrow files; expected a folder written by "
            "datasets.Dataset.save_to_disk."
        )
    return files


def read_saved_dataset(folder: str | Path) -> list[dict[str, Any]]:
    """Rows of a folder written by ``datasets.Dataset.save_to_disk`` (Arrow IPC streams)."""
    import pyarrow as pa

    rows: list[dict[str, Any]] = []
    for file in _arrow_files(Path(folder)):
        with pa.memory_map(str(file)) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl`` file, a ``.parquet`` file or a saved ``datasets`` folder."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Data source {path} does not exist.")
    if path.is_dir():
        return read_saved_dataset(path)
    if path.suffix == ".jsonl":
        return read_jsonl(path)
    if path.suffix == ".parquet":
        return read_parquet(path)
    raise ValueError(
        f"Unsupported data file {path}: use .jsonl, .json, .csv, .parquet, a folder written by "
        "datasets.Dataset.save_to_disk, or a Hub dataset id (org/name)."
    )


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
    from rlvr_lightning.data.library import LoadOptions, library_rows, uses_library

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
