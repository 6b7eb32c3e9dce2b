"""Log-probs (and entropies) of labels under a linear LM head, never holding the full logits.

``head_logprobs(h, W, b, y, T)`` is ``log_softmax((h W^T + b) / T)[y]`` for ``M`` tokens, with
only one ``[chunk, vocab_block]`` block of logits alive at a time, in forward and in backward
(which recomputes each block from ``h`` instead of saving it): the forward keeps a running
logsumexp (and entropy) over the vocabulary blocks. Plain autograd on the model's logits keeps
the whole ``[M, V]`` block and its fp32 copy for backward; with V = 49152 that is most of an
update's memory.

Gradients, with ``s = z / T`` the scaled logits of one row, ``p = softmax(s)``, ``H`` its
entropy and ``g_l``, ``g_e`` the incoming gradients of the log-prob and the entropy:

    d logp / d s = onehot(y) - p
    d H / d s    = -p * (s - E_p[s]) = -p * (log p + H)
    d L / d z    = (g_l * (onehot(y) - p) - g_e * p * (log p + H)) / T

then ``dh = dz W``, ``dW = dz^T h``, ``db = sum_rows dz``. Everything is computed from
``log p = s - logsumexp(s)``, as ``log_softmax`` would: ``s - E_p[s]`` or ``logsumexp(s) - E_p[s]``
lose digits to cancellation when the logits are large. The temperature is data and gets no
gradient. Precision follows ``nn.Linear`` under autocast: the matmul runs in the autocast dtype
(``W`` cast once per call), the softmax reductions in fp32 (fp64 for fp64 inputs, so
``gradcheck`` can check the formulas).
"""

from __future__ import annotations

import torch

from rlvr_lightning.device import cpu_linear

DEFAULT_CHUNK_TOKENS = 1024
# Vocabulary entries per block of logits: each ``[chunk, V]`` block is computed in pieces of
# this many columns (a running logsumexp in the forward, per-piece gradients in the backward),
# which keeps the fp32 working set small and the matmuls' outputs cache-sized. 4096: this
# project's choice; the head's forward + backward over 600 tokens of SmolLM2-135M (V = 49152)
# on 2 CPU cores took 0.86-0.90 s in fp32 and 0.29-0.34 s in bf16 with it, against 1.00-1.02 s
# and 0.52-0.55 s in one block (2048: about the same; 16384: 0.98 s and 0.53 s).
VOCAB_BLOCK = 4096

# The forward keeps its blocks of scaled logits for the backward, instead of recomputing them
# there, when the matmuls run in fp32 or wider and all of them fit in this many bytes: in fp32
# the recompute is a quarter of the head's matmul work (0.18 s for 640 tokens of the embedded
# model on 2 cores), and 640 tokens' logits take 126 MB. In bf16 the matmul is cheap and memory
# is what bf16 is for. 2**28 (256 MiB): this project's choice.
KEEP_LOGITS_BYTES = 2**28


def _keep_logits(tokens: int, vocab: int, dtype: torch.dtype) -> bool:
    """Whether the forward keeps the ``[tokens, vocab]`` scaled logits (see KEEP_LOGITS_BYTES)."""
    wide = torch.finfo(dtype).bits >= 32
    return (
        wide
        and tokens * vocab * torch.finfo(torch.promote_types(dtype, torch.float32)).bits // 8
        <= KEEP_LOGITS_BYTES
    )


def head_compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's for ``hidden``'s device when it is on
    (as ``nn.Linear`` would), else the promotion of ``hidden`` and ``weight``."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: torch.Tensor,
    reduce_dtype: torch.dtype,
) -> torch.Tensor:
    """``[m, V]`` logits / temperature in ``reduce_dtype``; a fresh tensor (safe to overwrite).
    The matmul runs in ``weight``'s dtype; dividing by 1.0 is exact, so no special case."""
    logits = cpu_linear.linear(hidden.to(weight.dtype), weight, bias)  # [m, V]
    return logits.to(reduce_dtype).div_(temperature[:, None])


