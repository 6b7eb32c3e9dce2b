"""Sources read through the ``datasets`` library: Hub ids, CSV/JSON files, dataset repo folders.

``load_dataset`` handles what the project's own readers (``sources.py``: JSONL with line numbers,
Parquet, ``save_to_disk`` folders) do not: a dataset on the Hugging Face Hub by id with its
config, split and revision, streamed when only the first rows are wanted; CSV and JSON files;
a folder laid out like a Hub dataset repository (``train.csv``/``test.jsonl`` files, or a README
whose YAML lists configs). ``datasets`` is imported only when such a source is used.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr_lightning.data.errors import DataError

LIBRARY_SUFFIXES = (".csv", ".json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name
_SAVED_MARKERS = ("state.json", "dataset_dict.json")
OFFLINE_HINT = (
    "Without network: set HF_DATASETS_OFFLINE=1 to read a copy from the local cache "
    "(~/.cache/huggingface/datasets), or save the data where the Hub is reachable "
    "(`Dataset.to_json('train.jsonl')` or `save_to_disk`) and set source to that path."
)


@dataclass(frozen=True)
class LoadOptions:
    """How ``load_dataset`` reads a source (see ``SourceSpec`` for the meaning of each)."""

    config: str | None = None
    split: str = "train"
    revision: str | None = None
    streaming: bool = False
    max_rows: int | None = None


def is_hub_id(source: str) -> bool:
    """Whether ``source`` reads as ``org/name`` and names no local file or folder."""
    return bool(_HUB_ID.match(source)) and not Path(source).exists()


def _is_saved_folder(path: Path) -> bool:
    return any((path / m).exists() for m in _SAVED_MARKERS) or any(path.glob("*.arrow"))


def uses_library(source: str) -> bool:
    """Whether ``source`` is read through ``datasets.load_dataset`` (see the module doc)."""
    path = Path(source)
    if path.is_dir():
        return not _is_saved_folder(path)
    return path.suffix in LIBRARY_SUFFIXES or is_hub_id(source)


def has_splits(source: str) -> bool:
    """Whether ``source`` can hold several splits: a Hub id or a repository-style folder."""
    path = Path(source)
    return is_hub_id(source) or (path.is_dir() and not _is_saved_folder(path))


def _load_arguments(source: str, options: LoadOptions) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments of ``load_dataset`` for ``source``."""
    path = Path(source)
    kwargs: dict[str, Any] = {"split": options.split, "streaming": options.streaming}
    if path.suffix in LIBRARY_SUFFIXES and not path.is_dir():
        if not path.is_file():
            raise DataError(f"Data source {source} does not exist; check the path.")
        return [path.suffix[1:]], {**kwargs, "data_files": {options.split: str(path)}}
    if options.config is not None:
        kwargs["name"] = options.config
    if options.revision is not None:
        kwargs["revision"] = options.revision
    return [source], kwargs


def _describe(source: str, options: LoadOptions) -> str:
    parts = [f"split {options.split!r}"]
    parts += [f"config {options.config!r}"] if options.config else []
    parts += [f"revision {options.revision!r}"] if options.revision else []
    return f"dataset {source!r} ({', '.join(parts)})"


def _load_error(source: str, options: LoadOptions, err: Exception) -> DataError:
    """The error a user sees: what could not be loaded, the library's cause, and the fix."""
    from datasets.exceptions import DatasetNotFoundError

    cause = (str(err).strip().splitlines() or [type(err).__name__])[0]
    what = f"Could not load {_describe(source, options)} with the `datasets` library: {cause}"
    if isinstance(err, ValueError) and not isinstance(err, DatasetNotFoundError):
        return DataError(f"{what}\nFix the split or config in the source entry.")
    if not is_hub_id(source):
        return DataError(what)
    return DataError(f"{what}\n{OFFLINE_HINT}")


def library_rows(source: str, options: LoadOptions) -> list[dict[str, Any]]:
    """Rows of ``source`` through ``datasets.load_dataset``; at most ``options.max_rows``.

    With ``streaming`` only the rows read are downloaded. Errors become a ``DataError`` that
    names the source, the library's cause and, for Hub ids, how to work offline.
    """
    import datasets

    datasets.logging.set_verbosity_error()  # keep the library's info lines off a normal run
    args, kwargs = _load_arguments(source, options)
    try:
        data = datasets.load_dataset(*args, **kwargs)
        rows = data if options.max_rows is None else itertools.islice(data, options.max_rows)
        return [dict(row) for row in rows]
    except DataError:
        raise
    except Exception as err:  # the library raises many kinds; each becomes one clear message
        raise _load_error(source, options, err) from err
