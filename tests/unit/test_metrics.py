import pytest
import torch

from rlvr_lightning.algorithms.metrics import PassAtK, pass_at_k


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
