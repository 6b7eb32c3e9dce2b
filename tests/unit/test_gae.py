"""GAE and its whitening against hand-computed values (spec §8.7)."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algorithms.advantages import compute_advantages, gae, outcome_token_rewards

# Row 0: 3 valid tokens, V = [0.5, 0.2, 0.4], reward 1.0 at t = 2.
# Row 1: 2 valid tokens, V = [0.3, -0.1], reward -0.5 at t = 1. Padding holds 100 (ignored).
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # [N, T]
VALUES = torch.tensor([[0.5, 0.2, 0.4, 100.0], [0.3, -0.1, 100.0, 100.0]])  # [N, T]
REWARDS = torch.tensor([1.0, -0.5])  # [N]


def test_outcome_reward_sits_at_the_last_valid_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # [N, T]
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)  # [N, T]
    expected = torch.tensor([[0.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0], [0.0] * 4])
    torch.testing.assert_close(out, expected)


def test_gae_hand_values_with_discount_and_padding() -> None:
    # gamma = 0.9, lam = 0.8, gamma * lam = 0.72; V after the last valid token is 0.
    # Row 0: t=2: d = 1 - 0.4 = 0.6, A = 0.6
    #        t=1: d = 0.9*0.4 - 0.2 = 0.16, A = 0.16 + 0.72*0.6 = 0.592
    #        t=0: d = 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.72*0.592 = 0.10624
    #        R = A + V = [0.60624, 0.792, 1.0]
    # Row 1: t=1: d = -0.5 + 0.1 = -0.4, A = -0.4
    #        t=0: d = 0.9*(-0.1) - 0.3 = -0.39, A = -0.39 + 0.72*(-0.4) = -0.678
    #        R = [-0.378, -0.5]
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=0.9, lam=0.8)  # [N, T]
    torch.testing.assert_close(
        adv, torch.tensor([[0.10624, 0.592, 0.6, 0.0], [-0.678, -0.4, 0.0, 0.0]])
    )
    torch.testing.assert_close(
        ret, torch.tensor([[0.60624, 0.792, 1.0, 0.0], [-0.378, -0.5, 0.0, 0.0]])
    )


def test_gae_with_gamma_and_lambda_one_is_reward_minus_value() -> None:
    # gamma = lam = 1: A_t = R - V_t and every return is the sequence reward.
    adv, ret = gae(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)  # [N, T]
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.6, 0.0], [-0.8, -0.4, 0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0], [-0.5, -0.5, 0.0, 0.0]]))


def test_gae_skips_padding_inside_a_row_and_nan_padding_stays_out() -> None:
    # A hole at t=1: the next valid token of t=0 is t=2. gamma = 0.5, lam = 1:
    # t=2: A = 1 - 0.4 = 0.6; t=0: d = 0.5*0.4 - 0.5 = -0.3, A = -0.3 + 0.5*0.6 = 0.0
    mask = torch.tensor([[1, 0, 1, 0]])  # [N, T]
    values = torch.tensor([[0.5, float("nan"), 0.4, float("inf")]])  # [N, T]
    adv, ret = gae(torch.tensor([1.0]), values, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.0, 0.6, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.5, 0.0, 1.0, 0.0]]))


def test_gae_accepts_token_rewards_and_gives_empty_rows_zero() -> None:
    # Token rewards [0.1, 0, 1] with V = 0, gamma = lam = 1: A_t = sum of rewards from t on.
    token_rewards = torch.tensor([[0.1, 0.0, 1.0], [5.0, 5.0, 5.0]])  # [N, T]
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])  # [N, T]
    adv, ret = gae(token_rewards, torch.zeros(2, 3), mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[1.1, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, adv)


def test_compute_advantages_gae_whitens_over_valid_tokens() -> None:
    # gamma = lam = 1 advantages on valid tokens: [0.5, 0.8, 0.6, -0.8, -0.4]; mean 0.14,
    # unbiased var = (0.1296 + 0.4356 + 0.2116 + 0.8836 + 0.2916) / 4 = 0.488.
    out = compute_advantages(REWARDS, 2, "gae", values=VALUES, mask=MASK)  # [N, T]
    std = 0.488**0.5
    raw = torch.tensor([[0.5, 0.8, 0.6], [-0.8, -0.4, 0.0]])
    expected = torch.zeros(2, 4)
    expected[0, :3] = (raw[0] - 0.14) / std
    expected[1, :2] = (raw[1, :2] - 0.14) / std
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    unwhitened = compute_advantages(REWARDS, 2, "gae", values=VALUES, mask=MASK, whiten=False)
    torch.testing.assert_close(unwhitened, gae(REWARDS, VALUES, MASK, 1.0, 1.0)[0])


def test_compute_advantages_gae_without_values_names_the_value_head() -> None:
    with pytest.raises(ValueError, match="value_head"):
        compute_advantages(REWARDS, 2, "gae")
