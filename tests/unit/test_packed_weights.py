"""``cpu_linear.packed_weights``: no-grad bf16 products on weights packed once for oneDNN, inside
``weights_cast_once`` blocks, where ``fast_paths`` chose them."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.device import cpu_linear, fast_paths, prepare_model, weights_cast_once
from rlvr_lightning.testing import tiny_policy

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN linear kernel")

PACKED = {f"{cpu_linear.NOGRAD_PATH}/bfloat16": "prepacked"}


def _logits(model, ids):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(ids).logits
        with weights_cast_once("cpu"):
            packed = model(ids).logits
            stored = len(cpu_linear._packing["weights"])
    return plain, packed, stored


def test_packed_products_give_torch_s_values_and_live_only_inside_the_block():
    model, _ = tiny_policy(seed=0)
    prepare_model(model, "cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    linears = [
        m for m in model.modules() if "forward" in vars(m) and isinstance(m, torch.nn.Linear)
    ]
    with fast_paths.forced(PACKED):
        plain, packed, stored = _logits(model, ids)
    assert stored == len(linears) > 0  # one packed copy per routed linear
    assert cpu_linear._packing["dtype"] is None and not cpu_linear._packing["weights"]
    # Both accumulate in fp32 and round to bf16: the logits agree to bf16 rounding.
    torch.testing.assert_close(packed.float(), plain.float(), rtol=2e-2, atol=2e-2)
    with fast_paths.forced({f"{cpu_linear.NOGRAD_PATH}/bfloat16": "torch"}):
        _, again, stored = _logits(model, ids)
    assert stored == 0 and torch.equal(again, plain)


def test_a_changed_weight_is_packed_again_and_grad_never_takes_the_route():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 16, generator=gen), torch.randn(8, 16, generator=gen)
    with fast_paths.forced(PACKED), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad(), cpu_linear.packed_weights(torch.bfloat16):
            first = cpu_linear.linear(x, w)
            w.mul_(2)  # in place: a new version
            second = cpu_linear.linear(x, w)
        torch.testing.assert_close(second.float(), 2 * first.float(), rtol=1e-2, atol=1e-2)
        leaf = w.clone().requires_grad_()
        with cpu_linear.packed_weights(torch.bfloat16):
            out = cpu_linear.linear(x, leaf)
            assert not cpu_linear._packing["weights"] and out.grad_fn is not None
