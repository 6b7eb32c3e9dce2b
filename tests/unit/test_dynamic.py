from __future__ import annotations

import dataclasses

import torch

from rlvr_lightning.stages.dynamic import (
    concat_prompt_batches,
    concat_rollouts,
    concat_scored,
    keep_first,
    prompts_to_draw,
    refill,
)
from rlvr_lightning.types import PromptBatch, Rollouts, Scored

PAD = 0
G = 2


def prompts(ids: list[str], **columns) -> PromptBatch:
    return PromptBatch(ids, [[{"role": "user", "content": i}] for i in ids], columns=columns)


def rollouts(n_prompts: int, p: int, t: int, start: int = 1) -> Rollouts:
    n = n_prompts * G
    ids = torch.arange(start, start + n * t).view(n, t)
    return Rollouts(
        prompt_ids=torch.full((n, p), 7), prompt_mask=torch.ones(n, p, dtype=torch.long),
        completion_ids=ids, completion_mask=torch.ones(n, t, dtype=torch.long),
        behaviour_logp=-torch.ones(n, t), temperature=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool), completions=[f"c{i}" for i in range(n)],
        group_size=G,
    )  # fmt: skip


def scored(r: Rollouts, rewards: list[float]) -> Scored:
    rw = torch.tensor(rewards)
    return Scored(r, rw, {"acc": rw.clone()}, rw > 0.5, {"reward/failures": 0.0})


def test_concat_prompt_batches_fills_missing_columns():
    a, b = prompts(["a"], answer=["1"]), prompts(["b"], solution=["s"])
    c = concat_prompt_batches(a, b)
    assert c.prompt_ids == ["a", "b"]
    assert c.columns == {"answer": ["1", None], "solution": [None, "s"]}


def test_concat_rollouts_repads_left_prompts_and_right_completions():
    a, b = rollouts(1, p=2, t=3), rollouts(1, p=4, t=1, start=100)
    c = concat_rollouts(a, b, PAD)
    assert c.prompt_ids.shape == (4, 4) and c.completion_ids.shape == (4, 3)
    assert c.prompt_mask[:2].tolist() == [[0, 0, 1, 1]] * 2  # a's prompts padded on the left
    assert c.completion_ids[2].tolist() == [100, PAD, PAD]  # b's completion padded on the right
    assert c.completion_mask[2].tolist() == [1, 0, 0]
    assert c.behaviour_logp[2].tolist() == [-1.0, 0.0, 0.0]
    assert c.completions == ["c0", "c1", "c0", "c1"] and c.group_size == G


def test_concat_scored_keeps_rows_aligned():
    a = scored(rollouts(1, 2, 2), [1.0, 0.0])
    b = scored(rollouts(1, 2, 2), [0.0, 0.0])
    c = concat_scored(a, b, PAD)
    assert c.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert c.correct.tolist() == [True, False, False, False]
    assert c.per_function["acc"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert c.baseline_mask is None and c.advantage_cap is None


def test_concat_scored_carries_what_hooks_set_on_either_side():
    # Round a: a hook injected into row 1 (now correct, out of the baseline, capped at 0.5).
    a = dataclasses.replace(
        scored(rollouts(1, 2, 2), [1.0, 0.0]),
        correct=torch.tensor([True, True]),
        baseline_mask=torch.tensor([True, False]),
        advantage_cap=torch.tensor([float("inf"), 0.5]),
        sampled_correct=torch.tensor([True, False]),
        sampled_rewards=torch.tensor([1.0, 0.0]),
    )
    b = scored(rollouts(1, 2, 2), [0.0, 1.0])  # round b: untouched, no snapshot set
    c = concat_scored(a, b, PAD)
    assert c.baseline_mask.tolist() == [True, False, True, True]
    assert c.advantage_cap.tolist() == [float("inf"), 0.5, float("inf"), float("inf")]
    assert c.sampled_correct.tolist() == [True, False, False, True]
    assert c.sampled_rewards.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_keep_first_truncates_to_the_target():
    mask = torch.tensor([True, False, True, True, True])
    assert keep_first(mask, 2).tolist() == [True, False, True, False, False]


def test_prompts_to_draw():
    assert prompts_to_draw(missing=2, informative_rate=0.5, cap=8) == 4  # ceil(2 / 0.5)
    assert prompts_to_draw(missing=3, informative_rate=0.0, cap=8) == 8  # rate floored at 1/8
    assert prompts_to_draw(missing=1, informative_rate=1.0, cap=8) == 1


def _informative(batch: PromptBatch, s: Scored) -> torch.Tensor:
    return s.rewards.view(-1, G).var(1) > 0


def test_refill_runs_rounds_until_enough_groups_are_informative():
    pool = iter(["x", "y", "z", "w", "v", "u"])
    drawn: list[int] = []

    def draw(n: int, exclude: list[str]) -> PromptBatch:
        drawn.append(n)
        return prompts([next(pool) for _ in range(n)])

    def generate(batch: PromptBatch) -> Scored:  # x and z informative, the rest not
        rewards = [
            v for pid in batch.prompt_ids for v in ((1.0, 0.0) if pid in "xz" else (1.0, 1.0))
        ]
        return scored(rollouts(len(batch), 2, 2), rewards)

    start = scored(rollouts(2, 2, 2), [1.0, 0.0, 0.0, 0.0])  # a informative, b not
    result = refill(prompts(["a", "b"]), start, _informative, draw, generate, 3, PAD)
    # Round 1: 1 missing at rate 1/2 -> 2 prompts (x, y) -> 2 informative, done.
    assert drawn == [2]
    assert result.batch.prompt_ids == ["a", "b", "x", "y"]
    assert result.metrics["dynamic/rounds"] == 1.0
    assert result.metrics["dynamic/shortfall"] == 0.0


def test_refill_stops_at_the_round_cap_and_reports_the_shortfall():
    pool = iter(f"p{i}" for i in range(100))

    def draw(n: int, exclude: list[str]) -> PromptBatch:
        return prompts([next(pool) for _ in range(n)])

    def generate(batch: PromptBatch) -> Scored:
        return scored(rollouts(len(batch), 2, 2), [0.0] * (len(batch) * G))

    start = scored(rollouts(2, 2, 2), [0.0] * 4)
    result = refill(prompts(["a", "b"]), start, _informative, draw, generate, 2, PAD)
    assert result.metrics["dynamic/rounds"] == 2.0
    assert result.metrics["dynamic/shortfall"] == 2.0
    assert len(result.batch) == 2 + 2 + 2  # each round draws the cap (2)


def test_concat_keeps_position_temperatures():
    a, b = rollouts(1, p=2, t=3), rollouts(1, p=2, t=2, start=100)
    a = dataclasses.replace(a, position_temperature=torch.tensor([[1.0, 0.5, 0.25]] * G))
    c = concat_rollouts(a, b, PAD)
    # b had none: its rows' own temperature (1.0) at every position, padding 1.0.
    assert c.position_temperature.tolist() == [[1.0, 0.5, 0.25]] * G + [[1.0, 1.0, 1.0]] * G
    assert concat_rollouts(b, b, PAD).position_temperature is None
    f = torch.tensor([1.0, 0.5])
    batch = concat_prompt_batches(
        prompts(["a"]), dataclasses.replace(prompts(["b"]), position_temperatures=f)
    )
    assert batch.position_temperatures is f
