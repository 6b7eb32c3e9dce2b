from __future__ import annotations

import pytest

from rlvr_lightning.data.tasks import (
    GYM_VAL_SEED_OFFSET,
    addition_examples,
    extract_final_answer,
    gym_examples,
    gym_verifier,
    task_examples,
    validate_task,
)

# Two one-digit terms give at most 10 * 10 * 2 (sign) questions, so a 150-problem train split
# and a different-seed validation split are bound to collide unless duplicates are dropped.
SMALL_CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


@pytest.fixture(scope="module")
def chain_sum_splits():
    return gym_examples("chain_sum", SMALL_CHAIN_SUM, train_size=150, val_size=20, seed=3)


def test_addition_one_digit_splits_are_disjoint_and_cover_the_100_pairs():
    train, val = addition_examples(1, train_size=1000, val_size=30, seed=0)
    # 100 pairs exist; 30 are held out, so train gets the other 70, not 1000.
    assert (len(train), len(val)) == (70, 30)
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    assert len({e.prompt for e in train + val}) == 100


def test_addition_problem_text_and_answer():
    train, _ = addition_examples(1, train_size=5, val_size=0, seed=1)
    for example in train:
        a, b = (int(x) for x in example.prompt.removeprefix("What is ").rstrip("?").split(" + "))
        solution = f"{a} + {b} = {a + b}, so the answer is \\boxed{{{a + b}}}."
        assert example.columns == {"answer": str(a + b), "solution": solution, "task": "addition"}


def test_addition_two_digits_samples_without_replacement():
    train, val = addition_examples(2, train_size=500, val_size=50, seed=0)
    prompts = [e.prompt for e in train + val]
    assert (len(train), len(val)) == (500, 50)
    assert len(set(prompts)) == 550


def test_addition_ids_are_stable_and_seed_dependent():
    first = addition_examples(1, train_size=10, val_size=10, seed=4)
    second = addition_examples(1, train_size=10, val_size=10, seed=4)
    other = addition_examples(1, train_size=10, val_size=10, seed=5)
    assert [e.prompt_id for e in first[0]] == [e.prompt_id for e in second[0]]
    assert [e.prompt_id for e in first[0]] != [e.prompt_id for e in other[0]]
    assert first[0][0].prompt_id.startswith("addition:")


def test_addition_rejects_val_size_that_leaves_no_training_problem():
    with pytest.raises(ValueError, match="val_size=100 leaves no training problems"):
        addition_examples(1, train_size=10, val_size=100, seed=0)


def test_unknown_task_lists_valid_sources():
    with pytest.raises(ValueError, match=r"Unknown task 'additon'.*addition.*gym:<name>"):
        validate_task("additon", None)


def test_addition_config_is_checked():
    keys = r"Unknown task_config keys \['digit'\].*\['digits', 'question_forms'\]"
    with pytest.raises(ValueError, match=keys):
        validate_task("addition", {"digit": 2})
    with pytest.raises(ValueError, match="digits must be an int"):
        validate_task("addition", {"digits": 0})


def test_gym_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"Unknown reasoning-gym task 'chainsum'.*chain_sum"):
        validate_task("gym:chainsum", None)
    with pytest.raises(ValueError, match=r"must not set.*seed"):
        validate_task("gym:chain_sum", {"seed": 1})
    with pytest.raises(ValueError, match=r"Unknown task_config keys \['terms'\].*min_terms"):
        validate_task("gym:chain_sum", {"terms": 2})
    with pytest.raises(ValueError, match="Invalid task_config"):
        validate_task("gym:chain_sum", {"min_terms": 5, "max_terms": 2})


def test_gym_splits_are_disjoint(chain_sum_splits):
    import reasoning_gym

    train, val = chain_sum_splits
    # The raw validation-seed draw does collide with train, so disjointness is the filter's work.
    raw = reasoning_gym.create_dataset(
        "chain_sum", size=20, seed=3 + GYM_VAL_SEED_OFFSET, **SMALL_CHAIN_SUM
    )
    assert {e["question"] for e in raw} & {e.prompt for e in train}
    assert len(train) == 150
    assert len(val) == 20
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    assert len({e.prompt for e in val}) == 20


def test_gym_columns_carry_the_entry(chain_sum_splits):
    example = chain_sum_splits[0][0]
    entry = example.columns["gym_entry"]
    assert example.prompt == entry["question"]
    assert example.columns["answer"] == entry["answer"]
    assert example.columns["task"] == "chain_sum"
    assert example.prompt_id.startswith("gym:chain_sum:")


def test_gym_ids_are_stable():
    first, _ = task_examples("gym:chain_sum", SMALL_CHAIN_SUM, 10, 0, seed=7)
    second, _ = task_examples("gym:chain_sum", SMALL_CHAIN_SUM, 10, 0, seed=7)
    assert [e.prompt_id for e in first] == [e.prompt_id for e in second]


def test_gym_verifier_scores_boxed_answers(chain_sum_splits):
    entry = chain_sum_splits[0][0].columns["gym_entry"]
    wrong = str(int(entry["answer"]) + 1)
    completions = [
        f"The sum is \\boxed{{{entry['answer']}}}.",
        f"The sum is \\boxed{{{wrong}}}.",
        f"<answer>{entry['answer']}</answer>",
        "no answer",
    ]
    scores = gym_verifier(completions, [entry, entry, entry, None])
    assert scores == [1.0, 0.0, 1.0, None]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("first \\boxed{1} then \\boxed{ 2 }", "2"),
        ("<answer>3</answer> and <answer> 4 </answer>", "4"),
        ("work\n\n  5  \n", "5"),
        ("", None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


def test_question_forms_vary_training_and_leave_validation_alone():
    forms = ["Find {a} + {b}.", "How much is {a} plus {b}?"]
    train, val = addition_examples(1, forms, train_size=40, val_size=20, seed=3)
    plain_train, plain_val = addition_examples(1, train_size=40, val_size=20, seed=3)
    assert [e.prompt for e in val] == [e.prompt for e in plain_val]  # "What is a + b?"
    assert {e.prompt.split(" ")[0] for e in train} == {"Find", "How"}  # both forms drawn
    for e, plain in zip(train, plain_train, strict=True):  # same sums, answers, solutions
        assert e.columns == plain.columns
        a, b = plain.prompt.removeprefix("What is ").removesuffix("?").split(" + ")
        assert e.prompt in (forms[0].format(a=a, b=b), forms[1].format(a=a, b=b))
    again, _ = addition_examples(1, forms, train_size=40, val_size=20, seed=3)
    assert [e.prompt for e in again] == [e.prompt for e in train]


def test_question_forms_of_the_paraphrased_split_or_without_operands_are_refused():
    with pytest.raises(ValueError, match=r"'Add \{a\} and \{b\}\.' is a question form of the para"):
        validate_task("addition", {"question_forms": ["Find {a} + {b}.", "Add {a} and {b}."]})
    with pytest.raises(ValueError, match="is a question form of the paraphrased"):
        validate_task("multiplication", {"question_forms": ["Compute {a} {op} {b}."]})
    with pytest.raises(ValueError, match=r"templates with \{a\} and \{b\}"):
        validate_task("addition", {"question_forms": ["What is a + b?"]})
    with pytest.raises(ValueError, match="non-empty list"):
        validate_task("addition", {"question_forms": []})
