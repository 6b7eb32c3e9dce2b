"""Token log-probs of completions under a model, in memory-bounded micro-batches."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from rlvr_lightning.ops import entropy_from_logits, logprobs_from_logits


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


def cache_kwarg(model: nn.Module) -> str:
    """The name of the KV cache, as forward argument and output field: ``cache`` (recent
    transformers) or ``past_key_values`` (older); a peft wrapper is looked through."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _shared_prompt_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> list[torch.Tensor]:
    """Logits predicting each completion token, running each prompt only once: a list of
    ``[n, 1, V]`` (first token) and, when ``t > 1``, ``[n, t - 1, V]`` (the others).

    The ``G`` rows of a group share their prompt, so the prompt is encoded once per distinct
    prompt and its key/value cache is gathered per row (``index_select`` keeps the gradient to
    the prompt's activations). The logit predicting the first completion token comes from the
    prompt's last position; the completion pass gives the rest. The last completion token is
    never fed (its output would predict past the completion), and the pieces are not
    concatenated, which would copy the largest tensor of the step.
    """
    unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [u, p], [n]
    first = inverse.new_zeros(len(unique)).scatter_(0, inverse, torch.arange(len(inverse)))
    umask = prompt_mask[first]  # [u, p]
    out = model(
        input_ids=unique,
        attention_mask=umask,
        position_ids=(umask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    pieces = [out.logits[inverse]]  # [n, 1, V]
    t = completion_ids.shape[1]
    if t == 1:
        return pieces
    cache = out[cache_kwarg(model)]
    cache.reorder_cache(inverse)  # [u] -> [n] rows, differentiable (index_select)
    attn = torch.cat([prompt_mask, completion_mask[:, :-1]], dim=1)  # [n, p + t - 1]
    positions = prompt_mask.sum(-1, keepdim=True) + torch.arange(
        t - 1, device=attn.device
    )  # [n, t - 1]
    rest = model(
        input_ids=completion_ids[:, :-1],
        attention_mask=attn,
        position_ids=positions,
        use_cache=True,
        **{cache_kwarg(model): cache},
        logits_to_keep=t - 1,
    ).logits  # [n, t - 1, V]
    return [*pieces, rest]


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[n, T]`` of the completion tokens at the rows' sampling temperatures.

    Columns that are padding in every row are trimmed first, and logits are computed only for
    the completion positions. With ``share_prompts`` each distinct prompt is encoded once (see
    ``_shared_prompt_logits``); otherwise every row runs prompt and completion in one pass.
    Position ids follow the attention mask, as in generation with left padding.
    """
    t_full = completion_ids.shape[1]
    p_start, t_end = _trim(prompt_ids, prompt_mask, completion_mask)
    pids, pmask = prompt_ids[:, p_start:], prompt_mask[:, p_start:]  # [n, p]
    cids, cmask = completion_ids[:, :t_end], completion_mask[:, :t_end]  # [n, t]
    if share_prompts:
        pieces = _shared_prompt_logits(model, pids, pmask, cids, cmask)  # [n, 1 | t - 1, V]
    else:
        attn = torch.cat([pmask, cmask[:, :-1]], dim=1)  # [n, p + t - 1]
        out = model(
            input_ids=torch.cat([pids, cids[:, :-1]], dim=1),
            attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
            logits_to_keep=t_end,
            use_cache=False,
        )
        pieces = [out.logits]  # [n, t, V]
    results, start = [], 0
    for logits in pieces:
        width = logits.shape[1]
        results.append(
            _token_logprobs(
                logits, cids[:, start : start + width], temperature, with_entropy, entropy_grad
            )
        )
        start += width
    pad = (0, t_full - t_end)
    logp = nn.functional.pad(torch.cat([r[0] for r in results], dim=1), pad)  # [n, T]
    if not with_entropy:
        return logp, None
    return logp, nn.functional.pad(torch.cat([r[1] for r in results], dim=1), pad)  # [n, T]
