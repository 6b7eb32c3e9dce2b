"""Off-policy token weighting (spec §4.7): values and gradients against hand-derived numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algorithms.losses import ppo_clip_loss
from rlvr_lightning.algorithms.offpolicy_losses import (
    mixed_policy_loss,
    offpolicy_token_loss,
    policy_shaping,
)


def _leaf(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log().requires_grad_()  # [N, T] log-probs, a leaf


def _loss(logp, behaviour, adv, weighting, mask=None, **kw):
    mask = torch.ones_like(logp) if mask is None else mask
    return offpolicy_token_loss(logp, behaviour, adv, mask, weighting=weighting, **kw)


def test_policy_shaping_values():
    # f(0.5) = 0.5 / 0.6 = 0.8333; f(0) = 0; f(1) = 1 / 1.1 = 0.9091.
    out = policy_shaping(torch.tensor([0.5, 0.0, 1.0]), 0.1)
    assert torch.allclose(out, torch.tensor([0.8333333, 0.0, 0.9090909]))
    with pytest.raises(ValueError, match="gamma > 0"):
        policy_shaping(torch.tensor([0.5]), 0.0)


def test_luffy_shaping_value_and_gamma_over_square_gradient():
    # pi = 0.5, unknown behaviour (log-prob 0 = probability 1), A = 1, gamma = 0.1:
    # loss = -f(0.5) = -0.8333; d loss / d pi = -gamma / (pi + gamma)^2 = -0.1 / 0.36 = -0.2778.
    prob = torch.tensor([[0.5]], requires_grad=True)
    loss, metrics = _loss(prob.log(), torch.zeros(1, 1), torch.tensor([1.0]), "shaping")
    assert loss.item() == pytest.approx(-0.8333333, abs=1e-6)
    loss.sum().backward()
    assert prob.grad.item() == pytest.approx(-0.1 / 0.36, abs=1e-6)
    assert metrics["offpolicy_weight_mean"].item() == pytest.approx(0.8333333, abs=1e-6)


def test_luffy_gradient_upweights_unlikely_tokens():
    # d loss / d log pi = -A * pi * gamma / (pi + gamma)^2:
    # pi = 0.5: 0.05 / 0.36 = 0.1389;  pi = 0.05: 0.005 / 0.0225 = 0.2222 (plain weight
    # pi would give 0.5 and 0.05: shaping reverses the order).
    logp = _leaf([[0.5, 0.05]])
    loss, _ = _loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), "shaping")
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.1388889, -0.2222222]]), atol=1e-6)


def test_exgrpo_shaping_uses_stored_behaviour_logprobs():
    # pi = 0.3, stored pi_past = 0.6: w = 0.5, loss = -A f(0.5) with A = -2: +1.6667;
    # d loss / d log pi = -A * w * gamma / (w + gamma)^2 = 2 * 0.5 * 0.1 / 0.36 = 0.2778.
    logp = _leaf([[0.3]])
    behaviour = torch.tensor([[0.6]]).log()
    loss, _ = _loss(logp, behaviour, torch.tensor([-2.0]), "shaping")
    assert loss.item() == pytest.approx(1.6666667, abs=1e-6)
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(0.2777778, abs=1e-6)


def test_rl_plus_multiple_importance_sampling():
    # pi = 0.5 (pi_old = sg(pi) = 0.5): omega = 0.75, denominator 0.25 + 0.375 = 0.625,
    # r = 0.8, exploration (1 - 0.5)^0.5 = 0.7071, loss = -0.8 * 0.7071 = -0.5657.
    # pi = 0.2: omega = 0.6, denominator 0.4, r = 0.5, (0.8)^0.5 = 0.8944, loss = -0.4472.
    # r is proportional to pi, so d loss / d log pi equals the loss.
    logp = _leaf([[0.5, 0.2]])
    loss, _ = _loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), "mis", exploration=0.5)
    expected = torch.tensor([[-0.5656854, -0.4472136]])
    assert torch.allclose(loss, expected, atol=1e-6)
    loss.sum().backward()
    assert torch.allclose(logp.grad, expected, atol=1e-6)


def test_on_policy_weighting_is_an_advantage_weighted_sft_term():
    # ratio pi / sg(pi) = 1: loss = -A = -3, d loss / d log pi = -A = -3, whatever pi is.
    logp = _leaf([[0.01, 0.9]])
    loss, _ = _loss(logp, torch.zeros(1, 2), torch.tensor([3.0]), "on_policy")
    assert torch.allclose(loss, torch.full((1, 2), -3.0))
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -3.0))


@pytest.mark.parametrize("weighting", ["shaping", "mis", "on_policy"])
def test_padding_gives_zero_loss_and_finite_zero_gradient(weighting):
    logp = torch.tensor([[math.log(0.5), float("-inf")]], requires_grad=True)
    mask = torch.tensor([[1, 0]])
    loss, _ = _loss(
        logp, torch.tensor([[0.0, float("-inf")]]), torch.tensor([1.0]), weighting, mask=mask
    )
    assert loss[0, 1].item() == 0.0
    loss.sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1].item() == 0.0


def test_unknown_weighting_is_rejected():
    with pytest.raises(ValueError, match="Unknown off-policy weighting"):
        _loss(_leaf([[0.5]]), torch.zeros(1, 1), torch.tensor([1.0]), "luffy")


def test_mixed_loss_applies_ppo_to_policy_tokens_and_shaping_to_injected_ones():
    # Row 0 sampled (ratio 1), row 1 injected (pi = 0.5, behaviour unknown), A = -1 for both.
    # Row 0 tokens: PPO -A * 1 = 1. Row 1 tokens: -A * f(0.5) = 0.8333. Had PPO seen row 1,
    # its ratio 0.5 < 0.8 with A < 0 would count as clipped: the clip fraction must stay 0.
    logp = torch.tensor([[-1.0, -1.0], [math.log(0.5), math.log(0.5)]])
    old = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    mask = torch.ones(2, 2)
    off = torch.tensor([[0, 0], [1, 1]])
    loss, metrics = mixed_policy_loss(
        ppo_clip_loss,
        logp,
        old,
        torch.tensor([-1.0, -1.0]),
        mask,
        off,
        weighting="shaping",
        gamma=0.1,
        exploration=0.5,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
    )
    assert torch.allclose(loss, torch.tensor([[1.0, 1.0], [0.8333333, 0.8333333]]))
    assert metrics["clip_frac_low"].item() == 0.0
    assert metrics["offpolicy_prob_mean"].item() == pytest.approx(0.5)


def test_mixed_loss_token_level_mask_splits_a_row():
    # One row: first token injected (prefix), second sampled. A = 1, both pi = 0.5, old for the
    # sampled token log 0.5 (ratio 1): losses -0.8333 and -1.
    logp = torch.full((1, 2), math.log(0.5))
    old = torch.tensor([[0.0, math.log(0.5)]])
    loss, _ = mixed_policy_loss(
        ppo_clip_loss,
        logp,
        old,
        torch.tensor([1.0]),
        torch.ones(1, 2),
        torch.tensor([[1, 0]]),
        weighting="shaping",
        gamma=0.1,
        exploration=0.5,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
    )
    assert torch.allclose(loss, torch.tensor([[-0.8333333, -1.0]]))
