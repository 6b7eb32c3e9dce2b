"""Datasets users bring: answer formats (GSM8K, MATH) and several sources mixed by weight.

The prompt length limit applied to them lives in ``prompt_limit.py``.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsonargparse.typing import restricted_string_type

from rlvr_lightning.data.library import LoadOptions, has_splits
from rlvr_lightning.data.sources import (
    Example,
    drop_overlap,
    holdout_split,
    is_path_source,
    load_examples,
)
from rlvr_lightning.data.tasks import is_task_source, task_examples, validate_task
from rlvr_lightning.rewards.math import extract_boxed, normalize_gold

AnswerFormat = Literal["plain", "gsm8k", "boxed"]

# A source given as one string (a task, a file, a folder, a Hub id). jsonargparse loads a string
# that names an existing file as the value itself when the type allows a list (an empty file
# became `source: []`, a CSV's text a string); a path-like member in the union turns that off
# for the argument (`is_pathlike`), and a name without line breaks keeps file text out.
SourceName = restricted_string_type("SourceName", r"\A[^\n]+\Z")


def source_as_str(value: object) -> object:
    """A path-like or string source as a plain ``str`` (the parser's ``SourceName`` is a
    subclass, which ``torch.load(weights_only=True)`` would refuse in a checkpoint's
    hyperparameters); a list of sources unchanged."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str.__str__(value) if isinstance(value, str) else value


@dataclass
class SourceSpec:
    """One data source of a mixture.

    Args:
        source: a task (``addition``, ``multiplication``, ``gym:<name>``), a data file
            (``.jsonl``, ``.json``, ``.csv``, ``.parquet``) or folder (``save_to_disk``, or laid
            out like a Hub dataset repository), or a Hugging Face Hub dataset id (``org/name``).
        weight: share of the training stream, relative to the other sources' weights.
        task_config: task generator arguments (tasks only).
        columns: ``our name -> file column`` (files only).
        answer_format: ``plain`` uses the answer column as is; ``gsm8k`` takes the text after
            ``####`` of the answer column and keeps the full text as ``solution``; ``boxed``
            takes the last ``\\boxed{}`` of the ``solution`` column (MATH style).
        config: the dataset's configuration (``load_dataset(name=...)``), e.g. ``main`` for
            ``openai/gsm8k``; Hub ids and repository folders only.
        split: the split to read (Hub ids, repository folders, CSV/JSON files).
        revision: a Hub branch, tag or commit, so a run reads the same data again.
        streaming: read rows as they download instead of fetching the whole dataset first;
            only the first ``max_rows`` rows (default: ``train_size + val_size``) are read.
        max_rows: read at most this many rows, the first ones (None: all, unless streaming).
    """

    source: str
    weight: float = 1.0
    task_config: dict[str, Any] | None = None
    columns: dict[str, str] | None = None
    answer_format: AnswerFormat = "plain"
    config: str | None = None
    split: str = "train"
    revision: str | None = None
    streaming: bool = False
    max_rows: int | None = None

    def load_options(self, default_rows: int | None) -> LoadOptions:
        """How ``datasets.load_dataset`` reads this source; ``default_rows`` bounds streaming
        when ``max_rows`` is unset (None: read every row)."""
        rows = self.max_rows if self.max_rows is not None or not self.streaming else default_rows
        return LoadOptions(self.config, self.split, self.revision, self.streaming, rows)


def _with_answer(example: Example, answer: str, solution: str | None) -> Example:
    columns = {**example.columns, "answer": answer}
    if solution is not None:
        columns.setdefault("solution", solution)
    return dataclasses.replace(example, columns=columns)


def _bad_rows(origin: str, fmt: str, bad: list[str], hint: str) -> ValueError:
    return ValueError(
        f"{origin}: {len(bad)} rows have no {hint} for answer_format={fmt!r} (first: prompt "
        f"{bad[0][:60]!r}). Fix the rows, or pick the answer_format that matches the data."
    )


def apply_answer_format(examples: list[Example], fmt: AnswerFormat, origin: str) -> list[Example]:
    """Derive the ``answer`` column from the dataset's solution text (see ``SourceSpec``)."""
    if fmt == "plain":
        return examples
    out, bad = [], []
    for ex in examples:
        if fmt == "gsm8k":
            text = str(ex.columns.get("answer") or "")
            ok = "####" in text
            answer, solution = normalize_gold(text), text
        else:
            text = str(ex.columns.get("solution") or ex.columns.get("answer") or "")
            boxed = extract_boxed(text)
            ok, answer, solution = boxed is not None, normalize_gold(boxed), text
        if ok and answer:
            out.append(_with_answer(ex, answer, solution))
        else:
            bad.append(ex.prompt)
    if bad:
        hint = "'#### <answer>' line" if fmt == "gsm8k" else "\\boxed{} answer in the solution"
        raise _bad_rows(origin, fmt, bad, hint)
    return out


