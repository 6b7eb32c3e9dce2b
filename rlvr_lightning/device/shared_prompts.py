"""Completion passes that share their prompts: each distinct prompt is encoded once, and the
completions read its key/value cache, in one pass or in buckets of similar length.

``forward.completion_forward`` runs these; ``rollout.hf`` reuses ``cache_kwarg``.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

try:  # cache layers that replace their tensors on update (copyable per bucket, see _cache_rows)
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    _COPYABLE_LAYERS: tuple[type, ...] = (DynamicLayer, DynamicSlidingWindowLayer)
except ImportError:  # older transformers: no per-layer cache objects, one completion pass
    _COPYABLE_LAYERS = ()


# Fixed cost of one extra completion pass, in completion tokens (``length_buckets``): this
# project's choice, measured on 2 CPU cores where a pass of a few rows costs about as much as
# a few dozen more padded tokens; larger on a GPU, where padding is cheap and passes are not.
BUCKET_PASS_TOKENS = 64


def length_buckets(lengths: torch.Tensor, pass_tokens: int) -> list[torch.Tensor]:
    """Positions ``0..n-1`` split into buckets of rows of similar length, each bucket padded
    only to its own longest row: the split minimising ``sum(rows * longest) + pass_tokens *
    buckets`` (the tokens run, plus ``pass_tokens`` per extra pass), found exactly over the
    rows sorted by length. Buckets come shortest first; a bucket keeps the rows' sorted order.

    Args:
        lengths: ``[n]`` tokens of each row.
        pass_tokens: fixed cost of one more pass, in tokens (>= 0).
    """
    order = torch.argsort(lengths, stable=True)  # [n]
    ls = lengths[order].tolist()
    n = len(ls)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):  # the last bucket is rows i..j-1 of the sorted order
        for i in range(j):
            cost = best[i] + (j - i) * ls[j - 1] + pass_tokens
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], n
    while j > 0:
        spans.append((cut[j], j))
        j = cut[j]
    return [order[i:j] for i, j in reversed(spans)]


def cache_kwarg(model: nn.Module) -> str:
    """The name of the KV cache, as forward argument and output field: ``cache`` (recent
    transformers) or ``past_key_values`` (older); a peft wrapper is looked through."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def sparse_lookup(model: nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    """``model.get_input_embeddings()(ids)`` with a sparse gradient, when autograd records and
    the table is a plain ``nn.Embedding`` (no hooks) whose weight is also the LM head's (tied,
    as in the embedded model); else None. The head's dense gradient already covers the whole
    weight, and a dense lookup backward would build and zero a ``[V, H]`` tensor per call
    (113 MB in fp32 for the embedded model) only to add a few rows."""
    table = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if not (
        torch.is_grad_enabled()
        and type(table) is nn.Embedding
        and not (table._forward_hooks or table._forward_pre_hooks)
        and table.max_norm is None
        and head is not None
        and getattr(head, "weight", None) is table.weight
    ):
        return None
    return nn.functional.embedding(
        ids,
        table.weight,
        table.padding_idx,
        scale_grad_by_freq=table.scale_grad_by_freq,
        sparse=True,
    )


def prompt_pass(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    """The model's output on left-padded prompts ``[b, p]`` (mask ``[b, p]``): the logits of
    the last position and the key/value cache of all of them (``out[cache_kwarg(model)]``)."""
    embeds = sparse_lookup(model, ids)  # [b, p, H] or None
    return model(
        input_ids=ids if embeds is None else None,
        inputs_embeds=embeds,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )


def _copyable(cache: object) -> bool:
    """Whether ``_cache_rows`` can copy ``cache``: all its layers are plain key/value layers
    (``DynamicLayer``, ``DynamicSlidingWindowLayer``), which replace, never mutate, their
    tensors, so a shallow copy is independent of the original."""
    layers = getattr(cache, "layers", None)
    return layers is not None and all(type(layer) in _COPYABLE_LAYERS for layer in layers)


def _cache_rows(cache: object, rows: torch.Tensor) -> object:
    """A copy of a ``_copyable`` ``cache`` holding its batch rows ``rows`` (differentiable
    ``index_select``), the original untouched."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    out.reorder_cache(rows)
    return out


