from __future__ import annotations

import pytest
import torch

from rlvr_lightning.data.curriculum import (
    MemoryBank,
    VarianceCurriculum,
    linear_kappa,
    max_group_variance,
    normalized_variance,
)
from rlvr_lightning.data.stats import Observation


def binary(k: int, g: int) -> torch.Tensor:
    return torch.tensor([[1.0] * k + [0.0] * (g - k)])  # [1, G]


@pytest.mark.parametrize(
    ("g", "expected"),
    [(2, 2 / 4), (4, 4 / 12), (7, 8 / 28), (8, 8 / 28)],  # G/(4(G-1)) even, (G+1)/(4G) odd
)
def test_max_group_variance(g, expected):
    assert max_group_variance(g) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("k", "g", "expected"),
    [
        # Even G: 4k(G-k)/G^2.
        (1, 2, 1.0),  # 4*1*1/4
        (1, 4, 0.75),  # 4*1*3/16
        (2, 4, 1.0),
        (1, 8, 0.4375),  # 4*1*7/64 = 28/64
        (3, 8, 0.9375),  # 4*3*5/64 = 60/64
        (4, 8, 1.0),
        # Odd G: 4k(G-k)/(G^2-1).
        (1, 7, 0.5),  # 4*1*6/48
        (3, 7, 1.0),  # 4*3*4/48
        (2, 7, 40 / 48),  # 4*2*5/48
        (0, 8, 0.0),
        (7, 7, 0.0),
    ],
)
def test_normalized_variance_matches_closed_form(k, g, expected):
    assert float(normalized_variance(binary(k, g))[0]) == pytest.approx(expected)


def test_observation_score_equals_tensor_score():
    cur = VarianceCurriculum()
    for g in (2, 4, 7, 8):
        for k in range(g + 1):
            score = cur.observation_score(Observation("p", k, g, 0.0))
            assert score == pytest.approx(float(normalized_variance(binary(k, g))[0]))


def test_kappa_schedule_is_linear_then_constant():
    assert linear_kappa(0, 0.3, 0.6, 100) == pytest.approx(0.3)
    assert linear_kappa(50, 0.3, 0.6, 100) == pytest.approx(0.45)
    assert linear_kappa(500, 0.3, 0.6, 100) == pytest.approx(0.6)
    assert linear_kappa(7, 0.5, 0.5, 0) == 0.5


def test_kappa_filter_drops_low_variance_groups():
    cur = VarianceCurriculum(kappa_start=0.5, kappa_end=0.5)
    # G = 8, k = 0, 1, 2, 4, 8 -> scores 0, 0.4375, 0.75, 1, 0.
    correct = torch.tensor([[1] * k + [0] * (8 - k) for k in (0, 1, 2, 4, 8)]).bool()
    mask = cur.group_mask(0, correct, correct.float())
    assert mask.tolist() == [False, False, True, True, False]


def test_kappa_ramp_changes_the_filter_over_steps():
    cur = VarianceCurriculum(kappa_start=0.3, kappa_end=0.6, ramp_steps=10)
    one_of_eight = torch.tensor([[True] + [False] * 7])  # score 0.4375
    assert cur.group_mask(0, one_of_eight, one_of_eight.float()).item()  # 0.4375 >= 0.3
    assert not cur.group_mask(10, one_of_eight, one_of_eight.float()).item()  # < 0.6


def test_bank_serves_highest_score_first_and_evicts_lowest():
    bank = MemoryBank(capacity=3, max_age=0)
    bank.add("a", 0.8, step=0)
    bank.add("b", 1.0, step=0)
    bank.add("c", 0.8, step=1)
    bank.add("d", 0.9, step=2)  # full: evicts the lowest score, oldest first -> a
    assert "a" not in bank and len(bank) == 3
    bank.add("e", 0.5, step=3)  # lower than everything: not admitted
    assert "e" not in bank
    assert bank.take(2, exclude=()) == ["b", "d"]
    assert bank.take(5, exclude=()) == ["c"] and len(bank) == 0


def test_bank_expires_old_entries_and_respects_exclusions():
    bank = MemoryBank(capacity=8, max_age=5)
    bank.add("old", 1.0, step=0)
    bank.add("new", 0.9, step=4)
    bank.expire(6)  # 6 - 0 > 5: old is dropped
    assert list(bank.entries) == ["new"]
    assert bank.take(1, exclude={"new"}) == [] and "new" in bank


def test_curriculum_refills_the_freed_slots_from_the_bank():
    cur = VarianceCurriculum(kappa_start=0.5, kappa_end=0.5, bank_min_score=0.9,
                             max_fill_fraction=0.5)  # fmt: skip
    ids = ["a", "b", "c", "d"]
    cur.observe(0, ids, [1.0, 0.95, 0.2, 0.0], trained=[True, True, False, False])
    assert cur.freed == 2 and len(cur.bank) == 2
    assert cur.fill(8, exclude=()) == ["a", "b"]  # 2 freed slots, cap floor(8 * 0.5) = 4
    cur.observe(1, ["x"] * 0, [], trained=[False] * 6)
    assert cur.fill(8, exclude=()) == []  # 6 freed, but the bank is empty


def test_fill_is_capped():
    cur = VarianceCurriculum(bank_min_score=0.5, max_fill_fraction=0.25)
    ids = [f"p{i}" for i in range(8)]
    cur.observe(0, ids, [1.0] * 8, trained=[False] * 8)
    assert len(cur.fill(8, exclude=())) == 2  # floor(8 * 0.25)


def test_state_round_trip():
    a = VarianceCurriculum(bank_min_score=0.5)
    a.observe(3, ["a", "b"], [0.9, 0.6], trained=[True, False])
    b = VarianceCurriculum(bank_min_score=0.5)
    b.load_state_dict(a.state_dict())
    assert b.freed == 1 and b.fill(8, ()) == a.fill(8, ())
