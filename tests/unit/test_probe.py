"""POISE probe maths (spec §7.1) against hand-computed values."""

from __future__ import annotations

import io

import pytest
import torch

from rlvr_lightning.heads.probe import (
    RidgeProbe,
    fit_quality,
    pca_basis,
    poise_advantages,
    ridge_fit,
    rows_to_drop,
    sibling_mean,
)


def test_sibling_mean_excludes_the_row_itself() -> None:
    # [1, 0, 0 | .5, .5, 1], G = 3: row 0 sees (0 + 0) / 2 = 0, row 1 (1 + 0) / 2 = .5, ...
    x = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 1.0])  # [N]
    torch.testing.assert_close(sibling_mean(x, 3), torch.tensor([0.0, 0.5, 0.5, 0.75, 0.75, 0.5]))
    with pytest.raises(ValueError, match="group_size >= 2"):
        sibling_mean(x, 1)


def test_poise_advantages_use_the_other_rollouts_prediction() -> None:
    # G = 2: A_1 = r_1 - g(z_2) = 1 - 0.6 = 0.4; A_2 = r_2 - g(z_1) = 0 - 0.2 = -0.2.
    out = poise_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0.2, 0.6]), 2)
    torch.testing.assert_close(out, torch.tensor([0.4, -0.2]))


def test_ridge_fit_hand_values() -> None:
    # x = [0, 1, 2], y = [1, 3, 5]. alpha = 0: w = 2, b = 1. alpha = 1: centred x = [-1, 0, 1],
    # sum x^2 = 2, sum x*y_c = (-1)(-2) + 0 + (1)(2) = 4 -> w = 4 / 3, b = 3 - 1 * 4/3 = 5/3.
    x, y = torch.tensor([[0.0], [1.0], [2.0]]), torch.tensor([1.0, 3.0, 5.0])
    w, b = ridge_fit(x, y, alpha=0.0)
    torch.testing.assert_close((w, b), (torch.tensor([2.0]), torch.tensor(1.0)))
    w, b = ridge_fit(x, y, alpha=1.0)
    torch.testing.assert_close((w, b), (torch.tensor([4 / 3]), torch.tensor(5 / 3)))


def test_pca_basis_finds_the_line_and_zero_pads() -> None:
    # Points on the diagonal: mean [2, 2], first direction ±[1, 1] / sqrt(2); only one
    # direction has variance, and asking for 3 of 2 dims leaves the third column 0.
    x = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])  # [M, D]
    mean, comps = pca_basis(x, 3)  # [D], [D, 3]
    torch.testing.assert_close(mean, torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(comps[:, 0].abs(), torch.full((2,), 2**-0.5))
    assert torch.equal(comps[:, 2], torch.zeros(2))


def test_ridge_probe_recovers_a_linear_target_clips_and_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    prompt_h, response_h = torch.randn(64, 6, generator=gen), torch.randn(64, 5, generator=gen)
    scalars = torch.randn(64, 1, generator=gen)  # [M, S]
    target = 0.5 + 0.1 * prompt_h[:, 0] - 0.1 * response_h[:, 1] + 0.05 * scalars[:, 0]
    probe = RidgeProbe(6, 5, 1, prompt_pca=6, response_pca=5, alpha=1e-6)
    with pytest.raises(RuntimeError, match="before fit"):
        probe(prompt_h, response_h, scalars)
    probe.fit(prompt_h, response_h, scalars, target)
    pred = probe(prompt_h, response_h, scalars)  # [M]
    torch.testing.assert_close(pred, target.clamp(0, 1), atol=1e-4, rtol=1e-4)
    assert float(probe(prompt_h * 100, response_h, scalars).max()) <= 1.0
    buffer = io.BytesIO()
    torch.save(probe.state_dict(), buffer)
    buffer.seek(0)
    restored = RidgeProbe(6, 5, 1, prompt_pca=6, response_pca=5)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(restored(prompt_h, response_h, scalars), pred)


def test_fit_quality_hand_values() -> None:
    # target [0, 1, 2], pred [0, 1, 1]: resid = 1, total = 2 -> R² = 0.5. Centred pred
    # [-2/3, 1/3, 1/3], target [-1, 0, 1]: dot = 2/3 + 1/3 = 1, |p| = sqrt(6/9), |t| = sqrt(2)
    # -> r = 1 / sqrt(12/9) = sqrt(3) / 2.
    r2, corr = fit_quality(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 2.0]))
    assert r2 == pytest.approx(0.5) and corr == pytest.approx(3**0.5 / 2)
    assert fit_quality(torch.ones(3), torch.ones(3)) == (0.0, 0.0)  # no variance: 0, not NaN


def test_rows_to_drop_never_splits_a_group() -> None:
    groups = torch.tensor([0, 0, 1, 1, 2, 2])  # [M], oldest first
    assert rows_to_drop(groups, 0) == 0
    assert rows_to_drop(groups, 1) == 2  # cutting into group 0 takes all of it
    assert rows_to_drop(groups, 2) == 2
    assert rows_to_drop(groups, 3) == 4  # group 1 too
    assert rows_to_drop(groups, 9) == 6


def test_ridge_probe_clips_to_its_range() -> None:
    probe = RidgeProbe(1, 1, 1, prompt_pca=1, response_pca=1, alpha=1e-6, low=0.0, high=1.5)
    x = torch.tensor([[0.0], [1.0], [2.0]])  # [M, 1]
    probe.fit(x, x, torch.zeros(3, 1), torch.tensor([0.0, 1.0, 2.0]))
    assert torch.allclose(probe(x, x, torch.zeros(3, 1)), torch.tensor([0.0, 1.0, 1.5]), atol=1e-4)
