import pytest
import torch

from rlvr_lightning.algorithms.metrics import PassAtK, mean_interval, pass_at_k


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # k=1 is the plain accuracy c/n
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_pass_at_k_metric_averages_prompts():
    m = PassAtK(k=2)
    m.update(torch.tensor([[True, False, False, False], [False, False, False, False]]))
    # prompt 1: 0.5 (above); prompt 2: 0 -> mean 0.25
    assert float(m.compute()) == pytest.approx(0.25)


def test_pass_at_k_interval_by_hand():
    # n = 4 samples, k = 4, correct counts [4, 0, 2, 1] -> per-prompt pass@4 = [1, 0, 1, 1].
    # mean 0.75; s^2 = (3 * 0.25^2 + 0.75^2) / 3 = 0.25, s = 0.5; half = 1.959964 * 0.5 / 2
    # = 0.489991 -> [0.260009, 1.239991 clipped to 1].
    metric = PassAtK(4)
    metric.update(torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]]).bool())
    assert float(metric.compute()) == pytest.approx(0.75)
    summary = metric.summary()
    assert summary["ci95_low"] == pytest.approx(0.260009, abs=1e-6)
    assert summary["ci95_high"] == 1.0
    assert (summary["prompts"], summary["samples"]) == (4.0, 16.0)
    # k = 1 on the same rows: [1, 0, 0.5, 0.25], mean 0.4375, s^2 = (0.31640625 + 0.19140625
    # + 0.00390625 + 0.03515625) / 3 = 0.182292, half = 1.959964 * sqrt(0.182292 / 4) = 0.418410.
    assert mean_interval(1.75, 1.3125, 4) == pytest.approx((0.019090, 0.855910), abs=1e-6)
    assert all(v != v for v in mean_interval(1.0, 1.0, 1))  # one prompt: NaN, no interval
