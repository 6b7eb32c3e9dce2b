from __future__ import annotations

import random

import pytest

from rlvr_lightning.data.replay import (
    PromptReplay,
    in_window,
    jittered,
    pass_rate_cooldown,
    priority,
    replay_budget,
)
from rlvr_lightning.data.stats import Observation


def obs(pid: str, k: int, g: int = 8, trained: bool = True) -> Observation:
    return Observation(pid, k, g, reward_variance=0.0, trained=trained)


@pytest.mark.parametrize(
    ("p", "f", "expected"),
    [
        (8, 0.5, 4),  # min(floor(8 * 0.5), 4) = 4
        (8, 0.9, 4),  # f clamped to 0.5
        (7, 0.5, 3),  # min(floor(3.5), 3) = 3
        (8, 0.3, 2),  # floor(2.4) = 2
        (8, -1.0, 0),
        (1, 0.5, 0),  # floor(0.5) = 0
    ],
)
def test_budget(p, f, expected):
    assert replay_budget(p, f) == expected


def test_admission_window_is_inclusive_and_excludes_zero():
    assert in_window(0.25, 0.25, 0.75) and in_window(0.75, 0.25, 0.75)
    assert not in_window(0.125, 0.25, 0.75) and not in_window(0.875, 0.25, 0.75)
    assert not in_window(0.0, 0.0, 0.75)  # p = 0 never admitted


def test_priority_orders_by_distance_then_lower_pass_rate():
    keys = sorted(
        [priority(0.625, 0, "a"), priority(0.375, 0, "b"), priority(0.5, 0, "c"),
         priority(0.25, 0, "d")]
    )  # fmt: skip
    # |p - 0.5|: c 0, then a and b tie at 0.125 -> lower p (b) first, then d at 0.25.
    assert [k[3] for k in keys] == ["c", "b", "a", "d"]


def test_observe_admits_only_the_window_and_records_zero_pass():
    replay = PromptReplay(cooldown_steps=0)
    replay.observe(0, [obs("mid", 4), obs("easy", 8), obs("hard", 1), obs("zero", 0)])
    assert replay.select(1, 4, ()) == ["mid"]
    assert replay.zero_pass == {"zero"}


def test_select_pops_by_priority_within_budget():
    replay = PromptReplay(cooldown_steps=0)
    replay.observe(0, [obs("a", 5), obs("b", 3), obs("c", 4), obs("d", 2)])
    assert replay.select(1, 2, ()) == ["c", "b"]  # 0.5 first; 0.375 before 0.625
    assert replay.select(2, 4, ()) == ["a", "d"]  # c and b come back only once re-observed


def test_cooldown_gates_until_enough_steps_passed():
    replay = PromptReplay(cooldown_steps=2)
    replay.observe(5, [obs("a", 4)])
    assert replay.select(6, 4, ()) == []  # 6 - 5 = 1 < 2: kept for later
    assert replay.select(7, 4, ()) == ["a"]  # 7 - 5 = 2 >= 2


def test_reserved_and_duplicate_candidates_are_dropped():
    replay = PromptReplay(cooldown_steps=0)
    replay.observe(0, [obs("a", 4), obs("b", 3)])
    assert replay.select(1, 4, {"a"}) == ["b"]
    assert replay.select(5, 4, ()) == []  # a was dropped, not kept; b is in flight


def test_max_reuse_stops_admission():
    replay = PromptReplay(cooldown_steps=0, max_reuse=2)
    served = []
    for step in range(6):
        replay.observe(step, [obs("a", 4)])
        served.append(replay.select(step + 1, 4, ()))
    assert served == [["a"], ["a"], [], [], [], []]
    assert replay.reuse["a"] == 2


def test_unlimited_reuse_when_max_reuse_is_not_positive():
    replay = PromptReplay(cooldown_steps=0, max_reuse=0)
    for step in range(12):
        replay.observe(step, [obs("a", 4)])
        assert replay.select(step + 1, 1, ()) == ["a"]


def test_leaving_the_window_drops_the_candidate():
    replay = PromptReplay(cooldown_steps=0)
    replay.observe(0, [obs("a", 4)])
    assert replay.select(1, 1, ()) == ["a"]
    replay.observe(1, [obs("a", 8)])  # solved now: 1.0 is out of the window
    assert replay.select(2, 1, ()) == [] and len(replay) == 0


def test_pass_rate_cooldown_buckets_and_jitter():
    bases = (5, 10, 15, 20)
    # round(p, 1): 0.5 -> d 0; 0.625 -> 0.6 -> d 0.1; 0.25 -> 0.2 -> d 0.3 -> bucket 3.
    assert [pass_rate_cooldown(p, bases) for p in (0.5, 0.625, 0.25, 0.125)] == [5, 10, 20, 20]
    rng = random.Random(0)
    draws = {jittered(10, 0.2, rng) for _ in range(200)}
    assert draws == {8, 9, 10, 11, 12}  # offset round(0.2 * 10) = 2
    assert {jittered(2, 0.2, rng) for _ in range(100)} == {1, 2, 3}  # offset at least 1


def test_pass_rate_cooldown_really_gates_selection():
    replay = PromptReplay(cooldown_steps=0, pass_rate_cooldown=(5, 5, 5, 5), jitter=0.0)
    replay.observe(0, [obs("a", 4)])  # ready at 0 + jittered(5) = 0 + [4, 6]
    assert replay.select(3, 1, ()) == []
    assert replay.select(6, 1, ()) == ["a"]


def test_state_round_trip_gives_the_same_choices():
    a = PromptReplay(cooldown_steps=1, pass_rate_cooldown=(1, 2, 3, 4), seed=3)
    a.observe(0, [obs(f"p{i}", i % 8 + 1) for i in range(20)])
    b = PromptReplay(cooldown_steps=1, pass_rate_cooldown=(1, 2, 3, 4))
    b.load_state_dict(a.state_dict())
    for step in range(1, 6):
        assert a.select(step, 3, ()) == b.select(step, 3, ())
        more = [obs(f"p{i}", (i + step) % 8 + 1) for i in range(step, 20, 3)]
        a.observe(step, more)
        b.observe(step, more)


def test_invalid_window_is_rejected():
    with pytest.raises(ValueError, match="min_pass_rate <= max_pass_rate"):
        PromptReplay(min_pass_rate=0.8, max_pass_rate=0.2)
