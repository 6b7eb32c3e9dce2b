"""Injected members: baselines, caps, row replacement, slot choice, the experience pool."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from rlvr_lightning.callbacks._guidance import align_reference, reference_text

from rlvr_lightning.algorithms.advantages import (
    group_advantages,
    masked_group_advantages,
    max_member_advantage,
)
from rlvr_lightning.algorithms.offpolicy import (
    finish_source_metrics,
    guidance_slots,
    mixed_advantages,
    source_loss_terms,
)
from rlvr_lightning.guidance.experience import ExperiencePool, Trajectory, bucket_probabilities
from rlvr_lightning.stages.offpolicy import Member, replace_rows, select_rows
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import Rollouts, Scored


def _rollouts(n: int = 4, t: int = 3, g: int = 4) -> Rollouts:
    return Rollouts(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.full((n, t), 7),
        completion_mask=torch.ones(n, t, dtype=torch.long),
        behaviour_logp=torch.full((n, t), -0.5),
        temperature=torch.full((n,), 0.7),
        truncated=torch.zeros(n, dtype=torch.bool),
        completions=["x"] * n,
        group_size=g,
    )


# --- advantages ----------------------------------------------------------------------------


def test_on_policy_baseline_by_hand():
    # G = 4, last member injected. Baseline = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3).
    # GRPO: (r - 1/3) / 0.57735 = [1.1547, -0.5774, -0.5774, 1.1547]; Dr. GRPO: r - 1/3.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    base = torch.tensor([True, True, True, False])
    grpo = masked_group_advantages(rewards, 4, base)
    assert torch.allclose(grpo, torch.tensor([1.1547, -0.57735, -0.57735, 1.1547]), atol=1e-4)
    dr = masked_group_advantages(rewards, 4, base, normalize_std=False)
    assert torch.allclose(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 2 / 3]))


def test_full_baseline_equals_group_advantages_and_small_baselines():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 0.0, 1.0])
    full = masked_group_advantages(rewards, 3, torch.ones(6, dtype=torch.bool))
    assert torch.allclose(full, group_advantages(rewards, 3))
    # One baseline row: centred, not divided ([0, 1] -> [0, 1]); none: all 0.
    two = masked_group_advantages(
        torch.tensor([0.0, 1.0, 1.0, 0.0]), 2, torch.tensor([True, False, False, False])
    )
    assert torch.equal(two, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_max_member_advantage():
    # n = 4, one success: rewards [1, 0, 0, 0], mean 0.25, unbiased std 0.5 -> 0.75 / 0.5 = 1.5
    # = (n - 1) / sqrt(n); gap 0 -> 0. Dr. GRPO with gap 2: 2 * 3 / 4 = 1.5.
    assert torch.allclose(max_member_advantage(4, torch.tensor([1.0, 0.0])), torch.tensor([1.5, 0]))
    got = max_member_advantage(4, torch.tensor([2.0]), normalize_std=False)
    assert torch.allclose(got, torch.tensor([1.5]))
    assert group_advantages(torch.tensor([1.0, 0, 0, 0]), 4)[0].item() == pytest.approx(1.5, 1e-4)


def _scored(rewards, offpolicy_rows, **kw) -> Scored:
    ro = _rollouts(len(rewards))
    off = torch.zeros_like(ro.completion_mask)
    off[offpolicy_rows] = 1
    tags = tuple("reference" if i in offpolicy_rows else "policy" for i in range(len(rewards)))
    ro = Rollouts(**{**ro.__dict__, "offpolicy_mask": off, "sources": tags})
    r = torch.tensor(rewards)
    return Scored(ro, r, {}, r > 0, **kw)


def test_mixed_advantages_baseline_options_and_cap():
    scored = _scored([1.0, 0.0, 0.0, 1.0], [3])
    mixed = mixed_advantages(scored, "grpo", "mixed")
    assert torch.allclose(mixed, group_advantages(scored.rewards, 4))
    on = mixed_advantages(scored, "grpo", "on_policy")
    assert torch.allclose(on, torch.tensor([1.1547, -0.57735, -0.57735, 1.1547]), atol=1e-4)
    capped = _scored(
        [0.0, 0.0, 0.0, 1.0],
        [3],
        baseline_mask=torch.tensor([True, True, True, False]),
        advantage_cap=torch.tensor([float("inf")] * 3 + [1.5]),
    )
    # Baseline all 0 (std 0): the reference's raw advantage is 1 / 1e-6, capped to 1.5.
    assert torch.allclose(mixed_advantages(capped, "grpo", "mixed"), torch.tensor([0, 0, 0, 1.5]))
    with pytest.raises(ValueError, match="grpo or dr_grpo"):
        mixed_advantages(scored, "rloo", "on_policy")


# --- rows ----------------------------------------------------------------------------------


def test_replace_rows_grows_width_and_marks_tokens():
    ro = replace_rows(
        _rollouts(),
        rows=[1, 3],
        token_ids=[[4, 5, 6, 2, 2], [9, 2]],
        behaviour_logp=[None, [-0.1, -0.2]],
        sources=["reference", "experience"],
        temperatures=[1.0, 0.6],
        texts=["ref", "exp"],
        pad_id=0,
    )
    assert ro.completion_ids.shape == (4, 5)
    assert ro.completion_ids[1].tolist() == [4, 5, 6, 2, 2]
    assert ro.completion_ids[3].tolist() == [9, 2, 0, 0, 0]
    assert ro.completion_mask[0].tolist() == [1, 1, 1, 0, 0]  # untouched row, padded
    assert ro.offpolicy_mask.tolist() == [[0] * 5, [1] * 5, [0] * 5, [1, 1, 0, 0, 0]]
    assert ro.behaviour_logp[1].tolist() == [0.0] * 5  # unknown behaviour: probability 1
    assert torch.allclose(ro.behaviour_logp[3, :2], torch.tensor([-0.1, -0.2]))
    assert ro.sources == ("policy", "reference", "policy", "experience")
    assert ro.temperature.tolist() == pytest.approx([0.7, 1.0, 0.7, 0.6])
    assert ro.completions == ["x", "ref", "x", "exp"]


def test_member_validation():
    with pytest.raises(ValueError, match="exactly one"):
        Member(row=0, source="reference")
    with pytest.raises(ValueError, match="source tag"):
        Member(row=0, source="policy", text="a")
    with pytest.raises(ValueError, match="same length"):
        Member(row=0, source="experience", token_ids=[1, 2], behaviour_logp=[0.0])


def test_replace_last_slots_prefer_incorrect_from_the_end():
    correct = [False, True, False, True]
    on = [True, True, True, True]
    assert guidance_slots(correct, on, 1, "replace_last") == [2]
    assert guidance_slots(correct, on, 3, "replace_last") == [2, 0, 3]
    assert guidance_slots(correct, [True, True, False, True], 2, "replace_last") == [0, 3]


def test_append_slots_are_the_last_on_policy_positions_whatever_their_outcome():
    # LUFFY/ExGRPO: the group trains on samples 0..G-k-1 plus k members at the end, even when
    # the last samples are correct and an earlier one is wrong.
    correct = [False, True, True, True]
    assert guidance_slots(correct, [True] * 4, 1, "append") == [3]
    assert guidance_slots(correct, [True] * 4, 2, "append") == [2, 3]
    # A position an earlier callback already filled is skipped.
    assert guidance_slots(correct, [True, True, True, False], 1, "append") == [2]


def test_replace_random_picks_incorrect_slots_not_always_the_last():
    correct = [False, False, False, False, True, False, False, False]  # 7 wrong of 8
    rng = random.Random(0)
    picks = [guidance_slots(correct, [True] * 8, 1, "replace_random", rng)[0] for _ in range(40)]
    assert all(not correct[i] for i in picks)
    assert len(set(picks)) > 3 and any(p != 7 for p in picks)
    # min(k, #incorrect): one wrong sample, two members asked for.
    assert guidance_slots([True, False, True], [True] * 3, 2, "replace_random", rng) == [1]
    same = [
        guidance_slots(correct, [True] * 8, 2, "replace_random", random.Random(5)) for _ in "ab"
    ]
    assert same[0] == same[1]  # seeded: reproducible
    with pytest.raises(ValueError, match="random generator"):
        guidance_slots(correct, [True] * 8, 1, "replace_random")


def test_source_metrics_loss_share_and_advantage():
    # Token-mean over 4 tokens; |loss| 1, 1 (policy row) and 3, 3 (reference row):
    # policy share 2 / 8 = 0.25, reference 6 / 8 = 0.75.
    loss = torch.tensor([[1.0, -1.0], [3.0, 3.0]])
    terms = source_loss_terms(loss, torch.ones(2, 2), ["policy", "reference"], "token-mean", 2)
    sums = {k: float(v) for k, v in terms.items()}
    scored = _scored([1.0, 0.0, 0.0, 1.0], [3])
    out = finish_source_metrics(
        sums, scored.rollouts, torch.tensor([1.0, -1, 0, 2]), torch.arange(4)
    )
    assert out["source/policy/loss_share"] == pytest.approx(0.25)
    assert out["source/reference/loss_share"] == pytest.approx(0.75)
    assert out["source/policy/advantage"] == pytest.approx(0.0)
    assert out["source/reference/advantage"] == pytest.approx(2.0)


# --- reference text (template alignment) -----------------------------------------------------


def test_template_alignment():
    tpl = "The answer is \\boxed{{{answer}}}."
    assert align_reference(None, 57, tpl) == "The answer is \\boxed{57}."
    assert (
        align_reference("40 + 17 = 57", "57", tpl) == "40 + 17 = 57\n\nThe answer is \\boxed{57}."
    )
    assert align_reference("so \\boxed{57}", "57", tpl) == "so \\boxed{57}"
    # Without alignment: the raw solution, else the bare answer (which format rewards punish).
    assert reference_text(None, 57, False, tpl) == "57"
    assert reference_text("40 + 17 = 57", 57, False, tpl) == "40 + 17 = 57"
    assert reference_text(None, None, True, tpl) is None


# --- experience pool -------------------------------------------------------------------------


def _traj(text: str) -> Trajectory:
    return Trajectory(token_ids=[1, 2], behaviour_logp=[-0.1, -0.2], temperature=1.0, text=text)


def test_bucket_probabilities_by_hand():
    # K = 4, sigma = 1: densities e^-0.5, 1, e^-0.5 -> 0.2741, 0.4519, 0.2741.
    got = bucket_probabilities([1, 2, 3], 4, 1.0)
    assert got == pytest.approx([0.274068, 0.451863, 0.274068], abs=1e-6)


def test_pool_records_retires_dedupes_and_bounds():
    pool = ExperiencePool(max_questions=2, max_trajectories=2, group_size=4)
    pool.record("a", {"m": 1}, 0, 4, [])  # never solved: not stored
    assert len(pool) == 0
    pool.record("a", {"m": 1}, 2, 4, [_traj("x"), _traj("x"), _traj("y")])
    assert [t.text for t in pool.trajectories("a")] == ["x", "y"]
    pool.record("a", {"m": 1}, 1, 4, [_traj("z")])
    assert [t.text for t in pool.trajectories("a")] == ["y", "z"]  # newest two
    assert pool.entries["a"]["bucket"] == 1
    pool.record("b", {}, 3, 4, [_traj("b")])
    pool.record("c", {}, 2, 4, [_traj("c")])  # over max_questions: the oldest ("a") goes
    assert set(pool.entries) == {"b", "c"}
    pool.record("b", {}, 4, 4, [])  # all correct: retired
    assert "b" not in pool.entries and "b" in pool.retired
    pool.record("b", {}, 2, 4, [_traj("b2")])
    assert "b" not in pool.entries  # retired questions do not come back


def test_pool_sampling_is_distinct_bounded_and_state_round_trips():
    pool = ExperiencePool(max_questions=10, max_trajectories=2, group_size=4)
    for i in range(6):
        pool.record(f"q{i}", {}, 1 + i % 3, 4, [_traj(f"t{i}")])
    picked = pool.sample(4, random.Random(0), exclude=["q0"])
    assert len(picked) == len(set(picked)) == 4 and "q0" not in picked
    assert len(pool.sample(50, random.Random(0))) == 6
    clone = ExperiencePool(max_questions=10, max_trajectories=2, group_size=8)
    clone.load_state_dict(pool.state_dict())
    assert clone.entries == pool.entries and clone.group_size == 4
    assert clone.sample(4, random.Random(3)) == pool.sample(4, random.Random(3))


def test_module_rejects_an_on_policy_baseline_with_rloo():
    from rlvr_lightning import RLVRModule

    with pytest.raises(ValueError, match="estimator grpo or dr_grpo"):
        RLVRModule("tiny:0", **grouped(estimator="rloo", offpolicy_baseline="on_policy"))


def test_row_helpers_keep_position_temperatures():
    ro = dataclasses.replace(
        _rollouts(), position_temperature=torch.tensor([[0.7, 0.35, 0.07]] * 4)
    )
    out = replace_rows(ro, [2], [[4, 5, 6, 2]], [None], ["reference"], [1.0], ["ref"], pad_id=0)
    # The injected row is at its own temperature throughout; others keep theirs, padded 1.0.
    assert out.position_temperature.tolist()[1:3] == [
        pytest.approx([0.7, 0.35, 0.07, 1.0]),
        [1.0] * 4,
    ]
    picked = select_rows(out, [2, 0])
    assert picked.position_temperature.tolist()[0] == [1.0] * 4
