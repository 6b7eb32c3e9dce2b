"""The prompt plumbing the guidance callbacks share: pooled prompts and joined batches."""

from __future__ import annotations

from rlvr_lightning.callbacks._guidance import join_batches, pooled_batch, pooled_prompt

from rlvr_lightning.types import PromptBatch


def _batch(ids: list[str], columns: dict[str, list[object]]) -> PromptBatch:
    messages = [[{"role": "user", "content": f"q-{i}"}] for i in ids]
    return PromptBatch(prompt_ids=ids, messages=messages, columns=columns)


def test_a_pooled_prompt_comes_back_as_the_same_batch_row():
    batch = _batch(["a", "b"], {"answer": ["1", "2"], "level": [3, 4]})
    pooled = pooled_prompt(batch, 1)
    assert pooled == {
        "messages": [{"role": "user", "content": "q-b"}],
        "columns": {"answer": "2", "level": 4},
    }
    back = pooled_batch(["b"], [pooled])
    assert back.prompt_ids == ["b"] and back.messages == [batch.messages[1]]
    assert back.columns == {"answer": ["2"], "level": [4]}


def test_pooled_prompts_missing_a_column_get_none_there():
    prompts = [{"messages": [], "columns": {"answer": "1"}}, {"messages": [], "columns": {"s": 2}}]
    assert pooled_batch(["x", "y"], prompts).columns == {"answer": ["1", None], "s": [None, 2]}


def test_joined_batches_keep_order_and_fill_columns_either_side_lacks():
    head = _batch(["a", "b"], {"answer": ["1", "2"]})
    tail = _batch(["c"], {"answer": ["3"], "solution": ["s3"]})
    joined = join_batches(head, tail)
    assert joined.prompt_ids == ["a", "b", "c"]
    assert joined.messages == [*head.messages, *tail.messages]
    # head's columns first, then those only tail has; None where a side has no such column
    assert list(joined.columns) == ["answer", "solution"]
    assert joined.columns == {"answer": ["1", "2", "3"], "solution": [None, None, "s3"]}