def _score_grad(
    scores: torch.Tensor,
    labels: torch.Tensor,
    logz: torch.Tensor,
    entropy: torch.Tensor | None,
    g_logp: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    offset: int = 0,
) -> torch.Tensor:
    """``[m, v]`` gradient w.r.t. the scaled logits ``scores`` (overwritten) of vocabulary
    entries ``offset .. offset + v - 1``: ``g_l * (onehot - p) - g_e * p * (log p + H)``, in
    place, so two ``[m, v]`` buffers suffice (``logz``, ``entropy``: of the whole vocabulary).
    ``entropy`` is read only with ``g_ent``; at least one of ``g_logp``, ``g_ent`` is given."""
    log_probs = scores.sub_(logz[:, None])  # [m, V]
    probs = log_probs.exp()  # [m, V]
    if g_ent is None:
        grad = probs.mul_(-g_logp[:, None])  # [m, V]
    else:
        coef = log_probs.add_(entropy[:, None]).mul_(g_ent[:, None])  # [m, V] g_e (log p + H)
        if g_logp is not None:
            coef.add_(g_logp[:, None])
        grad = probs.mul_(coef).neg_()  # [m, V]
    if g_logp is not None:
        local = labels - offset  # [m] the label's column in this block, if it is here
        here = (local >= 0) & (local < grad.shape[-1])  # [m]
        at = local.clamp(0, grad.shape[-1] - 1)[:, None]  # [m, 1]
        grad.scatter_add_(-1, at, torch.where(here, g_logp, 0.0)[:, None])
    return grad


