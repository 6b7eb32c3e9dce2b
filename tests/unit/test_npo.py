"""NPO's quantities on hand-computed inputs: Q, V, S, the Δ choice, the AutoNPO triggers and
the mistake pool; and the on-policy treatment of an injected guide trajectory."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algorithms import npo
from rlvr_lightning.stages.offpolicy import Member, replace_rows
from rlvr_lightning.types import Rollouts


def test_signal_quality_is_the_share_of_failed_prompts_solved():
    assert npo.signal_quality([True, False, False, True]) == 0.5
    assert npo.signal_quality([]) == 0.0


def test_logratio_variance_over_valid_tokens_only():
    policy = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    guide = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # ratios on valid tokens: 0, -1, 1, 0, 0 -> mean 0, population variance 2/5
    assert npo.logratio_variance(policy, guide, mask) == pytest.approx(0.4)
    # a guide equal to the policy has no variance cost
    assert npo.logratio_variance(policy, policy, mask) == 0.0
    assert npo.logratio_variance(policy, guide, torch.tensor([[1, 0, 0], [0, 0, 0]])) == 0.0


def test_effective_signal_and_best_candidate():
    assert npo.effective_signal(0.5, 0.25) == 2.0
    assert npo.effective_signal(0.5, 0.0, eps=1e-2) == pytest.approx(50.0)
    # Q grows with Δ, V grows faster: the middle one wins
    q = {2: 0.2, 4: 0.5, 8: 0.6}
    v = {2: 0.1, 4: 0.2, 8: 0.6}
    scores = {d: npo.effective_signal(q[d], v[d]) for d in q}  # 2.0, 2.5, 1.0
    assert npo.best_candidate(scores) == 4
    assert npo.best_candidate({8: 1.0, 2: 1.0}) == 2  # a tie goes to the nearer guide
    with pytest.raises(ValueError):
        npo.best_candidate({})


def test_plateau_compares_the_last_two_windows():
    assert not npo.plateaued([0.1, 0.2, 0.3], window=2, min_gain=0.01)  # too short
    assert not npo.plateaued([0.1, 0.2, 0.4, 0.5], window=2, min_gain=0.1)  # gain 0.3
    assert npo.plateaued([0.1, 0.2, 0.4, 0.5, 0.45, 0.5], window=2, min_gain=0.1)  # gain 0.025
    assert npo.plateaued([0.5, 0.5], window=1, min_gain=0.0)  # no gain at all


def test_entropy_collapse_against_the_first_window_or_a_floor():
    values = [2.0, 2.0, 1.5, 0.9, 0.9]
    assert not npo.entropy_collapsed(values[:3], window=2, ratio=0.5)  # too short
    assert npo.entropy_collapsed(values, window=2, ratio=0.5)  # 0.9 < 0.5 * 2.0
    assert not npo.entropy_collapsed(values, window=2, ratio=0.4)
    assert npo.entropy_collapsed(values, window=2, ratio=0.1, floor=1.0)


def test_mistake_pool_keeps_recent_failures_and_round_trips():
    pool = npo.MistakePool(capacity=2)
    prompt = {"messages": [{"role": "user", "content": "q"}], "columns": {"answer": "5"}}
    pool.observe("a", 0, prompt)
    pool.observe("b", 0, prompt)
    pool.observe("a", 0, prompt)  # failed again: now the newest
    assert [pid for pid, _ in pool.newest(5)] == ["a", "b"]
    pool.observe("c", 0, prompt)  # over capacity: the oldest ("b") leaves
    assert [pid for pid, _ in pool.newest(5)] == ["c", "a"]
    pool.observe("a", 2, prompt)  # solved: leaves the pool
    assert [pid for pid, _ in pool.newest(5)] == ["c"]
    other = npo.MistakePool(capacity=2)
    other.load_state_dict(pool.state_dict())
    assert other.newest(5) == pool.newest(5)
    with pytest.raises(ValueError):
        npo.MistakePool(0)


def _rollouts() -> Rollouts:
    n, t = 4, 3
    return Rollouts(
        prompt_ids=torch.ones(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.full((n, t), 5),
        completion_mask=torch.ones(n, t, dtype=torch.long),
        behaviour_logp=torch.full((n, t), -1.0),
        temperature=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        completions=["x"] * n,
        group_size=2,
    )


def test_as_on_policy_member_is_not_masked_off_policy():
    r = replace_rows(
        _rollouts(),
        [1, 3],
        [[7, 8], [9]],
        [[-0.5, -0.25], [-0.1]],
        ["npo", "teacher"],
        [1.0, 1.0],
        ["g", "t"],
        pad_id=0,
        as_on_policy=[True, False],
    )
    assert r.offpolicy_mask[1].tolist() == [0, 0, 0]  # trained as the policy's own sample
    assert r.offpolicy_mask[3].tolist() == [1, 0, 0]
    assert r.behaviour_logp[1].tolist() == [-0.5, -0.25, 0.0]
    assert r.sources == ("policy", "npo", "policy", "teacher")
    with pytest.raises(ValueError, match="behaviour_logp"):
        Member(row=0, source="npo", token_ids=[1], as_on_policy=True)
    assert math.isclose(float(r.completion_mask[3].sum()), 1.0)
