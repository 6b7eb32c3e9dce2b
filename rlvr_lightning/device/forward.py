"""Token log-probs (and values) of completions under a model, in memory-bounded micro-batches.

By default the LM head is bypassed and the log-probs are computed from the final hidden states
in chunks (``chunked_head.head_logprobs``), so the ``[n, t, V]`` logits never exist at once;
``head_chunk_tokens=None`` (or a head that cannot be bypassed, see ``fused_head``) keeps the
model's own head and its full logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from rlvr_lightning.algorithms.ops import entropy_from_logits, logprobs_from_logits
from rlvr_lightning.device.chunked_head import DEFAULT_CHUNK_TOKENS, head_logprobs
from rlvr_lightning.device.layer_states import capture_layer, prompt_response_means
from rlvr_lightning.device.shared_prompts import (
    BUCKET_PASS_TOKENS,
    rows_assembled,
    shared_prompt_logits,
)

# Config fields of models whose logits are not the head's output (Gemma 2/3 soft-capping,
# Cohere's logit_scale, Granite's logits_scaling): the bypassed head would skip them.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def group_microbatches(groups: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split positions ``0..n-1`` into micro-batches of at most ``size`` rows, whole groups kept
    together where possible, so rows sharing a prompt encode it once (``share_prompts``).

    Args:
        groups: ``[n]`` group (prompt) index of each row.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}.")
    order = torch.argsort(groups, stable=True)  # [n]
    return list(torch.split(order, size))


def _trim(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[int, int]:
    """First prompt column that is not padding in every row, and the longest completion."""
    p_start = int((prompt_mask.sum(0) > 0).nonzero().min()) if prompt_mask.any() else 0
    return p_start, max(int(completion_mask.sum(-1).max()), 1)


@contextmanager
def lm_head_inputs(model: nn.Module, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """Collect the input of the model's LM head (``get_output_embeddings``) on every forward.

    That input is the final hidden state (after the last norm) at exactly the positions the
    logits are computed for, since transformers slices by ``logits_to_keep`` before the head:
    a value head reads it from the forward that computes the log-probs, at no extra cost.
    """
    captured: list[torch.Tensor] = []
    if not enabled:
        yield captured
        return
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


def fused_head(model: nn.Module) -> nn.Linear | None:
    """The LM head when ``completion_forward`` may bypass it and compute log-probs chunk by
    chunk from its input, else None (the model's own head then computes full logits).

    The fused path reads the head's ``weight`` and ``bias`` and redoes ``F.linear``, so it
    needs exactly an ``nn.Linear``: not a peft layer (an lm_head targeted by LoRA or in
    ``modules_to_save``), a quantised subclass, a module whose forward was replaced (e.g.
    accelerate's offloading hooks) or one with forward hooks (they would see hidden states).
    Models that post-process their logits (``_LOGIT_POSTPROCESSING`` in the config) keep
    their head too; any other post-processing is caught at the first forward
    (``_check_bypassed``).
    """
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or "forward" in vars(head) or head._forward_hooks:
        return None
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    config = config or model.config
    if any(getattr(config, key, None) is not None for key in _LOGIT_POSTPROCESSING):
        return None
    return head


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@contextmanager
def _head_bypassed(head: nn.Linear | None) -> Iterator[None]:
    """Within: ``head`` returns its input, so the model's "logits" are its final hidden states.

    An instance attribute shadows the class's ``forward`` (pre-hooks such as
    ``lm_head_inputs`` still run); a pre-hook alone cannot skip the head's matmul. Nothing is
    changed when ``head`` is None.
    """
    if head is None:
        yield
        return
    head.forward = _identity
    try:
        yield
    finally:
        del head.forward


def _check_bypassed(pieces: list[torch.Tensor], hidden: list[torch.Tensor]) -> None:
    """Raise unless the model returned the bypassed head's output unchanged (the ``[n, *, H]``
    hidden states), i.e. it does not post-process its logits."""
    same = len(pieces) == len(hidden) and all(
        a is b or (a.shape == b.shape and torch.equal(a.to(b.dtype), b))
        for a, b in zip(pieces, hidden, strict=False)
    )
    if not same:
        raise RuntimeError(
            "This model changes its LM head's output before returning logits, so the chunked "
            "LM head cannot compute its log-probs: set model.init_args.chunked_head: false."
        )


def _token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) ``[n, t]`` of ``labels`` under ``logits / temperature``.

    The temperature is applied row by row inside the chunked reductions of ``ops`` (no full
    ``[n, t, V]`` copy) and skipped when every row samples at temperature 1.
    """
    if bool((temperature != 1).any()):
        logits = logits.float() / temperature[:, None, None]  # [n, t, V]
    logp = logprobs_from_logits(logits, labels)  # [n, t]
    entropy = None
    if with_entropy:
        # The entropy keeps its graph only when it is part of the loss (an entropy bonus).
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())  # [n, t]
    return logp, entropy


