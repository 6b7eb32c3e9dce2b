from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.mixture import SourceSpec, apply_answer_format, resample, weighted_counts
from rlvr_lightning.data.prompt_limit import drop_long_prompts
from rlvr_lightning.data.sources import Example
from rlvr_lightning.data.tasks import multiplication_examples


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def ex(prompt: str, **columns) -> Example:
    return Example(f"t:{prompt}", prompt, columns)


def test_gsm8k_answers_come_after_the_hashes():
    rows = [ex("q", answer="3 + 4 = 7 apples, times 1,000\n#### 7,000")]
    (out,) = apply_answer_format(rows, "gsm8k", "gsm8k.jsonl")
    assert out.columns["answer"] == "7000"
    assert out.columns["solution"].startswith("3 + 4")


def test_math_answers_come_from_the_last_box_of_the_solution():
    rows = [ex("q", solution=r"First \boxed{1}, finally $\boxed{\frac{1}{2}}$.")]
    (out,) = apply_answer_format(rows, "boxed", "math.jsonl")
    assert out.columns["answer"] == r"\frac{1}{2}"


@pytest.mark.parametrize(
    ("fmt", "columns", "match"),
    [
        ("gsm8k", {"answer": "no hashes here"}, r"1 rows have no '#### <answer>' line"),
        ("boxed", {"solution": "no box"}, r"1 rows have no \\boxed\{\} answer"),
    ],
)
def test_malformed_rows_raise_with_a_fix(fmt, columns, match):
    with pytest.raises(ValueError, match=match):
        apply_answer_format([ex("q", **columns)], fmt, "data.jsonl")


def test_long_prompts_are_skipped_with_a_count():
    rows = [ex("short"), ex("a much longer prompt"), ex("tiny")]
    with pytest.warns(UserWarning, match="Skipped 1 of 3 training prompts longer than"):
        kept = drop_long_prompts(rows, len, 10, "training")
    assert [e.prompt for e in kept] == ["short", "tiny"]


def test_weighted_counts_and_resample():
    assert weighted_counts(10, [3, 1]) == [8, 2]  # 7.5 -> 8 (largest remainder), 2.5 -> 2
    assert sum(weighted_counts(7, [1, 1, 1])) == 7
    with pytest.raises(ValueError, match="weights must all be > 0"):
        weighted_counts(5, [1, 0])
    rows = [ex(str(i)) for i in range(3)]
    out = resample(rows, 7, random.Random(0))  # 2 full copies + 1 sampled
    assert Counter(e.prompt for e in out).most_common(1)[0][1] == 3 and len(out) == 7


def test_mixture_of_a_task_and_a_file_follows_the_weights(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm.jsonl",
        [{"question": f"q{i}", "answer": f"work\n#### {i}"} for i in range(20)],
    )
    dm = RLVRDataModule(
        source=[
            SourceSpec("addition", weight=3.0),
            SourceSpec(path, weight=1.0, columns={"prompt": "question"}, answer_format="gsm8k"),
        ],
        train_size=40,
        val_size=8,
    )
    dm.setup("fit")
    tasks = Counter(e.columns.get("task", "file") for e in dm.train_examples)
    # 40 addition + 18 file rows (2 held out) = 58 -> 3:1 -> 43.5/14.5 -> 44 / 14 (ties: first).
    assert tasks["addition"] + tasks["file"] == 58
    assert abs(tasks["addition"] / 58 - 0.75) < 0.02
    assert len(dm.val_examples) == 8
    assert {e.columns["answer"] for e in dm.train_examples if "task" not in e.columns} <= {
        str(i) for i in range(20)
    }


def test_mixture_entries_own_their_settings():
    with pytest.raises(ValueError, match="give task_config/columns inside each entry"):
        RLVRDataModule(source=[SourceSpec("addition")], task_config={"digits": 2})


def test_multiplication_task():
    train, val = multiplication_examples(1, train_size=30, val_size=5, seed=0)
    assert len(train) == 30 and len(val) == 5
    a, b = train[0].prompt.removeprefix("What is ").rstrip("?").split(" * ")
    assert train[0].columns["answer"] == str(int(a) * int(b))
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    dm = RLVRDataModule(source="multiplication", task_config={"digits": 2}, train_size=20)
    dm.setup("fit")
    assert len(dm.train_examples) == 20


def test_max_prompt_tokens_uses_the_tokenizer():
    dm = RLVRDataModule(max_prompt_tokens=1, train_size=20, val_size=5)
    with pytest.raises(ValueError, match="max_prompt_tokens needs a tokenizer"):
        dm.setup("fit")
    from rlvr_lightning.testing import byte_tokenizer

    dm = RLVRDataModule(max_prompt_tokens=15, task_config={"digits": 2}, train_size=100, val_size=0)
    dm.tokenizer = byte_tokenizer()  # one token per byte: "What is 3 + 45?" has 15
    with pytest.warns(UserWarning, match="Skipped"):
        dm.setup("fit")
    assert dm.train_examples and all(len(e.prompt) <= 15 for e in dm.train_examples)
