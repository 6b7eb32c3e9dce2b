"""Memory-lean forms of a Llama-style decoder layer's RMSNorms and SwiGLU MLP, for the update.

Plain autograd keeps more than the backward needs. ``weight * (x * rsqrt(mean(x^2) + eps))``
keeps ``x`` and the normalised ``x``; ``down(silu(gate) * up)`` keeps ``gate``, ``silu(gate)``,
``up`` and their product. Under autocast each consumer of a norm's fp32 output (q, k, v; gate,
up) also keeps its own bf16 copy. :func:`install` gives each qualifying decoder layer:

- ``rms_norm``: keeps ``x`` and ``1 / rms``; under autocast it returns its output already cast to
  the autocast dtype when every consumer is a plain ``nn.Linear`` (which would cast it anyway),
  so one copy is kept instead of three (attention) or two (MLP).
- ``swiglu_down``: keeps ``gate`` and ``up``; the product is recomputed in the backward.

The forward values are those of the original modules, which run unchanged when autograd is not
recording (generation, reference passes) and whenever a module stops qualifying (e.g. a LoRA
layer replaced a projection). Measured on the embedded model (bf16 autocast, one 16-row
micro-batch of the benchmark's update): see ``benchmarks/README.md``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from rlvr_lightning.device import cpu_linear

_ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj")
_MLP_INPUTS = ("gate_proj", "up_proj")


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` would compute in: autocast's when it is on, else promotion."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


class _RMSNorm(torch.autograd.Function):
    """``(weight * (x / rms(x)).to(x.dtype)).to(out_dtype)``, keeping ``x`` and ``1 / rms``."""

    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        with torch.autocast(x.device.type, enabled=False):
            xf = x.float()  # [..., H]
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
            y = weight * (xf * rstd).to(x.dtype)  # [..., H]
        ctx.save_for_backward(x, rstd, weight)
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, grad):
        # n = x * r, y = w * n: dx = r * (g_n - n * mean(g_n * n)), g_n = g * w
        x, rstd, weight = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            n = x.float() * rstd  # [..., H]
            g = grad.float()  # [..., H]
            grad_w = (g * n.to(x.dtype)).reshape(-1, n.shape[-1]).sum(0)  # [H]
            g_n = g * weight.float()
            grad_x = rstd * (g_n - n * (g_n * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None, None


class _SwiGLUDown(torch.autograd.Function):
    """``down(silu(gate) * up)`` in ``dtype``, keeping ``gate`` and ``up`` only."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, dtype):
        with torch.autocast(gate.device.type, enabled=False):
            act = F.silu(gate.to(dtype)) * up.to(dtype)  # [..., I]
            out = cpu_linear.linear(act, weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(gate, up, weight, bias)
        ctx.dtype = dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight, bias = ctx.saved_tensors
        need_gate, need_up, need_w, need_b = ctx.needs_input_grad[:4]
        with torch.autocast(gate.device.type, enabled=False):
            g = grad.to(ctx.dtype)  # [..., H]
            gate_c, up_c = gate.to(ctx.dtype), up.to(ctx.dtype)  # [..., I]
            silu = F.silu(gate_c)
            w = weight.to(ctx.dtype)  # [H, I]
            flat = g.reshape(-1, g.shape[-1])  # [n, H]
            act = (silu * up_c).reshape(-1, up.shape[-1]) if need_w else None  # [n, I]
            if cpu_linear.usable(g, w):
                g_act = cpu_linear.mm_nt(flat, w.t()).view(*g.shape[:-1], w.shape[1])
                grad_w = cpu_linear.mm_nt(flat.t(), act.t()) if need_w else None
            else:
                g_act = g @ w  # [..., I]
                grad_w = flat.T @ act if need_w else None
            grad_b = flat.sum(0) if need_b else None  # [H]
            grad_up = (g_act * silu).to(up.dtype) if need_up else None
            grad_gate = torch.ops.aten.silu_backward(g_act * up_c, gate_c) if need_gate else None
        return (
            None if grad_gate is None else grad_gate.to(gate.dtype),
            grad_up,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """Llama's RMSNorm of ``x`` ``[..., H]`` (``weight`` ``[H]``), cast to ``out_dtype``."""
    return _RMSNorm.apply(x, weight, eps, out_dtype)


def swiglu_down(
    gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(silu(gate) * up, weight, bias)`` (``gate``, ``up``: ``[..., I]``; ``weight``:
    ``[H, I]``) in the dtype ``nn.Linear`` would use."""
    return _SwiGLUDown.apply(gate, up, weight, bias, _compute_dtype(gate, weight))


def _plain_linear(module: object) -> bool:
    return type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks


def _norm_forward(norm: nn.Module, parent: nn.Module, consumers: tuple[str, ...], x):
    if not torch.is_grad_enabled() or _hooked(norm):
        return type(norm).forward(norm, x)
    out_dtype = torch.promote_types(x.dtype, norm.weight.dtype)
    if torch.is_autocast_enabled(x.device.type) and all(
        _plain_linear(getattr(parent, name, None)) for name in consumers
    ):
        out_dtype = torch.get_autocast_dtype(x.device.type)
    return rms_norm(x, norm.weight, norm.variance_epsilon, out_dtype)


def _mlp_forward(mlp: nn.Module, x):
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if not torch.is_grad_enabled() or _hooked(mlp) or not all(map(_plain_linear, projections)):
        return type(mlp).forward(mlp, x)
    down = mlp.down_proj
    return swiglu_down(mlp.gate_proj(x), mlp.up_proj(x), down.weight, down.bias)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _same_values(module: nn.Module, lean, width: int) -> bool:
    """Whether ``lean(x)`` equals the module's own forward on a random fp32 ``[3, width]``."""
    weight = next(module.parameters())
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(weight.device)
    with torch.no_grad():
        expected = type(module).forward(module, x.to(weight.dtype))
    with torch.enable_grad(), cpu_linear.disabled():  # the lean arithmetic, on F.linear
        got = lean(x.to(weight.dtype)).detach()
    return got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)


def _lean_norm(norm: object, parent: nn.Module, consumers: tuple[str, ...]) -> bool:
    if not (
        isinstance(norm, nn.Module)
        and type(norm).__name__.endswith("RMSNorm")
        and "forward" not in vars(norm)
        and isinstance(getattr(norm, "weight", None), torch.Tensor)
        and norm.weight.dim() == 1
        and isinstance(getattr(norm, "variance_epsilon", None), float)
    ):
        return False
    lean = functools.partial(_norm_forward, norm, parent, consumers)
    if not _same_values(norm, lean, norm.weight.shape[0]):
        return False
    norm.forward = lean
    return True


def _lean_mlp(mlp: object) -> bool:
    names = ("gate_proj", "up_proj", "down_proj")
    if not (
        isinstance(mlp, nn.Module)
        and "forward" not in vars(mlp)
        and all(_plain_linear(getattr(mlp, n, None)) for n in names)
        and isinstance(getattr(mlp, "act_fn", None), nn.SiLU | _silu_types())
    ):
        return False
    lean = functools.partial(_mlp_forward, mlp)
    if not _same_values(mlp, lean, mlp.gate_proj.in_features):
        return False
    mlp.forward = lean
    return True


def _silu_types() -> type:
    from transformers.activations import SiLUActivation

    return SiLUActivation


def install(model: nn.Module) -> int:
    """Give every Llama-style decoder layer of ``model`` (a module with ``input_layernorm``,
    ``self_attn``, ``post_attention_layernorm`` and ``mlp``) the lean norms and MLP; modules of
    another form, or whose forward values differ from the lean ones, are left as they are.
    Returns the number of modules switched."""
    switched = 0
    for layer in list(model.modules()):
        if not all(
            hasattr(layer, a)
            for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        ):
            continue
        switched += _lean_norm(layer.input_layernorm, layer.self_attn, _ATTENTION_INPUTS)
        switched += _lean_norm(layer.post_attention_layernorm, layer.mlp, _MLP_INPUTS)
        switched += _lean_mlp(layer.mlp)
    return switched
