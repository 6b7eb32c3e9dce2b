from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlvr_lightning.data.errors import DataError
from rlvr_lightning.data.readers import read_rows
from rlvr_lightning.data.sources import Example, holdout_split, load_examples, make_prompt_id

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
    (tmp_path / "d.txt").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"use \.jsonl, \.json, \.csv, \.parquet"):
        read_rows(tmp_path / "d.txt")
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


def test_non_utf8_bytes_name_file_line_and_the_fix(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n' + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    # '{"prompt": "caf' is 15 bytes, so the latin-1 byte of the accent is byte 16 of line 3.
    where = re.escape(f"{path}:3: not valid UTF-8 (byte 0xe9, byte 16 of the line).")
    with pytest.raises(DataError, match=f"{where} Re-encode the file as UTF-8") as info:
        read_rows(path)
    assert info.value.__suppress_context__  # one short error, no chained UnicodeDecodeError


def test_lone_surrogates_are_replaced_and_counted_pairs_and_text_are_kept(tmp_path):
    path = tmp_path / "s.jsonl"
    lines = [
        r'{"prompt": "ok \ud83d\ude00"}',  # a valid pair: one emoji
        r'{"prompt": "cut \ud83d", "answer": "\udc00"}',  # two lone halves, one row
        "",
        r'{"prompt": "\\ud800 is text"}',  # an escaped backslash: plain text, not a surrogate
        r'{"\ud800key": "v"}',  # in a key
    ]
    path.write_text("\n".join(lines) + "\n")
    with pytest.warns(UserWarning, match=r"lone UTF-16 surrogates .* in 2 rows \(first: line 2\)"):
        rows = read_rows(path)
    assert rows == [
        {"prompt": "ok \U0001f600"},
        {"prompt": "cut \ufffd", "answer": "\ufffd"},
        {"prompt": "\\ud800 is text"},
        {"\ufffdkey": "v"},
    ]
    assert json.dumps(rows, ensure_ascii=False).encode("utf-8")  # every string encodes now


def test_utf8_bom_is_ignored(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "Q", "answer": 1}\n')
    assert [e.prompt for e in load_examples(path)] == ["Q"]


def test_row_errors_give_the_file_line_not_the_row_index(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n\n{"question": "b", "answer": 2}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:3: column 'prompt'")):
        load_examples(path)


@pytest.mark.parametrize(
    ("prompt", "shown"),
    [
        (42, "got int 42. To fix, make it a string in this row"),
        ({"role": "user", "content": "hi"}, "got dict {'role': 'user', 'content': 'hi'}."),
    ],
)
def test_non_text_prompt_names_line_and_the_fix(tmp_path, prompt, shown):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": prompt, "answer": 2}]
    )
    with pytest.raises(DataError, match=re.escape(f"{path}:2: the prompt column 'prompt'")) as info:
        load_examples(path)
    assert shown in str(info.value) and "columns" in str(info.value)


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_a_file_without_rows_says_so(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=re.escape(f"{path}: holds no rows. Point source at")):
        load_examples(path)


def test_an_empty_parquet_file_says_so(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    with pytest.raises(DataError, match="holds no rows"):
        load_examples(path)


def test_all_prompts_empty_says_which_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "", "answer": 1}, {"q": " ", "answer": 2}])
    with (
        pytest.warns(UserWarning, match="skipped 2 rows"),
        pytest.raises(DataError, match="all 2 rows have an empty prompt column 'q'"),
    ):
        load_examples(path, {"prompt": "q"})


def test_rows_without_an_answer_column_are_accepted(tmp_path):
    # Which columns must exist is the rewards' business, checked at fit start.
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q?", "topic": "t"}, {"prompt": "R?"}])
    examples = load_examples(path)
    assert [e.columns for e in examples] == [{"topic": "t"}, {}]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]


def test_conversational_prompts_keep_their_messages(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": CHAT, "answer": "2"}, {"prompt": "Q?"}])
    chat, text = load_examples(path)
    assert chat.messages == CHAT and text.messages is None
    # The joined contents are what de-duplication and the prompt length limit read.
    assert chat.prompt == "Be brief.\n\n1 + 1?"
    assert (
        chat.prompt_id == load_examples(path)[0].prompt_id != make_prompt_id("d", chat.prompt, "2")
    )


@pytest.mark.parametrize(
    ("prompt", "problem"),
    [
        ([{"role": "user"}], "message 0 of the prompt column 'prompt' needs a text 'role'"),
        (["hi"], "message 0 of the prompt column 'prompt' is str, not an object"),
        (
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            "message 1 of the prompt column 'prompt' has role 'assistant', not 'user'",
        ),
    ],
)
def test_malformed_messages_name_line_message_and_the_shape(tmp_path, prompt, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": prompt}])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: {problem}")) as info:
        load_examples(path)
    assert "ending with a user turn" in str(info.value)


def test_conversation_collates_with_system_prompt_and_instruction():
    from rlvr_lightning.data.prompts import collate_examples

    chat = Example("d:1", "Be brief.\n\n1 + 1?", {"answer": "2"}, CHAT)
    bare = Example("d:2", "2 + 2?", {}, [CHAT[1]])
    batch = collate_examples([chat, bare], "System.", "Box it.")
    # The row's own system turn wins; the data module's goes where there is none.
    assert batch.messages[0] == [CHAT[0], {"role": "user", "content": "1 + 1?\n\nBox it."}]
    assert batch.messages[1][0] == {"role": "system", "content": "System."}
    assert batch.columns["prompts"] == batch.messages  # conversations: the message lists
    assert CHAT[1]["content"] == "1 + 1?"  # the example itself is unchanged
    text = collate_examples([Example("d:3", "3 + 3?", {})], "System.", "Box it.")
    assert text.columns["prompts"] == ["3 + 3?\n\nBox it."]  # text prompts: the user turn
