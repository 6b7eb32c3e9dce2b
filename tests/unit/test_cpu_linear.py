"""cpu_linear: fp32 products through oneDNN, equal to F.linear to fp32 rounding."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rlvr_lightning.device import cpu_linear, fast_paths
from rlvr_lightning.device.forward import fused_head
from rlvr_lightning.testing import tiny_policy

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN linear kernel")


@pytest.fixture(autouse=True)
def onednn_chosen():
    """These tests check the oneDNN route itself: it runs whatever this machine would choose."""
    with fast_paths.forced({"linear/float32": "onednn"}):
        yield


def _operands(bias: bool = True):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 24, generator=gen)
    w = torch.randn(40, 24, generator=gen) / 5
    b = torch.randn(40, generator=gen) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_f_linear(bias):
    x, w, b = _operands(bias)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    refs = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    got = cpu_linear.linear(*leaves, *([] if bias else [None]))
    want = F.linear(*refs, *([] if bias else [None]))
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    got.backward(grad)
    want.backward(grad)
    assert got.shape == (3, 5, 40) and got.grad_fn is not None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, e in zip(leaves, refs, strict=True):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-5, atol=1e-5)


def test_a_frozen_weight_gets_no_gradient_and_no_grad_builds_no_graph():
    x, w, b = _operands()
    x = x.requires_grad_()
    cpu_linear.linear(x, w, b).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand_as(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert cpu_linear.linear(x, w, b).grad_fn is None


def test_strided_views_are_taken_as_they_are():
    gen = torch.Generator().manual_seed(2)
    g, w = torch.randn(7, 9, generator=gen), torch.randn(9, 4, generator=gen)
    x = torch.randn(7, 4, generator=gen)
    torch.testing.assert_close(cpu_linear.mm_nt(g, w.t()), g @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu_linear.mm_nt(g.t(), x.t()), g.t() @ x, rtol=1e-5, atol=1e-5)


def test_autocast_and_other_dtypes_keep_f_linear():
    x, w, b = _operands()
    assert not cpu_linear.usable(x.double(), w.double())
    assert torch.equal(cpu_linear.linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not cpu_linear.usable(x, w)
        got = cpu_linear.linear(x, w, b)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, F.linear(x, w, b))


def test_install_switches_the_linears_but_not_the_lm_head(monkeypatch):
    model, _ = tiny_policy(seed=0)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    head = model.get_output_embeddings()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids).logits
    assert cpu_linear.install(model) == len([m for m in linears if m is not head]) > 0
    assert "forward" not in vars(head) and fused_head(model) is head  # still bypassable
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    assert cpu_linear.install(model) == 0  # already switched
    x = torch.randn(2, linears[0].in_features)
    monkeypatch.setattr(cpu_linear, "available", lambda: False)  # a build without oneDNN
    assert torch.equal(linears[0](x), F.linear(x, linears[0].weight, linears[0].bias))


def test_disabled_blocks_use_f_linear_and_bf16_never_asks_for_onednn(monkeypatch):
    x, w, b = _operands()
    with cpu_linear.disabled():
        assert not cpu_linear.usable(x, w)
        assert torch.equal(cpu_linear.linear(x, w, b), F.linear(x, w, b))
    assert cpu_linear.usable(x, w)
    asked = []
    monkeypatch.setattr(cpu_linear, "available", lambda: asked.append(1) or True)
    model, _ = tiny_policy(seed=0)
    cpu_linear.install(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.tensor([[5, 6, 7]]))
    assert asked == []  # a first fp32 oneDNN call would change later bf16 matmuls


def test_availability_is_judged_in_fp32_when_first_asked_under_bf16_autocast() -> None:
    from rlvr_lightning.device import cpu_linear

    cpu_linear.available.cache_clear()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = cpu_linear.available()
        cpu_linear.available.cache_clear()
        assert inside == cpu_linear.available()
    finally:
        cpu_linear.available.cache_clear()