def _fused_logprobs(
    head: nn.Linear,
    states: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    temperature: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) ``[n, t]`` of ``labels`` from the head's inputs ``states``
    ``[n, t, H]``, ``chunk_tokens`` tokens at a time (``chunked_head.head_logprobs``), for
    the tokens of ``mask`` ``[n, t]`` only; 0 elsewhere."""
    n, t = labels.shape
    keep = (mask.reshape(-1) > 0).nonzero().squeeze(-1)  # [M]
    logp, entropy = head_logprobs(
        states.reshape(n * t, -1)[keep],
        head.weight,
        head.bias,
        labels.reshape(-1)[keep],
        temperature[:, None].expand(n, t).reshape(-1)[keep],
        chunk_tokens,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )  # [M] each

    def scattered(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(n * t).index_put((keep,), x).view(n, t)

    return scattered(logp), None if entropy is None else scattered(entropy)


def _model_outputs(
    model: nn.Module,
    pids: torch.Tensor,
    pmask: torch.Tensor,
    cids: torch.Tensor,
    cmask: torch.Tensor,
    hidden: list[torch.Tensor],
    share_prompts: bool,
    pass_tokens: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """The model's outputs predicting the completion tokens, ``[n, *, V]`` pieces in order
    (``[n, *, H]`` with the head bypassed), and the rows of each completion pass when the
    completions ran in length buckets (see ``shared_prompts.shared_prompt_logits``), else
    None: shared prompts or one pass per row."""
    if share_prompts:
        return shared_prompt_logits(model, pids, pmask, cids, cmask, hidden, pass_tokens)
    attn = torch.cat([pmask, cmask[:, :-1]], dim=1)  # [n, p + t - 1]
    out = model(
        input_ids=torch.cat([pids, cids[:, :-1]], dim=1),
        attention_mask=attn,
        position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        logits_to_keep=cids.shape[1],
        use_cache=False,
    )
    return [out.logits], None  # [n, t, V]


def _piecewise_logprobs(
    pieces: list[torch.Tensor],
    labels: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) ``[n, t]`` from the full logits, piece by piece."""
    results, start = [], 0
    for logits in pieces:
        width = logits.shape[1]
        results.append(
            _token_logprobs(
                logits, labels[:, start : start + width], temperature, with_entropy, entropy_grad
            )
        )
        start += width
    logp = torch.cat([r[0] for r in results], dim=1)  # [n, t]
    return logp, torch.cat([r[1] for r in results], dim=1) if with_entropy else None


def _head_states(
    pieces: list[torch.Tensor],
    hidden: list[torch.Tensor],
    buckets: list[torch.Tensor] | None,
    t: int,
    capture: bool,
    bypassed: bool,
) -> torch.Tensor | None:
    """The LM head's inputs ``[n, t, H]`` in row order (None when not captured), after checking
    there was one head call per logits piece."""
    if capture and len(hidden) != len(pieces):
        raise RuntimeError(
            f"Expected one LM-head call per logits piece ({len(pieces)}), saw "
            f"{len(hidden)}: this model does not compute its logits in one head call."
        )
    if bypassed:
        _check_bypassed(pieces, hidden)
    if not capture:
        return None
    if buckets is None:
        return torch.cat(hidden, dim=1)  # [n, t, H]
    return rows_assembled(hidden, buckets, t)  # [n, t, H]


