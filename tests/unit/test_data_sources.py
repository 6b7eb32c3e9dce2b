from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlvr_lightning.data.sources import (
    Example,
    holdout_split,
    load_examples,
    make_prompt_id,
    read_rows,
)

ROWS = [
    {"question": "What is 1 + 1?", "answer": "2", "solution": "1 + 1 = 2", "level": 1},
    {"question": "What is 2 + 3?", "answer": "5", "solution": "2 + 3 = 5", "level": 2},
]
MAPPING = {"prompt": "question", "answer": "answer", "solution": "solution"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_saved_dataset(folder, shards):
    """The layout of ``datasets.Dataset.save_to_disk``: Arrow IPC streams listed in state.json."""
    folder.mkdir()
    names = [f"data-{i:05d}-of-{len(shards):05d}.arrow" for i in range(len(shards))]
    for name, rows in zip(names, shards, strict=True):
        table = pa.Table.from_pylist(rows)
        with (
            pa.OSFile(str(folder / name), "wb") as sink,
            pa.ipc.new_stream(sink, table.schema) as w,
        ):
            w.write_table(table)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))
    return folder


def check_mapped(examples: list[Example]) -> None:
    assert [e.prompt for e in examples] == [r["question"] for r in ROWS]
    assert examples[0].columns == {"answer": "2", "solution": "1 + 1 = 2", "level": 1}


def test_jsonl_with_column_mapping(tmp_path):
    check_mapped(load_examples(write_jsonl(tmp_path / "train.jsonl", ROWS), MAPPING))


def test_parquet_with_column_mapping(tmp_path):
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train.parquet")
    check_mapped(load_examples(tmp_path / "train.parquet", MAPPING))


def test_saved_dataset_folder_reads_shards_in_order(tmp_path):
    folder = write_saved_dataset(tmp_path / "train", [ROWS[:1], ROWS[1:]])
    check_mapped(load_examples(folder, MAPPING))


def test_dataset_dict_folder_asks_for_a_split(tmp_path):
    (tmp_path / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(
        ValueError, match=r"DatasetDict.*train.*test.*point the source at one split"
    ):
        read_rows(tmp_path)


def test_default_mapping_reads_prompt_and_answer(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q?", "answer": 3}])
    (example,) = load_examples(path)
    assert (example.prompt, example.columns) == ("Q?", {"answer": 3})


def test_missing_column_error_names_file_column_present_columns_and_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError) as info:
        load_examples(path)
    message = str(info.value)
    assert str(path) in message
    assert "'prompt'" in message
    assert "['answer', 'level', 'question', 'solution']" in message
    assert "columns" in message


def test_mapping_that_would_overwrite_a_column_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"existing columns \['answer'\]"):
        load_examples(path, {"prompt": "question", "answer": "solution"})


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b",\n')
    with pytest.raises(ValueError, match=rf"{path}:3: invalid JSON"):
        read_rows(path)


def test_non_object_jsonl_line_is_rejected(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=rf"{path}:1: expected a JSON object"):
        read_rows(path)


def test_empty_prompts_are_skipped_and_counted(tmp_path):
    rows = [
        {"prompt": "", "answer": 1},
        {"prompt": None, "answer": 2},
        {"prompt": "Q", "answer": 3},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.warns(UserWarning, match="skipped 2 rows with an empty prompt"):
        examples = load_examples(path)
    assert [e.prompt for e in examples] == ["Q"]


def test_unsupported_and_missing_files(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"use \.jsonl, \.parquet"):
        read_rows(tmp_path / "d.csv")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(tmp_path / "nope.jsonl")


def test_ids_are_stable_and_content_derived(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    first, second = load_examples(path, MAPPING), load_examples(path, MAPPING)
    assert [e.prompt_id for e in first] == [e.prompt_id for e in second]
    assert first[0].prompt_id == make_prompt_id("train", "What is 1 + 1?", "2")
    assert first[0].prompt_id.startswith("train:") and len(first[0].prompt_id) == len("train:") + 12
    assert make_prompt_id("s", "ab", "c") != make_prompt_id("s", "a", "bc")


def test_holdout_split_is_disjoint_seeded_and_drops_duplicates():
    examples = [Example(f"s:{i}", f"q{i}", {}) for i in range(20)]
    train, val = holdout_split(examples, 5, seed=0)
    assert (len(train), len(val)) == (15, 5)
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in val)
    assert holdout_split(examples, 5, seed=0) == (train, val)
    # Every prompt appears twice, so each held-out row repeats a training or a held-out row
    # and is dropped rather than leaked.
    with pytest.warns(UserWarning, match="Dropped"):
        train, val = holdout_split(examples[:10] * 2, 5, seed=1)
    assert len(val) < 5
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in val)


def test_holdout_split_needs_training_rows():
    with pytest.raises(ValueError, match="leaves no training examples"):
        holdout_split([Example("s:0", "q", {})], 1, seed=0)
