"""Datasets users bring: answer formats (GSM8K, MATH), several sources mixed by weight, and a
prompt length limit.
"""

from __future__ import annotations

import dataclasses
import os
import random
import warnings
from collections.abc import Callable, Mapping, Sequence
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


PROMPT_TOKEN_CAP = 4096
"""Most prompt tokens kept when ``max_prompt_tokens`` is unset (this project's choice).

Four times the 512-1024 that RLVR recipes usually allow (verl, OpenRLHF, TRL), so ordinary
math and code prompts all pass, while a long-context model cannot be asked to prefill and
back-propagate through tens of thousands of prompt tokens times ``G`` by one stray row.
"""


def default_prompt_limit(
    context: int | None, max_new_tokens: int, template_tokens: int, cap: int = PROMPT_TOKEN_CAP
) -> int:
    """Prompt tokens allowed by default: what the context leaves, at most ``cap``.

    ``context - max_new_tokens - template_tokens`` (chat template, system prompt and
    instruction around the question), so prompt plus completion fit the model's positions.
    ``context=None`` (unknown) gives ``cap``.
    """
    if context is None:
        return cap
    room = context - max_new_tokens - template_tokens
    if room < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} plus {template_tokens} chat-template tokens leave no "
            f"room for prompts in the model's {context} positions; lower sampling.max_new_tokens."
        )
    return min(cap, room)


def drop_long_prompts(
    examples: list[Example],
    count_tokens: Callable[[str], int],
    limit: int,
    what: str,
    why: str | None = None,
) -> list[Example]:
    """``examples`` whose prompt has at most ``limit`` tokens; the rest skipped with a count.

    ``why`` says where the limit comes from in the warning (default: ``max_prompt_tokens``).
    Each distinct prompt is counted once (mixtures repeat examples).
    """
    counts: dict[str, int] = {}
    for e in examples:
        if e.prompt not in counts:
            counts[e.prompt] = count_tokens(e.prompt)
    kept = [e for e in examples if counts[e.prompt] <= limit]
    if len(kept) < len(examples):
        warnings.warn(
            f"Skipped {len(examples) - len(kept)} of {len(examples)} {what} prompts longer than "
            f"{why or f'max_prompt_tokens={limit}'}.",
            stacklevel=2,
        )
    return kept


def limit_prompts(
    train: list[Example],
    val: list[Example],
    count_tokens: Callable[[str], int],
    limit: int,
    why: str,
) -> tuple[list[Example], list[Example], dict[str, int]]:
    """Both splits without prompts over ``limit`` tokens, and how many each lost."""
    kept = drop_long_prompts(train, count_tokens, limit, "training", why)
    val_kept = drop_long_prompts(val, count_tokens, limit, "validation", why)
    if not kept:
        raise ValueError(
            f"All {len(train)} training prompts are longer than {why}; raise "
            "data.max_prompt_tokens (within the model's context) or shorten the prompts."
        )
    skipped = {"training": len(train) - len(kept), "validation": len(val) - len(val_kept)}
    return kept, val_kept, skipped


def model_prompt_limit(
    module: Any, template_tokens: Callable[[Any], int]
) -> tuple[int, str] | None:
    """The default limit for ``module``'s model (see ``default_prompt_limit``) and its reason.

    Reads ``module.policy.config.max_position_embeddings``, the ``max_new_tokens`` of
    ``module.sampling``/``val_sampling`` and ``module.tokenizer`` (``template_tokens`` counts
    the template around a question with it); None when there is no such module.
    """
    tokenizer = getattr(module, "tokenizer", None)
    if tokenizer is None or not hasattr(module, "policy"):
        return None
    context = getattr(getattr(module.policy, "config", None), "max_position_embeddings", None)
    samplings = [getattr(module, name, None) for name in ("sampling", "val_sampling")]
    new_tokens = max((s.max_new_tokens for s in samplings if s is not None), default=0)
    template = template_tokens(tokenizer)
    limit = default_prompt_limit(context, new_tokens, template)
    return limit, (
        f"{limit} tokens, the default limit min({PROMPT_TOKEN_CAP}, context {context} - "
        f"max_new_tokens {new_tokens} - chat template {template}); set data.max_prompt_tokens "
        "to change it"
    )


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
