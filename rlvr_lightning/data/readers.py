"""The project's own file readers, one a format: JSON lines, Parquet, ``save_to_disk`` folders.

Each returns plain rows (dicts); ``sources.examples_from_rows`` turns them into ``Example``s.
The ``datasets`` package is never imported: a saved folder is a set of Arrow IPC *stream*
files listed in ``state.json``, which pyarrow reads directly. JSONL errors name file and line.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlvr_lightning.data.errors import DataError

FILE_SUFFIXES = (".jsonl", ".parquet")
_BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of U+D800..U+DFFF
_SURROGATE = re.compile("[\ud800-\udfff]")


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
