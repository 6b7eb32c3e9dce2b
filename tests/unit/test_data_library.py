"""Sources read through the `datasets` library: repository folders with splits and configs,
CSV/JSON files, streaming with a row limit, Hub ids and their offline errors."""

import json

import pytest

from rlvr_lightning.data.errors import DataError
from rlvr_lightning.data.library import LoadOptions, has_splits, is_hub_id, uses_library
from rlvr_lightning.data.mixture import SourceSpec, check_load_options, source_splits
from rlvr_lightning.data.sources import load_examples


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def repo(tmp_path):
    """A folder laid out like a Hub dataset repo: two configs, each with train and test."""
    root = tmp_path / "sums"
    for config in ("easy", "hard"):
        for split, n in (("train", 6), ("test", 3)):
            rows = [{"question": f"{config} {split} {i}", "answer": str(i)} for i in range(n)]
            _jsonl(root / config / f"{split}.jsonl", rows)
    (root / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: easy\n  data_files:\n  - split: train\n    path: easy/train.jsonl\n"
        "  - split: test\n    path: easy/test.jsonl\n"
        "- config_name: hard\n  data_files:\n  - split: train\n    path: hard/train.jsonl\n"
        "  - split: test\n    path: hard/test.jsonl\n---\n"
    )
    return root


def test_a_repository_folder_reads_the_chosen_config_and_split(repo):
    columns = {"prompt": "question"}
    test = load_examples(repo, columns, LoadOptions(config="hard", split="test"))
    assert [e.prompt for e in test] == ["hard test 0", "hard test 1", "hard test 2"]
    assert test[0].columns["answer"] == "0"
    train = load_examples(repo, columns, LoadOptions(config="easy"))
    assert len(train) == 6 and train[0].prompt == "easy train 0"


def test_streaming_reads_only_the_first_rows(repo):
    spec = SourceSpec(str(repo), columns={"prompt": "question"}, config="easy", streaming=True)
    train, val = source_splits(spec, train_size=3, val_size=1, seed=0)
    # streaming without max_rows reads train_size + val_size = 4 rows, then holds one out.
    assert len(train) == 3 and len(val) == 1
    assert {e.prompt for e in train + val} == {f"easy train {i}" for i in range(4)}


def test_an_unknown_split_names_the_splits_there_are(repo):
    with pytest.raises(DataError, match=r"split 'validation'.*\n.*Fix the split") as err:
        load_examples(repo, {"prompt": "question"}, LoadOptions(config="easy", split="validation"))
    assert "test" in str(err.value) and "train" in str(err.value)


def test_csv_and_json_files(tmp_path):
    (tmp_path / "d.csv").write_text("prompt,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "What is 3 + 3?", "answer": 6}]))
    csv = load_examples(tmp_path / "d.csv")
    assert [e.prompt for e in csv] == ["What is 1 + 1?", "What is 2 + 2?"]
    assert str(csv[1].columns["answer"]) == "4"
    assert load_examples(tmp_path / "d.json")[0].columns["answer"] == 6


def test_what_the_library_reads():
    assert is_hub_id("openai/gsm8k") and not is_hub_id("addition") and not is_hub_id("a/b/c")
    assert uses_library("openai/gsm8k") and uses_library("x.csv") and not uses_library("x.jsonl")
    assert has_splits("openai/gsm8k") and not has_splits("x.csv")


def test_a_hub_id_offline_says_how_to_work_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        load_examples("nobody-here/no-such-dataset", None, LoadOptions(split="train"))
    text = str(err.value)
    assert text.startswith("Could not load dataset 'nobody-here/no-such-dataset' (split 'train')")
    assert "HF_DATASETS_OFFLINE=1" in text and "set source to that path" in text
    assert len(text.splitlines()) == 2


def test_hub_options_reach_load_dataset(monkeypatch):
    import datasets

    seen = {}

    def fake_load_dataset(path, **kwargs):
        seen.update(path=path, **kwargs)
        return [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "p", "answer": "1"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    options = LoadOptions(config="main", split="test", revision="abc123", max_rows=1)
    examples = load_examples("openai/gsm8k", None, options)
    assert seen == {
        "path": "openai/gsm8k",
        "name": "main",
        "split": "test",
        "revision": "abc123",
        "streaming": False,
    }
    assert [e.prompt for e in examples] == ["What is 1 + 1?"]  # max_rows
    assert examples[0].prompt_id.startswith("gsm8k:")


def test_dataset_options_on_a_task_are_an_error():
    with pytest.raises(ValueError, match=r"\['config', 'split'\].*procedural task"):
        check_load_options(SourceSpec("addition", config="main", split="test"))
