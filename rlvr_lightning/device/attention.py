"""Grouped-query attention as two matmuls on the CPU, registered with ``transformers``.

PyTorch's bf16 CPU ``scaled_dot_product_attention`` kernels are slow for the shapes of RL on
small models: one query token per row while decoding, ~100-token rows in the update. Measured on
2 AMD EPYC cores (torch 2.13, 64 rows, 9 query / 3 key-value heads, 120 keys, one query): SDPA
takes 3.0 ms in bf16 against 0.4 ms for the matmuls below, and the forward+backward of a
16-row update block is 4-5x faster; with the embedded model, generation runs 1.42x faster
(``benchmarks/attention.py``). In fp32 the two are as fast within this machine's noise
(0.97x generation and 1.04x update time in that benchmark; 24.6-26.3 s against 26.6-28.2 s per
``vs_trl.py`` step), and the matmuls keep less for the backward than SDPA with a padding mask,
which copies the keys and values per query head (``vs_trl.py`` fp32 peak 4.51-4.74 GiB against
4.80-4.86 GiB). ``"rlvr_grouped"`` computes

    softmax(q k^T * scale + mask) v

with the query heads of each key/value head stacked into one matmul (no copy of the keys and
values per query head), the softmax in fp32, when the matmuls run in a ``MATMUL_DTYPES`` dtype
(autocast's, else the query's). It falls back to ``transformers``' SDPA function for other
dtypes, off the CPU, for features it does not implement (logit soft-capping, attention sinks,
position biases, dropout in training), and when the score matrix of a layer would exceed
``MAX_SCORES`` elements (the matmuls build it whole; SDPA's kernels work in tiles). With
autograd recording it keeps only ``q``, ``k``, ``v`` and the mask and recomputes the weights in
the backward (``_Attention``), as SDPA's kernels do: a 16-row update micro-batch of the embedded
model in bf16 otherwise kept ~130 MB of fp32 weights and their bf16 copies.

Those numbers hold for that CPU. Which path runs is measured per dtype (``fast_paths``): path
``"attention"`` (prefill and update, a forward and backward of ``MEASURE_ROWS`` causal rows of
``MEASURE_LENGTH`` tokens) and ``"attention.decode"`` (one query per row, ``DECODE_ROWS`` rows
reading ``MEASURE_LENGTH`` keys, some padded), each on the prepared model's heads, SDPA being
the reference: on a CPU whose SDPA kernels are fast (e.g. with AMX) SDPA stays.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlvr_lightning.device import fast_paths

NAME = "rlvr_grouped"
PATH, DECODE_PATH = "attention", "attention.decode"  # fast_paths' names: Q > 1, one query

# Largest score matrix (rows x query heads x queries x keys) computed as matmuls; above it,
# SDPA. 2**21 fp32 scores are 8 MiB: this project's choice, so that the update of a 64-row
# micro-batch of ~100-token rows stays on the fast path while long sequences do not build
# O(length^2) blocks.
MAX_SCORES = 2**21

# Dtypes the matmul path runs in (fp64, e.g. gradcheck, keeps SDPA).
MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def grouped_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``([B, Q, H, D] output, None)``, the signature of ``transformers`` attention functions.

    Args:
        query: ``[B, H, Q, D]``; key, value: ``[B, K, L, D]`` with ``H`` a multiple of ``K``.
        attention_mask: boolean ``[B, 1, Q, L]`` (True: attend), as ``sdpa_mask`` builds it, or
            None for a plain causal block (``Q == L``) or a single query.
    """
    b, h, q_len, d = query.shape
    k_heads, kv_len = key.shape[1], key.shape[2]
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
    plain = (
        query.device.type == "cpu"
        and dtype in MATMUL_DTYPES
        and not any(kwargs.get(name) is not None for name in _UNSUPPORTED)
        and not (dropout > 0 and module.training)
        and h % k_heads == 0
        and b * h * q_len * kv_len <= MAX_SCORES
        and (attention_mask is None or attention_mask.dtype == torch.bool)
        and (attention_mask is not None or q_len == 1 or q_len == kv_len)
    )
    path = DECODE_PATH if q_len == 1 else PATH
    if not plain or fast_paths.choice(path, dtype) != "grouped":
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _grouped(query, key, value, attention_mask, d**-0.5 if scaling is None else scaling)


