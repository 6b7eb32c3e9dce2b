from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rlvr_lightning.algorithms.advantages import (
    compute_advantages,
    group_advantages,
    group_stats,
    rloo_advantages,
)

EPS = 1e-6


def test_group_advantages_two_groups_of_two() -> None:
    # [1, 0 | 0, 1], G=2: means [.5, .5], unbiased std sqrt((.25 + .25) / 1) = 0.7071,
    # so A = ±0.5 / (0.7071 + eps) = ±0.7071.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # [N]
    a = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(group_advantages(rewards, 2), torch.tensor([a, -a, -a, a]))


def test_group_advantages_groups_of_three() -> None:
    # [1, 1, 0]: mean 2/3, deviations [1/3, 1/3, -2/3], unbiased var (1/9+1/9+4/9)/2 = 1/3,
    # std 0.57735 -> [0.57735, 0.57735, -1.1547]; [0, 0, 1] is its mirror.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # [N]
    std = math.sqrt(1 / 3) + EPS
    hi, lo = (1 / 3) / std, (-2 / 3) / std
    expected = torch.tensor([hi, hi, lo, -hi, -hi, -lo])  # [N]
    torch.testing.assert_close(group_advantages(rewards, 3), expected)


def test_group_advantages_equal_rewards_give_zero() -> None:
    # std 0: (r - mean) = 0 and 0 / eps = 0, no NaN.
    out = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 2)  # [N]
    torch.testing.assert_close(out, torch.zeros(4))


def test_group_advantages_without_std() -> None:
    # Dr. GRPO: r - mean = [.5, -.5, -.5, .5] for [1, 0 | 0, 1].
    out = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, normalize_std=False)
    torch.testing.assert_close(out, torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("fn", [group_advantages, rloo_advantages])
def test_singleton_groups_get_zero(fn: Callable[..., Any]) -> None:
    torch.testing.assert_close(fn(torch.tensor([1.0, 0.0, 3.0]), 1), torch.zeros(3))


@pytest.mark.parametrize("fn", [group_advantages, rloo_advantages, group_stats])
def test_rejects_rows_not_divisible_by_group_size(fn: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="group_size=2"):
        fn(torch.zeros(5), 2)


def test_integer_rewards_become_float() -> None:
    # [1, 0] as ints: same as the float case, ±0.5 / (0.7071 + eps).
    out = group_advantages(torch.tensor([1, 0]), 2)  # [N]
    assert out.is_floating_point()
    assert out[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + EPS))


def test_rloo_hand_values() -> None:
    # [1, 0, 0]: baselines (0+0)/2 = 0, (1+0)/2 = .5, (1+0)/2 = .5 -> [1, -.5, -.5];
    # [2, 2, 2]: every baseline is 2 -> 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])  # [N]
    expected = torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0])  # [N]
    torch.testing.assert_close(rloo_advantages(rewards, 3), expected)


def test_rloo_is_scaled_no_std_advantage() -> None:
    # r_i - mean_{j!=i} r_j = G / (G - 1) * (r_i - mean_g).
    rewards = torch.rand(12, generator=torch.Generator().manual_seed(0))  # [N]
    scaled = 4 / 3 * group_advantages(rewards, 4, normalize_std=False)  # [N]
    torch.testing.assert_close(rloo_advantages(rewards, 4), scaled)


def test_group_stats() -> None:
    # [1, 0 | 1, 1 | 0, 1]: means [.5, 1, .5], unbiased variances [.5, 0, .5].
    mean, var = group_stats(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0]), 2)
    torch.testing.assert_close(mean, torch.tensor([0.5, 1.0, 0.5]))
    torch.testing.assert_close(var, torch.tensor([0.5, 0.0, 0.5]))
    # G = 1: the variance of one sample is defined as 0 (torch.var would give NaN).
    mean, var = group_stats(torch.tensor([3.0, 4.0]), 1)
    torch.testing.assert_close(mean, torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(var, torch.zeros(2))


def test_compute_advantages_dispatch() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # [N]
    a = 0.5 / (math.sqrt(0.5) + EPS)
    # grpo: [1, 0] -> ±a, [0, 0] -> 0; dr_grpo: ±.5; rloo: [1, 0] -> [1, -1].
    cases = {
        "grpo": [a, -a, 0.0, 0.0],
        "dr_grpo": [0.5, -0.5, 0.0, 0.0],
        "rloo": [1.0, -1.0, 0.0, 0.0],
    }
    for name, expected in cases.items():
        torch.testing.assert_close(compute_advantages(rewards, 2, name), torch.tensor(expected))
    with pytest.raises(ValueError, match="Unknown advantage estimator"):
        compute_advantages(rewards, 2, "ppo")  # type: ignore[arg-type]