def _token_outputs(head, states, pieces, cids, cmask, temperature, chunk, with_entropy, grad):
    """``[n, t]`` log-probs (and entropies) from the head's inputs when it is bypassed, else
    from the model's logits pieces; 0 on padding."""
    if head is not None:
        return _fused_logprobs(head, states, cids, cmask, temperature, chunk, with_entropy, grad)
    logp, entropy = _piecewise_logprobs(pieces, cids, temperature, with_entropy, grad)
    logp = logp.masked_fill(cmask == 0, 0.0)  # [n, t]
    entropy = None if entropy is None else entropy.masked_fill(cmask == 0, 0.0)
    return logp, entropy


class CompletionForward(NamedTuple):
    """What one forward over completions gives: ``[n, T]`` each, 0 on trimmed columns, and
    ``layer_means`` (``[n, H]`` prompt and response means of a layer, see ``layer_means``)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None
    layer_means: tuple[torch.Tensor, torch.Tensor] | None = None


def completion_forward(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = True,
    value_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    layer_means: tuple[int, int] | None = None,
    bucket_pass_tokens: int | None = BUCKET_PASS_TOKENS,
) -> CompletionForward:
    """Log-probs ``[n, T]`` of the completion tokens at the rows' sampling temperatures, and
    optionally their entropies and the values ``value_head(hidden)`` of the same forward (the
    value of token ``t`` from the state that predicts it). ``layer_means = (layer, k)``: also
    the mean hidden state at ``layer`` of the last ``k`` prompt tokens and of the states
    predicting the last ``k`` completion tokens (``layer_states``; POISE's probe features).

    All-padding columns are trimmed and logits computed for completion positions only; with
    ``share_prompts`` each distinct prompt is encoded once (``shared_prompts``). Position ids
    follow the attention mask. With ``head_chunk_tokens`` the LM head is bypassed (where
    ``fused_head`` allows) and the log-probs come from its inputs that many tokens at a time,
    for real tokens only, the completions in length buckets
    (``shared_prompts.length_buckets(lengths, bucket_pass_tokens)``; None: one pass); None:
    the full logits. Log-probs, entropies and values are 0 on padding.
    """
    t_full = completion_ids.shape[1]
    p_start, t_end = _trim(prompt_ids, prompt_mask, completion_mask)
    pids, pmask = prompt_ids[:, p_start:], prompt_mask[:, p_start:]  # [n, p]
    cids, cmask = completion_ids[:, :t_end], completion_mask[:, :t_end]  # [n, t]
    head = None if head_chunk_tokens is None else fused_head(model)
    capture = value_head is not None or head is not None
    layer = None if layer_means is None else layer_means[0]
    # Length buckets only where their pieces are hidden states (cheap to put back in row order)
    # and no layer hook expects one completion pass.
    pass_tokens = bucket_pass_tokens if head is not None and layer is None else None
    with (
        lm_head_inputs(model, enabled=capture) as hidden,
        _head_bypassed(head),
        capture_layer(model, layer) as layer_out,
    ):
        pieces, buckets = _model_outputs(
            model, pids, pmask, cids, cmask, hidden, share_prompts, pass_tokens
        )
    means = None
    if layer_means is not None:
        means = prompt_response_means(layer_out, pids, pmask, cmask, share_prompts, layer_means[1])
    states = _head_states(pieces, hidden, buckets, cids.shape[1], capture, head is not None)
    outputs = (head, states, pieces, cids, cmask, temperature, head_chunk_tokens)
    logp, entropy = _token_outputs(*outputs, with_entropy, entropy_grad)  # [n, t] each
    pad = (0, t_full - t_end)
    logp = nn.functional.pad(logp, pad)  # [n, T]
    entropy = None if entropy is None else nn.functional.pad(entropy, pad)  # [n, T]
    values = None if value_head is None else nn.functional.pad(value_head(states), pad)  # [n, T]
    return CompletionForward(logp, entropy, values, means)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: torch.Tensor,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = True,
    head_chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    bucket_pass_tokens: int | None = BUCKET_PASS_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log-probs, entropies or None)``, each ``[n, T]``: ``completion_forward`` without
    values."""
    out = completion_forward(
        model,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        share_prompts=share_prompts,
        head_chunk_tokens=head_chunk_tokens,
        bucket_pass_tokens=bucket_pass_tokens,
    )
    return out.logp, out.entropy
