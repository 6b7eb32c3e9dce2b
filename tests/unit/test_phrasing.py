"""The paraphrased validation split and varied training instructions (``data/phrasing.py``)."""

from pathlib import Path

import pytest
import yaml

from rlvr_lightning.data import RLVRDataModule, addition_examples, multiplication_examples
from rlvr_lightning.data.phrasing import (
    QUESTION_FORMS,
    VAL_INSTRUCTIONS,
    instruction_texts,
    paraphrased_examples,
    pick_instructions,
)

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def _quickstart_data(**overrides: object) -> RLVRDataModule:
    init_args = yaml.safe_load(QUICKSTART.read_text())["data"]["init_args"]
    data = RLVRDataModule(**{**init_args, **overrides})
    data.setup("fit")
    return data


def test_each_validation_sum_is_asked_again_with_the_same_answer():
    _, val = addition_examples(train_size=10, val_size=50, seed=3)
    split = paraphrased_examples(val, seed=0)
    assert [e.columns["answer"] for e in split] == [e.columns["answer"] for e in val]
    assert {e.columns["task"] for e in split} == {"addition-paraphrased"}
    # 4 question forms x 6 instructions = 24 pairs, each used at least twice in 50 prompts.
    for form in QUESTION_FORMS["+"]:
        head = form.split("{a}")[0] or form.split("{b}")[1]
        assert sum(head in e.prompt for e in split) >= 12, form
    for text in instruction_texts():
        assert sum(text in e.prompt for e in split) >= 8, text
    assert not any(e.prompt.startswith("What is ") and "sum" not in e.prompt for e in split)


def test_the_split_is_seeded():
    _, val = multiplication_examples(train_size=10, val_size=30, seed=0)
    first, again = paraphrased_examples(val, seed=1), paraphrased_examples(val, seed=1)
    assert [e.prompt for e in first] == [e.prompt for e in again]
    assert [e.prompt for e in first] != [e.prompt for e in paraphrased_examples(val, seed=2)]
    assert all("*" in e.prompt or "ultipl" in e.prompt or "product" in e.prompt for e in first)


def test_some_instructions_show_an_example_and_some_come_first():
    with_example = [t for t in VAL_INSTRUCTIONS if t.count("boxed") > 1]
    first = [t for t in VAL_INSTRUCTIONS if not t.startswith("{q}")]
    assert 0 < len(with_example) < len(VAL_INSTRUCTIONS) and first


def test_its_phrasings_never_appear_in_training_prompts():
    data = _quickstart_data()
    training = []
    for _ in range(40):  # 40 steps x 8 prompts: every training instruction many times over
        batch = data.compose_step()
        training += batch.columns["prompts"]
        data.composer.steps += 1  # what on_step_output counts; the draw changes per step
    assert len(set(training)) > 100
    for example in data.paraphrased_examples:
        question = next(
            form.format(a=a, b=b)
            for form in QUESTION_FORMS["+"]
            for a in range(10)
            for b in range(10)
            if form.format(a=a, b=b) in example.prompt
        )
        assert not any(question in text for text in training), question
    for text in instruction_texts():
        assert not any(text in prompt for prompt in training), text


def test_training_draws_among_the_instructions_and_validation_uses_the_first():
    data = _quickstart_data()
    instructions = data.instructions
    assert len(instructions) > 1
    seen = set()
    for step in range(20):
        data.composer.steps = step
        for prompt in data.compose_step().columns["prompts"]:
            seen.add(next(text for text in instructions if prompt.endswith(text)))
    assert seen == set(instructions)
    val = next(iter(data.val_dataloader()[0]))
    assert all(p.endswith(instructions[0]) for p in val.columns["prompts"])
    paraphrased = next(iter(data.val_dataloader()[1]))
    assert not any(text in p for p in paraphrased.columns["prompts"] for text in instructions)


def test_pick_instructions_is_the_same_in_every_run_and_varies_by_step():
    _, val = addition_examples(train_size=10, val_size=20, seed=0)
    texts = ["a", "b", "c"]
    assert pick_instructions(val, texts, 0, 5) == pick_instructions(val, texts, 0, 5)
    assert pick_instructions(val, texts, 0, 5) != pick_instructions(val, texts, 0, 6)


def test_split_is_off_for_other_sources_and_when_asked(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(20)))
    assert RLVRDataModule(source=str(path), val_size=4).val_split_names == [""]
    data = RLVRDataModule(source=str(path), val_size=4)
    data.setup("validate")
    assert data.val_split_names == [""] and data.paraphrased_examples == []
    off = RLVRDataModule(val_size=4, paraphrased_val=False)
    off.setup("validate")
    assert off.val_split_names == [""]
    on = RLVRDataModule(val_size=4)
    on.setup("validate")
    assert on.val_split_names == ["", "paraphrased"] and len(on.paraphrased_examples) == 4


def test_asking_for_it_without_arithmetic_validation_says_how_to_fix(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": "{i}"}}\n' for i in range(20)))
    data = RLVRDataModule(source=str(path), val_size=4, paraphrased_val=True)
    with pytest.raises(ValueError, match="paraphrased_val: false"):
        data.setup("validate")


def test_an_empty_instruction_list_is_refused():
    with pytest.raises(ValueError, match="non-empty list"):
        RLVRDataModule(instruction=[])


def test_a_training_instruction_from_the_split_is_refused_at_the_command_line(capsys):
    from rlvr_lightning.cli.main import main

    config = str(QUICKSTART.parent / "tiny.yaml")
    reserved = instruction_texts()[0]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", config, f"--data.init_args.instruction={reserved}"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "paraphrased validation phrasings" in err and "paraphrased_val: false" in err
    assert "Traceback" not in err
