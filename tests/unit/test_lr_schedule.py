"""``lifecycle.lr_factor``: warm-up, then constant, linear or cosine decay to a floor."""

import math

import pytest

from rlvr_lightning.stages.lifecycle import lr_factor


def test_warmup_then_constant():
    assert [lr_factor(s, 4, "none", 0, 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]


def test_linear_decay_after_warmup():
    # warm-up over 2 steps, then (6 - s) / (6 - 2) from s = 2
    got = [lr_factor(s, 2, "linear", 6, 0.0) for s in range(7)]
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0])


def test_cosine_decay_to_a_floor():
    # no warm-up, floor 0.1: 0.1 + 0.9 * (1 + cos(pi * s / 4)) / 2
    got = [lr_factor(s, 0, "cosine", 4, 0.1) for s in range(5)]
    half = 0.5 * (1 + math.cos(math.pi / 4))
    assert got == pytest.approx([1.0, 0.1 + 0.9 * half, 0.55, 0.1 + 0.9 * (1 - half), 0.1])


def test_past_the_last_step_stays_at_the_floor():
    assert lr_factor(9, 0, "linear", 4, 0.2) == pytest.approx(0.2)