def _grouped(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, None]:
    """The matmul path of :func:`grouped_attention` (its checks passed)."""
    b, h, q_len, d = query.shape
    k_heads, kv_len = key.shape[1], key.shape[2]
    g = h // k_heads
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
    if attention_mask is not None:
        allowed = attention_mask[:, :, None]  # [B, 1, 1, Q, L]
    elif q_len > 1:
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()
    else:
        allowed = None
    q = query.to(dtype).reshape(b, k_heads, g * q_len, d)  # query heads of one kv head stacked
    key, value = key.to(dtype), value.to(dtype)  # [B, K, L, D]
    with torch.autocast("cpu", enabled=False):
        if torch.is_grad_enabled() and (
            q.requires_grad or key.requires_grad or value.requires_grad
        ):
            out = _Attention.apply(q, key, value, allowed, scale, g)  # [B, K, g * Q, D]
        else:
            out = torch.matmul(_probs(q, key, allowed, scale, g).to(dtype).flatten(2, 3), value)
    return out.view(b, h, q_len, d).transpose(1, 2).contiguous(), None


def _probs(
    q: torch.Tensor, key: torch.Tensor, allowed: torch.Tensor | None, scale: float, g: int
) -> torch.Tensor:
    """fp32 ``[B, K, g, Q, L]`` attention weights of the stacked queries ``q`` ``[B, K, g * Q,
    D]``. A finite fill: a fully masked row (a padding query) gets uniform weights, not NaN."""
    b, k_heads, gq, _ = q.shape
    scores = torch.matmul(q, key.transpose(-1, -2)).view(b, k_heads, g, gq // g, -1)
    scores = scores.float() * scale  # [B, K, g, Q, L]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    return scores.softmax(-1)


class _Attention(torch.autograd.Function):
    """``softmax(q k^T * scale + mask) v`` keeping only ``q``, ``k``, ``v`` and the mask for the
    backward, which recomputes the weights (as SDPA's kernels do): the ``[B, H, Q, L]`` fp32
    weights and their low-precision copy are not kept per layer. The backward mirrors plain
    autograd on the forward's ops: fp32 softmax gradient, matmuls in the inputs' dtype."""

    @staticmethod
    def forward(ctx, q, key, value, allowed, scale, g):
        probs = _probs(q, key, allowed, scale, g).to(value.dtype).flatten(2, 3)  # [B, K, gQ, L]
        ctx.save_for_backward(q, key, value, allowed)
        ctx.scale, ctx.g = scale, g
        return torch.matmul(probs, value)  # [B, K, g * Q, D]

    @staticmethod
    def backward(ctx, d_out):
        q, key, value, allowed = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            probs = _probs(q, key, allowed, ctx.scale, ctx.g)  # [B, K, g, Q, L]
            d_out = d_out.to(value.dtype)  # [B, K, g * Q, D]
            d_value = probs.to(value.dtype).flatten(2, 3).transpose(-1, -2) @ d_out
            d_probs = (d_out @ value.transpose(-1, -2)).float().view_as(probs)
            d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True))
            if allowed is not None:
                d_scores = d_scores.masked_fill(~allowed, 0.0)
            d_scores = (d_scores * ctx.scale).to(q.dtype).flatten(2, 3)  # [B, K, g * Q, L]
            d_q = d_scores @ key  # [B, K, g * Q, D]
            d_key = d_scores.transpose(-1, -2) @ q  # [B, K, L, D]
        return d_q, d_key, d_value, None, None, None