def _logz_label_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    reduce_dtype: torch.dtype,
    block: int,
    with_entropy: bool,
    kept: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``([m] logsumexp, [m] label score, [m] entropy or None)`` of the scaled logits, ``block``
    vocabulary entries at a time, all from the same matmuls; each block of scaled logits is
    appended to ``kept`` when given.

    Running over the blocks with ``c`` the largest score so far: ``S0 = sum exp(s - c)`` and
    ``S1 = sum exp(s - c) (s - c)``, rescaled when ``c`` grows. Then ``logsumexp = c + log S0``
    and the entropy ``logsumexp - E_p[s] = log S0 - S1 / S0``: both terms are O(log V), so no
    digits are lost to cancellation when the logits are large.
    """
    top = s0 = s1 = label = None
    for cols in _row_chunks(weight.shape[0], block):
        s = _scores(hidden, weight[cols], _pick(bias, cols), temperature, reduce_dtype)  # [m, v]
        local = labels - cols.start  # [m]
        here = (local >= 0) & (local < s.shape[-1])  # [m]
        picked = s.gather(-1, local.clamp(0, s.shape[-1] - 1)[:, None]).squeeze(-1)  # [m]
        label = torch.where(here, picked, picked if label is None else label)
        new_top = s.amax(-1) if top is None else torch.maximum(top, s.amax(-1))  # [m]
        if kept is not None:
            kept.append(s)
        shifted = s.sub_(new_top[:, None]) if kept is None else s - new_top[:, None]  # [m, v]
        weights = shifted.exp()  # [m, v]
        b0 = weights.sum(-1)  # [m]
        b1 = weights.mul_(shifted).sum(-1) if with_entropy else None  # [m]
        if top is not None:
            decay = (top - new_top).exp()  # [m] rescale the running sums to the new maximum
            if with_entropy:
                b1 = b1 + decay * (s1 + (top - new_top) * s0)
            b0 = b0 + decay * s0
        top, s0, s1 = new_top, b0, b1
    logz = top + s0.log()
    return logz, label, (s0.log() - s1 / s0) if with_entropy else None


def _row_chunks(rows: int, chunk: int) -> list[slice]:
    return [slice(i, min(i + chunk, rows)) for i in range(0, rows, chunk)]


def _pick(x: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if x is None else x[rows]


class _HeadLogProbs(torch.autograd.Function):
    """Chunked ``(log-prob, entropy)`` of a linear head; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        labels,
        temperature,
        chunk,
        block,
        with_entropy,
        entropy_grad,
        dtype,
    ):
        reduce_dtype = torch.promote_types(dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # [V, H], cast once for every chunk (and the backward)
            b = None if bias is None else bias.to(dtype)  # [V]
            temp = temperature.to(reduce_dtype)  # [M]
            logp, logz, ent = [], [], []
            kept = [] if _keep_logits(hidden.shape[0], w.shape[0], dtype) else None
            for rows in _row_chunks(hidden.shape[0], chunk):
                z, label, h = _logz_label_entropy(
                    hidden[rows],
                    w,
                    b,
                    labels[rows],
                    temp[rows],
                    reduce_dtype,
                    block,
                    with_entropy,
                    kept,
                )  # [m] each
                logp.append(label - z)
                logz.append(z)
                ent.append(h)
        logp, logz = torch.cat(logp), torch.cat(logz)  # [M], [M]
        entropy = torch.cat(ent) if with_entropy else logp.new_empty(0)  # [M] or [0]
        ctx.entropy_grad = with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        ctx.chunk, ctx.block, ctx.kept = chunk, block, kept
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(hidden, w, b, labels, temp, logz, entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, w, b, labels, temp, logz, entropy = ctx.saved_tensors
        g_ent = g_ent if ctx.entropy_grad else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if (g_logp is None and g_ent is None) or not (need_h or need_w or need_b):
            return (None,) * 10
        entropy = entropy if g_ent is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None  # [M, H]
        grad_w = w.new_zeros(w.shape, dtype=temp.dtype) if need_w else None  # [V, H]
        grad_b = w.new_zeros(w.shape[0], dtype=temp.dtype) if need_b else None  # [V]
        kept, k = ctx.kept, 0
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _row_chunks(hidden.shape[0], ctx.chunk):
                h = hidden[rows].to(w.dtype)  # [m, H]
                dh = h.new_zeros(h.shape, dtype=temp.dtype) if need_h else None  # [m, H]
                for cols in _row_chunks(w.shape[0], ctx.block):
                    s = None if not kept else kept[k]  # used once: a second backward recomputes
                    if s is None:
                        s = _scores(h, w[cols], _pick(b, cols), temp[rows], temp.dtype)  # [m, v]
                    else:
                        kept[k] = None
                    k += 1
                    dz = _score_grad(
                        s,
                        labels[rows],
                        logz[rows],
                        _pick(entropy, rows),
                        _pick(g_logp, rows),
                        _pick(g_ent, rows),
                        cols.start,
                    ).div_(temp[rows, None])  # [m, v]
                    if need_b:
                        grad_b[cols] += dz.sum(0)
                    dz = dz.to(w.dtype)  # the matmuls in the forward's dtype, as under autocast
                    onednn = cpu_linear.usable(dz, w)
                    if need_h:  # dz @ w[cols], summed over the blocks in fp32
                        dh += cpu_linear.mm_nt(dz, w[cols].t()) if onednn else dz @ w[cols]
                    if need_w:  # dz^T @ h, accumulated in fp32 over the chunks
                        grad_w[cols] += cpu_linear.mm_nt(dz.t(), h.t()) if onednn else dz.T @ h
                if need_h:
                    grad_h[rows] = dh.to(hidden.dtype)
        grad_w = None if grad_w is None else grad_w.to(ctx.dtypes[0])
        grad_b = None if grad_b is None else grad_b.to(ctx.dtypes[1])
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    vocab_block: int = VOCAB_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[M]`` of ``labels`` under ``softmax((hidden @ weight.T + bias) /
    temperature)``, and their entropies ``[M]`` when ``with_entropy`` (else None), in chunks of
    ``chunk_tokens`` rows, each over ``vocab_block`` vocabulary entries at a time; fp32
    (fp64 for fp64 inputs).

    Gradients reach ``hidden``, ``weight`` and ``bias`` (a tied input embedding accumulates
    both uses, as autograd does). The entropy is differentiable only with ``entropy_grad``
    (an entropy bonus in the loss); otherwise its backward term is never computed.

    Args:
        hidden: ``[M, H]`` the head's input (final hidden states).
        weight: ``[V, H]`` the head's weight.
        bias: ``[V]`` or None.
        labels: ``[M]`` integer token ids.
        temperature: ``[M]`` per-token sampling temperature (> 0).
    """
    if min(chunk_tokens, vocab_block) < 1:
        raise ValueError(
            f"chunk_tokens and vocab_block must be >= 1, got {chunk_tokens}, {vocab_block}."
        )
    dtype = head_compute_dtype(hidden, weight)
    labels = labels.long()
    args = (labels, temperature, chunk_tokens, vocab_block, with_entropy, entropy_grad, dtype)
    logp, entropy = _HeadLogProbs.apply(hidden, weight, bias, *args)
    return logp, entropy if with_entropy else None
