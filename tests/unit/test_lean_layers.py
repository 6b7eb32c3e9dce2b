"""``lean_layers``: the RMSNorm and SwiGLU functions against plain autograd (fp32 and bf16
autocast), what they keep for the backward, and when ``install`` leaves a module alone."""

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rlvr_lightning.device import lean_layers
from rlvr_lightning.device.lean_layers import rms_norm, swiglu_down
from rlvr_lightning.models import load_policy
from rlvr_lightning.testing import tiny_policy


def _plain_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_rms_norm_by_hand():
    # x = (3, 4): mean square 12.5, rms 3.5355; weight (1, 2): (3 / 3.5355, 8 / 3.5355)
    y = rms_norm(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, 2.0]), 0.0, torch.float32)
    assert torch.allclose(y, torch.tensor([[3 / math.sqrt(12.5), 8 / math.sqrt(12.5)]]))


def test_rms_norm_values_and_gradients_match_plain_autograd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True)
    up = torch.randn(2, 5, 8, generator=g)  # an arbitrary upstream gradient
    got = rms_norm(x, w, 1e-6, torch.float32)
    grads = torch.autograd.grad((got * up).sum(), (x, w))
    ref = _plain_norm(x, w, 1e-6)
    ref_grads = torch.autograd.grad((ref * up).sum(), (x, w))
    torch.testing.assert_close(got, ref)
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_rms_norm_under_autocast_is_the_cast_its_consumers_would_make():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    proj = torch.randn(16, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = rms_norm(x, w, 1e-6, torch.bfloat16)
        out = F.linear(got, proj)  # the consumer: a cast is a no-op now
        ref_out = F.linear(_plain_norm(x, w, 1e-6), proj)  # autocast casts the fp32 norm
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _plain_norm(x, w, 1e-6).detach().to(torch.bfloat16))
    assert torch.equal(out, ref_out)
    grads = torch.autograd.grad(out.float().sum(), (x, w))
    ref_grads = torch.autograd.grad(ref_out.float().sum(), (x, w))
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_down_values_and_gradients_match_plain_autograd(bias):
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(3, 4, 12, generator=g, requires_grad=True)
    up = torch.randn(3, 4, 12, generator=g, requires_grad=True)
    w = torch.randn(6, 12, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True) if bias else None
    upstream = torch.randn(3, 4, 6, generator=g)
    inputs = tuple(t for t in (gate, up, w, b) if t is not None)
    got = swiglu_down(gate, up, w, b)
    grads = torch.autograd.grad((got * upstream).sum(), inputs)
    ref = F.linear(F.silu(gate) * up, w, b)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)
    torch.testing.assert_close(got, ref)
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_swiglu_down_under_autocast_matches_the_autocast_ops():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g, requires_grad=True)
    wg, wu = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    w = torch.randn(16, 24, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gate, up = F.linear(x, wg), F.linear(x, wu)  # bf16, as the projections give them
        got = swiglu_down(gate, up, w, None)
        ref = F.linear(F.silu(gate) * up, w)
    assert got.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(got, ref)
    grads = torch.autograd.grad(got.float().sum(), (x, w), retain_graph=True)
    ref_grads = torch.autograd.grad(ref.float().sum(), (x, w))
    assert grads[1].dtype == torch.float32
    for a, e in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, e, atol=1e-2, rtol=1e-2)


def _saved_bytes(model, ids):
    """Bytes of the tensors the forward keeps for the backward (parameters excluded)."""
    params = {p.data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids).logits.float().logsumexp(-1).sum()
    return loss, sum(seen.values())


@pytest.mark.parametrize("autocast", [False, True])
def test_install_keeps_the_tiny_llamas_values_and_gradients_and_keeps_less(autocast):
    plain, _ = tiny_policy(seed=0, layers=3)
    lean = copy.deepcopy(plain)
    assert lean_layers.install(lean) == 9  # two norms and the MLP of each of the 3 layers
    ids = torch.randint(3, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (plain, lean):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, kept = _saved_bytes(model, ids)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((loss, kept, grads))
    (loss_p, kept_p, grads_p), (loss_l, kept_l, grads_l) = results
    tol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(loss_l, loss_p, atol=tol, rtol=tol)
    for a, e in zip(grads_l, grads_p, strict=True):
        torch.testing.assert_close(a, e, atol=tol, rtol=tol)
    # per layer and token: fp32 (bf16 with autocast) gate*silu, product and a normalised x
    # are no longer kept, nor under autocast the extra bf16 casts of the norms' outputs
    assert kept_l < 0.8 * kept_p


def test_no_grad_and_replaced_projections_run_the_original_forwards(monkeypatch):
    model, _ = tiny_policy(seed=0)
    lean_layers.install(model)
    used = []
    real_norm, real_mlp = lean_layers.rms_norm, lean_layers.swiglu_down
    monkeypatch.setattr(lean_layers, "rms_norm", lambda *a: used.append("norm") or real_norm(*a))
    monkeypatch.setattr(lean_layers, "swiglu_down", lambda *a: used.append("mlp") or real_mlp(*a))
    ids = torch.randint(3, 250, (1, 6))
    with torch.no_grad():
        model(input_ids=ids)
    assert used == []
    layer = model.model.layers[0]
    seen_dtypes = []
    layer.self_attn.q_proj = nn.Sequential(layer.self_attn.q_proj)  # e.g. a LoRA wrapper
    layer.mlp.down_proj = nn.Sequential(layer.mlp.down_proj)
    layer.self_attn.register_forward_pre_hook(
        lambda _m, _a, kw: seen_dtypes.append(kw["hidden_states"].dtype), with_kwargs=True
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    assert seen_dtypes == [torch.float32]  # q_proj is not a plain Linear: no early cast
    assert used.count("mlp") == 1  # layer 1's MLP only; layer 0's runs its own forward
    assert used.count("norm") == 2 * len(model.model.layers)


class _OnePlusRMSNorm(nn.Module):  # Gemma's form: (1 + weight) * x / rms(x)
    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_modules_of_another_form_are_left_alone():
    model, _ = tiny_policy(seed=0, layers=1)
    layer = model.model.layers[0]
    layer.input_layernorm = _OnePlusRMSNorm(model.config.hidden_size)
    layer.mlp.act_fn = nn.GELU()
    assert lean_layers.install(model) == 1  # post_attention_layernorm only
    assert "forward" not in vars(layer.input_layernorm) and "forward" not in vars(layer.mlp)
    assert "forward" in vars(layer.post_attention_layernorm)


def test_load_policy_installs_and_mode_switches_keep_it():
    model, _ = load_policy("tiny:0")
    model.eval()
    model.train()
    for layer in model.model.layers:
        for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
            assert "forward" in vars(module)
