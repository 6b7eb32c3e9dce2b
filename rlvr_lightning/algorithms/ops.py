"""Masked reductions and per-token quantities computed from logits.

A mask is any tensor of the shape of ``x`` (or broadcastable to it) whose nonzero entries mark
valid positions; it is read as a boolean, never as a weight. Masked positions may hold anything,
including ``inf`` or ``NaN``: they are selected away with ``torch.where``, not multiplied by 0.
"""

from __future__ import annotations

import torch

_LOGIT_CHUNK_ROWS = 1024


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``x`` over valid positions, over ``dim`` or over everything when ``dim`` is None."""
    # where, not x * mask: padded log-probs can be -inf and -inf * 0 is NaN.
    kept = torch.where(mask.bool(), x, 0.0)  # [same as x]
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(
    x: torch.Tensor,
    mask: torch.Tensor,
    dim: int | tuple[int, ...] | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 (not NaN) where no position is valid.

    Args:
        x: values.
        mask: nonzero on valid positions, broadcastable to ``x``.
        dim: dimension(s) to reduce; None reduces everything to a scalar.
        eps: floor of the valid count, so an empty mask divides 0 by ``eps``.
    """
    valid = mask.bool().expand_as(x)  # [same as x]
    count = valid.sum() if dim is None else valid.sum(dim)
    return masked_sum(x, valid, dim) / count.to(x.dtype).clamp_min(eps)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid positions (a scalar); 0 with fewer than two of them.

    The Bessel factor ``n / (n - 1)`` uses ``max(n - 1, 1)`` so that one valid position gives
    0 instead of NaN, without a host sync to check the count.
    """
    mean = masked_mean(x, mask)  # []
    var = masked_mean((x - mean) ** 2, mask)  # []
    if not unbiased:
        return var
    count = mask.bool().expand_as(x).sum().to(x.dtype)  # []
    return var * count / (count - 1).clamp_min(1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with masked statistics; 0 on masked positions.

    With ``shift_mean=False`` the mean is added back, so only the scale changes (as verl's
    ``masked_whiten``, used for GAE advantages).
    """
    mean = masked_mean(x, mask)  # []
    var = masked_var(x, mask)  # []
    whitened = (x - mean) * torch.rsqrt(var + eps)  # [same as x]
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, 0.0)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = _LOGIT_CHUNK_ROWS
) -> torch.Tensor:
    """``log_softmax(logits)[labels]`` in fp32, as ``logits[label] - logsumexp(logits)``.

    Rows are processed in chunks of ``chunk_rows`` so that neither a full ``[..., V]``
    log-softmax nor a full fp32 copy of bf16 logits exists at once. Under autograd, logsumexp
    keeps its fp32 input for backward, so the saving is only complete under ``no_grad``
    (reference and old log-probs), which is where the batches are largest.

    Args:
        logits: ``[..., V]`` in any float dtype.
        labels: ``[...]`` integer token ids.

    Returns:
        ``[...]`` fp32 log-probabilities.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [M, V]
    flat_labels = labels.reshape(-1, 1).long()  # [M, 1]
    pieces = []
    for chunk, chunk_labels in zip(
        flat_logits.split(chunk_rows), flat_labels.split(chunk_rows), strict=True
    ):
        rows = chunk.float()  # [m, V]; the same tensor for fp32 input, no copy
        picked = rows.gather(-1, chunk_labels).squeeze(-1)  # [m]
        pieces.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(pieces).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = _LOGIT_CHUNK_ROWS) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` in fp32: ``logsumexp(l) - sum(softmax(l) * l)``.

    This form needs no log-softmax tensor; chunking over rows bounds the fp32 working set as in
    :func:`logprobs_from_logits`. Logits must be finite (``0 * -inf`` is NaN).

    Args:
        logits: ``[..., V]`` in any float dtype.

    Returns:
        ``[...]`` fp32 entropies in nats.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [M, V]
    pieces = []
    for chunk in flat_logits.split(chunk_rows):
        rows = chunk.float()  # [m, V]
        probs = torch.softmax(rows, dim=-1)  # [m, V]
        pieces.append(torch.logsumexp(rows, dim=-1) - (probs * rows).sum(-1))
    return torch.cat(pieces).reshape(logits.shape[:-1])


def last_n_mean(x: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """``[R, H]`` mean of ``x`` ``[R, L, H]`` over the last ``n`` valid positions of each row
    (``mask`` ``[R, L]``, left or right padded); 0 for a row without valid positions."""
    valid = mask.bool()  # [R, L]
    from_end = valid.flip(-1).cumsum(-1).flip(-1)  # [R, L] 1 on the last valid position
    keep = valid & (from_end <= n)  # [R, L]
    total = torch.where(keep[..., None], x.float(), 0.0).sum(1)  # [R, H]
    return total / keep.sum(-1, keepdim=True).clamp_min(1)