def shared_prompt_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    hidden: list[torch.Tensor],
    pass_tokens: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Logits predicting each completion token, running each prompt only once, and the rows
    of the completion passes: ``([first, *rest], rows)``. ``first`` is ``[n, 1, V]`` (the
    first token). With ``rows`` None, ``rest`` is one ``[n, t - 1, V]`` piece (when ``t > 1``);
    otherwise piece ``i`` of ``rest`` is ``[len(rows[i]), t_i - 1, V]``, the completion pass of
    the bucket ``rows[i]`` of rows of similar length (``length_buckets`` with ``pass_tokens``),
    each padded only to its own longest row. The LM head's inputs captured in ``hidden`` (see
    ``lm_head_inputs``) are the same pieces, ``first`` put in row order.

    The ``G`` rows of a group share their prompt, so the prompt is encoded once per distinct
    prompt and its key/value cache is gathered per row (``index_select`` keeps the gradient to
    the prompt's activations); every bucket reads the same prompt pass. The logit predicting
    the first completion token comes from the prompt's last position; the completion passes
    give the rest. The last completion token is never fed (its output would predict past the
    completion), and the pieces are not concatenated, which would copy the largest tensor of
    the step.
    """
    unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [u, p], [n]
    first = inverse.new_zeros(len(unique)).scatter_(0, inverse, torch.arange(len(inverse)))
    out = prompt_pass(model, unique, prompt_mask[first])
    pieces = [out.logits[inverse]]  # [n, 1, V]
    if hidden:
        hidden[0] = hidden[0][inverse]  # [n, 1, H]
    lengths = completion_mask.sum(-1)  # [n]
    if int(lengths.max()) <= 1:
        return pieces, None
    cache = out[cache_kwarg(model)]
    # One embedding lookup for all completion passes: the backward of every lookup builds a
    # dense [V, H] gradient (~30 ms for SmolLM2-135M on 2 CPU cores).
    embeds = sparse_lookup(model, completion_ids[:, :-1])  # [n, t - 1, H]
    if embeds is None:
        embeds = model.get_input_embeddings()(completion_ids[:, :-1])
    buckets = None
    if pass_tokens is not None and _copyable(cache):
        buckets = [b for b in length_buckets(lengths, pass_tokens) if int(lengths[b].max()) > 1]
    if buckets is None or (len(buckets) == 1 and len(buckets[0]) == len(inverse)):
        cache.reorder_cache(inverse)  # [u] -> [n] rows, differentiable (index_select)
        rest = _completion_pass(model, cache, prompt_mask, completion_ids, completion_mask, embeds)
        return [*pieces, rest], None
    for rows in buckets:
        t = int(lengths[rows].max())
        pieces.append(
            _completion_pass(
                model,
                _cache_rows(cache, inverse[rows]),
                prompt_mask[rows],
                completion_ids[rows, :t],
                completion_mask[rows, :t],
                embeds[rows, : t - 1],
            )
        )  # [len(rows), t - 1, V]
    return pieces, buckets


def _completion_pass(
    model: nn.Module,
    cache: object,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    embeds: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[m, t - 1, V]`` predicting completion tokens ``1..t-1`` of ``m`` rows whose
    prompts are in ``cache`` (one row each), from the input embeddings ``embeds`` ``[m, >= t - 1,
    H]`` of their tokens (those of tokens ``0..t-2`` are used)."""
    t = completion_ids.shape[1]
    attn = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)  # [m, p + t - 1]
    positions = prompt_mask.sum(-1, keepdim=True) + torch.arange(
        t - 1, device=attn.device
    )  # [m, t - 1]
    return model(
        inputs_embeds=embeds[:, : t - 1],
        attention_mask=attn,
        position_ids=positions,
        use_cache=True,
        **{cache_kwarg(model): cache},
        logits_to_keep=t - 1,
    ).logits


def rows_assembled(pieces: list[torch.Tensor], buckets: list[torch.Tensor], t: int) -> torch.Tensor:
    """``[n, t, D]`` from ``[first, *bucket pieces]`` (see ``shared_prompt_logits``), the
    positions past each bucket's own length zero."""
    first = pieces[0]  # [n, 1, D]
    rest = first.new_zeros(first.shape[0], t - 1, first.shape[-1])  # [n, t - 1, D]
    for rows, piece in zip(buckets, pieces[1:], strict=True):
        rest[rows, : piece.shape[1]] = piece
    return torch.cat([first, rest], dim=1)