def register() -> None:
    """Make ``"rlvr_grouped"`` a known attention implementation (with SDPA's boolean masks)."""
    AttentionInterface.register(NAME, grouped_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def prefer_grouped(model: nn.Module) -> None:
    """Switch a model that uses SDPA to ``"rlvr_grouped"`` (same results, faster on the CPU);
    any other implementation (eager, flash attention) is left as it is."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return
    register()
    model.set_attn_implementation(NAME)


def restore_sdpa(model: nn.Module) -> None:
    """Undo :func:`prefer_grouped`: a model switched to ``"rlvr_grouped"`` uses SDPA again."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == NAME:
        model.set_attn_implementation("sdpa")


# Shapes timed when choosing (this project's choice: 4 rows of an update micro-batch
# of ~96-token rows; the 64 rows of an 8 x 8 step decoding).
MEASURE_ROWS, MEASURE_LENGTH, DECODE_ROWS = 4, 96, 64


class _Layer(nn.Module):
    """What ``sdpa_attention_forward`` reads of an attention layer."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _trial(shapes: fast_paths.ModelShapes, dtype: torch.dtype) -> fast_paths.Trial:
    """SDPA against the matmuls on the model's heads (``PATH``: forward and backward)."""
    gen = torch.Generator().manual_seed(0)
    h, k, d, n, length = (
        shapes.heads,
        shapes.kv_heads,
        shapes.head_dim,
        MEASURE_ROWS,
        MEASURE_LENGTH,
    )
    q, key, value = (
        torch.randn(n, heads, length, d, generator=gen).to(dtype).requires_grad_()
        for heads in (h, k, k)
    )  # [B, H or K, L, D]
    mask = torch.ones(length, length, dtype=torch.bool).tril().expand(n, 1, length, length)
    grad = torch.randn(n, length, h, d, generator=gen).to(dtype)  # [B, L, H, D]
    layer = _Layer(h // k)

    def run(attend) -> tuple[torch.Tensor, ...]:
        with torch.enable_grad():
            out = attend(q, key, value, mask)
            return (out.detach(), *torch.autograd.grad(out, (q, key, value), grad))

    return fast_paths.Trial(tolerance=_tolerance(dtype), pieces=[(1.0, _works(layer, d, run))])


def _decode_trial(shapes: fast_paths.ModelShapes, dtype: torch.dtype) -> fast_paths.Trial:
    """SDPA against the matmuls for one query per row (``DECODE_PATH``, no autograd)."""
    gen = torch.Generator().manual_seed(0)
    h, k, d, n, length = shapes.heads, shapes.kv_heads, shapes.head_dim, DECODE_ROWS, MEASURE_LENGTH
    q = torch.randn(n, h, 1, d, generator=gen).to(dtype)  # [B, H, 1, D]
    key, value = (torch.randn(n, k, length, d, generator=gen).to(dtype) for _ in range(2))
    mask = torch.ones(n, 1, 1, length, dtype=torch.bool)
    mask[::2, ..., : length // 4] = False  # left padding in every other row

    def run(attend) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return (attend(q, key, value, mask),)

    return fast_paths.Trial(
        tolerance=_tolerance(dtype), pieces=[(1.0, _works(_Layer(h // k), d, run))]
    )


def _works(layer: nn.Module, head_dim: int, run) -> dict[str, fast_paths.Work]:
    scale = head_dim**-0.5
    return {
        "sdpa": lambda: run(lambda q, k, v, m: sdpa_attention_forward(layer, q, k, v, m)[0]),
        "grouped": lambda: run(lambda q, k, v, m: _grouped(q, k, v, m, scale)[0]),
    }


def _tolerance(dtype: torch.dtype) -> float:
    # fp32: sums in another order (~1e-6 relative). bf16/fp16: both paths round q k^T and the
    # weights to 8 (11) mantissa bits, SDPA in other places than the fp32 softmax here.
    return 1e-4 if dtype == torch.float32 else 3e-2


fast_paths.register(PATH, "sdpa", _trial)
fast_paths.register(DECODE_PATH, "sdpa", _decode_trial)
