from __future__ import annotations

import inspect
import math
from typing import get_args

import pytest
import torch

from rlvr_lightning.algorithms.losses import (
    AggMode,
    PolicyLossFn,
    agg_loss,
    agg_units,
    agg_weight,
    cispo_loss,
    gspo_loss,
    kl_estimate,
    ppo_clip_loss,
    value_loss,
)

LN2 = math.log(2)
POLICY_LOSSES: list[PolicyLossFn] = [ppo_clip_loss, gspo_loss, cispo_loss]


def _logps(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp = -1 everywhere and old_logp = -1 - log(w), so exp(logp - old_logp) = w."""
    w = torch.tensor(ratios)  # [N, T]
    logp = torch.full_like(w, -1.0).requires_grad_()  # [N, T]
    return logp, -1.0 - torch.log(w)


# --- KL estimators -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("x", "k1", "k2", "k3"),
    [
        # x = log 2: k1 = .6931, k2 = .5 * .6931^2 = .2402, k3 = 1/2 + .6931 - 1 = .1931.
        (LN2, LN2, 0.5 * LN2**2, 0.5 + LN2 - 1),
        # x = -log 2: k1 = -.6931, k2 = .2402, k3 = 2 - .6931 - 1 = .3069.
        (-LN2, -LN2, 0.5 * LN2**2, 2 - LN2 - 1),
        (0.0, 0.0, 0.0, 0.0),
    ],
)
def test_kl_estimate_hand_values(x: float, k1: float, k2: float, k3: float) -> None:
    ref = torch.tensor([-1.0])  # [1]
    logp = ref + x  # [1]
    for kind, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        assert kl_estimate(logp, ref, kind).item() == pytest.approx(expected, abs=1e-6)


def test_kl_k3_is_clamped_like_verl() -> None:
    # x = 30 -> clamped to 20: exp(-20) + 20 - 1 = 19 -> clamped to 10.
    # x = -30 -> clamped to -20: exp(20) - 21, huge -> 10. Never inf.
    out = kl_estimate(torch.tensor([30.0, -30.0]), torch.zeros(2), "k3")  # [2]
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0]))


def test_kl_estimate_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")  # type: ignore[arg-type]


# --- aggregation -------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])  # [N, T]
AGG_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # [N, T], last row all padding


@pytest.mark.parametrize(
    ("mode", "expected", "units"),
    [
        # Valid tokens 1, 2 | 4 | none: (1 + 2 + 4) / 3 tokens.
        ("token-mean", 7 / 3, 3),
        # Row means 1.5 and 4; the empty row is skipped -> 2.75 over 2 rows.
        ("seq-mean-token-mean", 2.75, 2),
        # Row sums 3, 4, 0 over all 3 rows.
        ("seq-mean-token-sum", 7 / 3, 3),
        # Total 7 / (3 rows * norm_len 4).
        ("seq-mean-token-sum-norm", 7 / 12, 3),
    ],
)
def test_agg_loss_and_units_hand_values(mode: AggMode, expected: float, units: int) -> None:
    assert agg_loss(LOSS, AGG_MASK, mode, norm_len=4).item() == pytest.approx(expected)
    assert agg_units(AGG_MASK, mode) == units


def test_agg_loss_validation() -> None:
    with pytest.raises(ValueError, match="norm_len"):
        agg_loss(LOSS, AGG_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(LOSS, AGG_MASK, "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="token-mean"):
        agg_units(AGG_MASK, "sum")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", get_args(AggMode))
@pytest.mark.parametrize("seed", range(5))
def test_weighted_micro_batches_sum_to_full_aggregation(mode: AggMode, seed: int) -> None:
    # Gradient accumulation: sum_k agg(micro_k) * units(micro_k) / units(full) == agg(full).
    # Rows 6 and 7 are all padding, so the last micro-batch is empty for token-level units.
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(8, 6, generator=gen)  # [N, T]
    mask = torch.rand(8, 6, generator=gen) < 0.6  # [N, T]
    mask[5:] = False
    total = agg_units(mask, mode)
    micro = [
        agg_loss(loss_k, mask_k, mode, norm_len=6) * agg_weight(mask_k, mode, total)
        for loss_k, mask_k in zip(loss.split([3, 2, 3]), mask.split([3, 2, 3]), strict=True)
    ]
    full = agg_loss(loss, mask, mode, norm_len=6)  # []
    torch.testing.assert_close(torch.stack(micro).sum(), full)


def test_agg_weight_of_empty_mini_batch_is_zero() -> None:
    assert agg_weight(torch.zeros(2, 3), "token-mean", 0) == 0.0


# --- PPO ---------------------------------------------------------------------------------

# Row 0, A = +1, w = [1.5, 0.5, 1.1]: -min(wA, clip(w)A) = [-1.2 (clipped high), -0.5, -1.1].
# Row 1, A = -1, w = [1.5, 0.5, pad]: [1.5, 0.8 (clipped low), 0].
PPO_RATIOS = [[1.5, 0.5, 1.1], [1.5, 0.5, 1.0]]
PPO_ADV = torch.tensor([1.0, -1.0])  # [N]
PPO_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])  # [N, T]


def test_ppo_clip_loss_values_and_metrics() -> None:
    logp, old_logp = _logps(PPO_RATIOS)
    loss, metrics = ppo_clip_loss(logp, old_logp, PPO_ADV, PPO_MASK)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.1], [1.5, 0.8, 0.0]]))
    # 5 valid tokens: one clipped high (row 0 tok 0), one clipped low (row 1 tok 1).
    assert metrics["clip_frac_high"].item() == pytest.approx(0.2)
    assert metrics["clip_frac_low"].item() == pytest.approx(0.2)
    # ratio mean (1.5 + .5 + 1.1 + 1.5 + .5) / 5 = 1.02.
    assert metrics["ratio_mean"].item() == pytest.approx(1.02)
    # k3 of KL(old || new) per token is w - 1 - log w: 1.5 -> .094535, .5 -> .193147,
    # 1.1 -> .004690; mean (2 * .094535 + 2 * .193147 + .004690) / 5 = .116011.
    assert metrics["approx_kl_old"].item() == pytest.approx(0.116011, abs=1e-5)
    assert "clip_frac_dual" not in metrics
    for value in metrics.values():
        assert value.dim() == 0 and not value.requires_grad


def test_ppo_gradient_is_zero_on_clipped_tokens() -> None:
    # d(-wA)/dlogp = -wA where unclipped: row 0 [0 (clipped), -.5, -1.1], row 1 [1.5, 0, 0].
    logp, old_logp = _logps(PPO_RATIOS)
    loss, _ = ppo_clip_loss(logp, old_logp, PPO_ADV, PPO_MASK)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 0.0]]))


def test_ppo_dual_clip() -> None:
    # A = -1, w = 5: max(5, 1.2) = 5, capped at c * |A| = 3. A = -1, w = 2: 2 < 3, kept.
    # A = +1, w = 5: max(-5, -1.2) = -1.2, dual clip does not touch A > 0.
    logp, old_logp = _logps([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])  # [N, T]
    loss, metrics = ppo_clip_loss(logp, old_logp, adv, torch.ones(1, 3), dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0, -1.2]]))
    assert metrics["clip_frac_dual"].item() == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, old_logp, adv, torch.ones(1, 3), dual_clip=1.0)


def test_ppo_clip_higher_bounds() -> None:
    # DAPO clip-higher (0.2, 0.28), A = +1: w = 1.25 is inside 1.28 -> -1.25; w = 1.5 -> -1.28.
    logp, old_logp = _logps([[1.25, 1.5]])
    loss, _ = ppo_clip_loss(
        logp, old_logp, torch.ones(1), torch.ones(1, 2), clip_low=0.2, clip_high=0.28
    )
    torch.testing.assert_close(loss, torch.tensor([[-1.25, -1.28]]))


# --- GSPO --------------------------------------------------------------------------------


def test_gspo_hand_values() -> None:
    # Log-ratios [0.1, 0.3, pad 5.0] -> s = exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 on every
    # valid token; padding is ignored. A = +1 with the default (3e-4, 4e-4): clipped to 1.0004.
    old_logp = torch.tensor([[-1.1, -1.3, -6.0]])  # [N, T]
    logp = torch.full((1, 3), -1.0)  # [N, T]
    mask = torch.tensor([[1, 1, 0]])  # [N, T]
    loss, metrics = gspo_loss(logp, old_logp, torch.ones(1), mask)
    torch.testing.assert_close(loss, torch.tensor([[-1.0004, -1.0004, 0.0]]))
    assert metrics["clip_frac_high"].item() == 1.0
    assert metrics["ratio_mean"].item() == pytest.approx(math.exp(0.2))
    # With a wide clip the surrogate is unclipped: -s * A = -1.2214.
    wide, _ = gspo_loss(logp, old_logp, torch.ones(1), mask, clip_low=0.5, clip_high=0.5)
    torch.testing.assert_close(wide, torch.tensor([[-math.exp(0.2), -math.exp(0.2), 0.0]]))


def _sequence_level_gspo(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> torch.Tensor:
    """GSPO as in the paper: mean_i max(-s_i A_i, -clip(s_i) A_i), s_i over valid tokens."""
    valid = mask.bool()  # [N, T]
    log_ratio = torch.where(valid, logp - old_logp, 0.0)  # [N, T]
    s = torch.exp(log_ratio.sum(-1) / valid.sum(-1))  # [N]
    per_seq = torch.maximum(-adv * s, -adv * s.clamp(1 - clip_low, 1 + clip_high))  # [N]
    return per_seq.mean()


def test_gspo_token_equals_sequence_level_with_shared_advantages() -> None:
    # One advantage per row + seq-mean-token-mean: same value and gradient as sequence GSPO.
    # With this seed s = [1.027, 1.072, .979, .968, .982, 1.037] and A = [1.73, -.13, -.84, .99,
    # -.01, -.09]: a 0.02 clip catches rows 0 (A > 0, s > 1.02) and 2 (A < 0, s < .98) only.
    gen = torch.Generator().manual_seed(0)
    logp = (-torch.rand(6, 5, generator=gen)).requires_grad_()  # [N, T]
    old_logp = logp.detach() + 0.1 * torch.randn(6, 5, generator=gen)  # [N, T]
    mask = torch.rand(6, 5, generator=gen) < 0.7  # [N, T]
    mask[:, 0] = True
    adv = torch.randn(6, generator=gen)  # [N]
    loss_mat, _ = gspo_loss(logp, old_logp, adv, mask, clip_low=0.02, clip_high=0.02)
    token = agg_loss(loss_mat, mask, "seq-mean-token-mean")  # []
    seq = _sequence_level_gspo(logp, old_logp, adv, mask, 0.02, 0.02)  # []
    torch.testing.assert_close(token, seq)
    (g_token,) = torch.autograd.grad(token, logp)
    (g_seq,) = torch.autograd.grad(seq, logp)
    torch.testing.assert_close(g_token, g_seq)
    row_has_grad = g_seq.abs().sum(-1) > 0  # [N]
    assert row_has_grad.tolist() == [False, True, False, True, True, True]


# --- CISPO -------------------------------------------------------------------------------

# logp = -1, so -sg(clip(w)) * A * logp = clip(w) * A. Defaults (10, 0.2): bounds [-9, 1.2].
# w = [1.5, 0.5] with A = +1 -> [1.2, 0.5]; with A = -2 -> [-2.4, -1.0].
CISPO_RATIOS = [[1.5, 0.5], [1.5, 0.5]]
CISPO_ADV = torch.tensor([1.0, -2.0])  # [N]


def test_cispo_values_and_metrics() -> None:
    logp, old_logp = _logps(CISPO_RATIOS)
    loss, metrics = cispo_loss(logp, old_logp, CISPO_ADV, torch.ones(2, 2))
    torch.testing.assert_close(loss, torch.tensor([[1.2, 0.5], [-2.4, -1.0]]))
    # Half of the weights exceed 1.2; none is below -9.
    assert metrics["clip_frac_high"].item() == 0.5
    assert metrics["clip_frac_low"].item() == 0.0


def test_cispo_keeps_gradient_on_clipped_tokens() -> None:
    # d/dlogp of -sg(clip(w)) * A * logp = -clip(w) * A: [-1.2, -.5] and [2.4, 1.0]. The
    # token with w = 1.5 > 1.2 and A > 0, where PPO's gradient is 0, keeps -1.2.
    logp, old_logp = _logps(CISPO_RATIOS)
    loss, _ = cispo_loss(logp, old_logp, CISPO_ADV, torch.ones(2, 2))
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -0.5], [2.4, 1.0]]))


def test_cispo_ignores_dual_clip() -> None:
    logp, old_logp = _logps(CISPO_RATIOS)
    plain, _ = cispo_loss(logp, old_logp, CISPO_ADV, torch.ones(2, 2))
    dual, _ = cispo_loss(logp, old_logp, CISPO_ADV, torch.ones(2, 2), dual_clip=3.0)
    torch.testing.assert_close(plain, dual)


# --- shared contract ---------------------------------------------------------------------


@pytest.mark.parametrize("fn", POLICY_LOSSES)
def test_policy_losses_share_one_signature(fn: PolicyLossFn) -> None:
    params = inspect.signature(fn).parameters
    assert list(params) == "logp old_logp advantages mask clip_low clip_high dual_clip".split()
    keyword_only = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keyword_only == ["clip_low", "clip_high", "dual_clip"]


@pytest.mark.parametrize("fn", POLICY_LOSSES)
def test_padding_with_non_finite_logp_gives_finite_loss_and_zero_grad(fn: PolicyLossFn) -> None:
    logp = torch.tensor([[-1.0, -math.inf]], requires_grad=True)  # [N, T]
    old_logp = torch.tensor([[-1.2, math.nan]])  # [N, T]
    mask = torch.tensor([[1, 0]])  # [N, T]
    loss, metrics = fn(logp, old_logp, torch.ones(1), mask, clip_low=0.2, clip_high=0.2)
    assert loss[0, 1].item() == 0.0 and torch.isfinite(loss).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.isfinite(grad).all() and grad[0, 1].item() == 0.0


@pytest.mark.parametrize("fn", POLICY_LOSSES)
def test_per_token_advantages_match_broadcast_row_advantages(fn: PolicyLossFn) -> None:
    logp, old_logp = _logps(PPO_RATIOS)
    row, _ = fn(logp, old_logp, PPO_ADV, PPO_MASK, clip_low=0.2, clip_high=0.2)
    token_adv = PPO_ADV[:, None].expand(2, 3)  # [N, T]
    token, _ = fn(logp, old_logp, token_adv, PPO_MASK, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(row, token)
    with pytest.raises(ValueError, match="advantages"):
        fn(logp, old_logp, torch.ones(2, 2), PPO_MASK, clip_low=0.2, clip_high=0.2)


# --- value loss (spec §8.7) ------------------------------------------------------------------

# Three valid tokens (a, b | c); padding holds 7 and 5, which must not count.
V = torch.tensor([[0.9, 0.2, 7.0], [-0.3, 5.0, 5.0]])  # [N, T]
V_OLD = torch.tensor([[0.2, 0.1, 0.0], [0.0, 0.0, 0.0]])  # [N, T]
RET = torch.tensor([[1.0, 0.5, 0.0], [0.5, 0.0, 0.0]])  # [N, T]
V_MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # [N, T]


def test_value_loss_clipped_hand_values_and_gradient() -> None:
    # eps_v = 0.5. a: V = 0.9 leaves [0.2 - 0.5, 0.2 + 0.5], clipped to 0.7:
    #   (0.9 - 1)^2 = 0.01 < (0.7 - 1)^2 = 0.09 -> 0.09, clipped term wins, gradient 0.
    # b: V = 0.2 inside [-0.4, 0.6]: both terms (0.2 - 0.5)^2 = 0.09.
    # c: V = -0.3 inside [-0.5, 0.5]: (-0.3 - 0.5)^2 = 0.64.
    # loss = 0.5 * (0.09 + 0.09 + 0.64) / 3 = 0.136667; clip fraction 1/3.
    # dL/dV_b = 0.5 * 2 * (0.2 - 0.5) / 3 = -0.1; dL/dV_c = 0.5 * 2 * (-0.8) / 3 = -0.266667.
    values = V.clone().requires_grad_(True)
    loss, metrics = value_loss(values, V_OLD, RET, V_MASK, clip_range=0.5)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.82 / 6))
    torch.testing.assert_close(metrics["value_clip_frac"], torch.tensor(1 / 3))
    torch.testing.assert_close(metrics["value_mean"], torch.tensor(0.8 / 3))
    expected_grad = torch.tensor([[0.0, -0.1, 0.0], [-0.8 / 3, 0.0, 0.0]])
    torch.testing.assert_close(values.grad, expected_grad)


def test_value_loss_without_clipping_is_half_the_mse() -> None:
    # 0.5 * (0.01 + 0.09 + 0.64) / 3 = 0.123333: token a is no longer clipped.
    loss, metrics = value_loss(V, V_OLD, RET, V_MASK, clip_range=None)
    torch.testing.assert_close(loss, torch.tensor(0.74 / 6))
    assert float(metrics["value_clip_frac"]) == 0.0


def test_value_loss_ignores_nonfinite_padding() -> None:
    values = V.clone()
    values[0, 2] = float("nan")
    values[1, 1:] = float("inf")
    values.requires_grad_(True)
    loss, _ = value_loss(values, V_OLD, RET, V_MASK)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.82 / 6))
    assert torch.isfinite(values.grad).all()