def source_splits(
    spec: SourceSpec, train_size: int, val_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """``(train, held-out validation)`` examples of one source."""
    if is_task_source(spec.source):
        return task_examples(spec.source, spec.task_config, train_size, val_size, seed)
    loaded = load_examples(spec.source, spec.columns, spec.load_options(train_size + val_size))
    examples = apply_answer_format(loaded, spec.answer_format, spec.source)
    return holdout_split(examples, val_size, seed) if val_size else (examples, [])


def weighted_counts(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` by ``weights`` (largest remainders get the leftover units)."""
    if not weights or any(w <= 0 for w in weights):
        raise ValueError(f"Source weights must all be > 0, got {list(weights)}.")
    shares = [total * w / sum(weights) for w in weights]
    counts = [int(s) for s in shares]
    order = sorted(range(len(shares)), key=lambda i: counts[i] - shares[i])
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def resample(examples: list[Example], count: int, rng: random.Random) -> list[Example]:
    """``count`` examples: whole copies of ``examples`` plus a seeded sample of the rest."""
    copies, rest = divmod(count, len(examples))
    return examples * copies + rng.sample(examples, rest)


def mixture_splits(
    specs: Sequence[SourceSpec], train_size: int, val_size: int, seed: int
) -> tuple[list[Example], list[Example]]:
    """Training examples mixed by weight, and each source's held-out validation share.

    Every source contributes its weight's share of the combined training size (the sum of the
    sources' sizes), by repetition when it has fewer examples, so an epoch of the stream visits
    the sources in proportion to their weights.
    """
    weights = [s.weight for s in specs]
    val_counts = weighted_counts(val_size, weights) if val_size else [0] * len(specs)
    splits = [
        source_splits(spec, train_size, n_val, seed)
        for spec, n_val in zip(specs, val_counts, strict=True)
    ]
    empty = [s.source for s, (train, _) in zip(specs, splits, strict=True) if not train]
    if empty:
        raise ValueError(f"Sources {empty} have no training examples; remove them.")
    total = sum(len(train) for train, _ in splits)
    rng = random.Random(seed)
    train = [
        ex
        for (examples, _), n in zip(splits, weighted_counts(total, weights), strict=True)
        for ex in resample(examples, n, rng)
    ]
    val = drop_overlap([ex for _, v in splits for ex in v], train, "validation")
    return train, val


def validate_source(
    source: str,
    task_config: Mapping[str, Any] | None,
    val_source: str | None,
    columns: Mapping[str, str] | None,
) -> None:
    """Raise a ValueError that says how to fix an inconsistent choice of data."""
    if is_task_source(source) or not is_path_source(source):
        validate_task(source, task_config)  # also rejects unknown task names
    elif task_config:
        raise ValueError(
            f"task_config applies to procedural tasks, but source {source!r} is a file; remove "
            "task_config or set source to a task (e.g. addition, gym:chain_sum)."
        )
    if val_source is not None and not is_path_source(val_source):
        raise ValueError(
            f"val_source must be a data file (.jsonl, .json, .csv, .parquet), a dataset folder "
            f"or a Hub dataset id (org/name), got {val_source!r}; leave it unset to hold out "
            "val_size examples of source."
        )
    if columns is not None and is_task_source(source) and val_source is None:
        raise ValueError(
            "columns maps the columns of data files, but source is a procedural task and there "
            "is no val_source; remove columns."
        )


def check_load_options(spec: SourceSpec) -> None:
    """Procedural tasks take no dataset options: a set one is a mistake, not ignored."""
    given = {
        name: value
        for name, value in (("config", spec.config), ("revision", spec.revision))
        if value is not None
    }
    given.update({"split": spec.split} if spec.split != "train" else {})
    given.update({"streaming": True} if spec.streaming else {})
    if given and is_task_source(spec.source):
        raise ValueError(
            f"{sorted(given)} apply to datasets (files, folders, Hub ids), but source "
            f"{spec.source!r} is a procedural task; remove them or point source at a dataset."
        )


def source_specs(
    source: str | list[SourceSpec],
    task_config: dict[str, Any] | None,
    columns: dict[str, str] | None,
    answer_format: AnswerFormat,
) -> list[SourceSpec]:
    if isinstance(source, str):
        return [SourceSpec(source, 1.0, task_config, columns, answer_format)]
    if not source or task_config or columns:
        raise ValueError(
            "With a list of sources, give task_config/columns inside each entry (and at least "
            "one entry): source: [{source: addition, weight: 2}, {source: data.jsonl, "
            "columns: {prompt: question}}]."
        )
    return [s if isinstance(s, SourceSpec) else SourceSpec(**s) for s in source]


def checked_specs(
    source: str | list[SourceSpec],
    task_config: dict[str, Any] | None,
    columns: dict[str, str] | None,
    answer_format: AnswerFormat,
    val_source: str | None,
) -> list[SourceSpec]:
    """The training sources as ``SourceSpec``s, each validated against the other arguments."""
    specs = source_specs(source, task_config, columns, answer_format)
    for spec in specs:
        validate_source(spec.source, spec.task_config, val_source, spec.columns)
        check_load_options(spec)
    return specs


def test_specs(
    specs: Sequence[SourceSpec],
    test_source: str | list[SourceSpec] | None,
    test_split: str,
    answer_format: AnswerFormat,
) -> list[SourceSpec]:
    """The sources ``test`` evaluates: ``test_source``, else ``test_split`` of every source that
    has splits (Hub ids, repository folders); a ValueError names the fix when there is none."""
    if test_source is not None:
        first = specs[0]
        return source_specs(test_source, None, first.columns, answer_format)
    split_sources = [s for s in specs if has_splits(s.source)]
    if not split_sources:
        names = [s.source for s in specs]
        raise ValueError(
            f"`test` needs a test set, and the sources {names} have no splits (procedural tasks "
            "and single files). Set data.test_source to a file or Hub dataset, or run `validate`."
        )
    return [dataclasses.replace(s, split=test_split, weight=1.0) for s in split_sources]


def load_test_examples(specs: Sequence[SourceSpec]) -> list[Example]:
    """Every row of each test source, in order (no hold-out, no resampling)."""
    examples: list[Example] = []
    for spec in specs:
        loaded = load_examples(spec.source, spec.columns, spec.load_options(None))
        examples += apply_answer_format(loaded, spec.answer_format, spec.source)
    return examples
