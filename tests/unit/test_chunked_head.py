"""chunked_head.head_logprobs: hand values, gradcheck, the plain autograd path, autocast."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from rlvr_lightning.device.chunked_head import head_logprobs


def _plain(h, w, b, labels, temperature):
    """The reference: full logits -> log_softmax -> gather, and the entropy of the softmax."""
    logits = F.linear(h, w, b).float() / temperature[:, None]  # [M, V]
    logp_all = torch.log_softmax(logits, dim=-1)  # [M, V]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [M]
    return logp_all.gather(-1, labels[:, None]).squeeze(-1), entropy


def _problem(m=11, hidden=6, vocab=13, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, hidden, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(vocab, generator=g, dtype=dtype, requires_grad=True) if bias else None
    labels = torch.randint(0, vocab, (m,), generator=g)
    temperature = torch.rand(m, generator=g, dtype=dtype) + 0.5  # [M] in [0.5, 1.5)
    return h, w, b, labels, temperature


def test_hand_computed_logprob_entropy_and_gradient() -> None:
    # One token, H = 1, V = 2: h = 1, W = [[1], [0]] -> logits [1, 0], label 0.
    # log p_0 = 1 - log(1 + e) = -0.313262; p = [0.731059, 0.268941];
    # entropy = -(p_0 log p_0 + p_1 log p_1) = 0.731059 * 0.313262 + 0.268941 * 1.313262
    #         = 0.582203;  d log p_0 / dh = (onehot - p) @ W = 1 - 0.731059 = 0.268941.
    h = torch.ones(1, 1, requires_grad=True)
    w = torch.tensor([[1.0], [0.0]])
    logp, entropy = head_logprobs(h, w, None, torch.tensor([0]), torch.ones(1), with_entropy=True)
    logp.sum().backward()
    assert logp.item() == pytest.approx(1 - math.log(1 + math.e), abs=1e-6)
    assert entropy.item() == pytest.approx(0.582203, abs=1e-6)
    assert h.grad.item() == pytest.approx(0.268941, abs=1e-6)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("block", [2, 8192])
def test_gradcheck_float64_logprobs_and_entropy(bias: bool, block: int) -> None:
    # 7 tokens in chunks of 3 (the last chunk is short), per-row temperatures != 1; the 5
    # vocabulary entries in blocks of 2 (the last block is short) or in one.
    h, w, b, labels, temperature = _problem(7, 3, 5, torch.float64, bias)
    inputs = (h, w) if b is None else (h, w, b)
    kw = {"vocab_block": block}

    def both(h, w, b=None):
        return head_logprobs(
            h, w, b, labels, temperature, 3, with_entropy=True, entropy_grad=True, **kw
        )

    def logp_only(h, w, b=None):
        return head_logprobs(h, w, b, labels, temperature, 3, **kw)[0]

    def entropy_only(h, w, b=None):
        return both(h, w, b)[1]

    for fn in (both, logp_only, entropy_only):
        assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("chunk", [1, 4, 11, 1024])
@pytest.mark.parametrize("block", [1, 4, 13])
def test_matches_plain_autograd_in_fp32(chunk: int, block: int) -> None:
    h, w, b, labels, temperature = _problem()
    coef_l, coef_e = torch.randn(11), torch.randn(11)  # arbitrary upstream gradients
    grads = []
    for fused in (True, False):
        if fused:
            logp, entropy = head_logprobs(
                h,
                w,
                b,
                labels,
                temperature,
                chunk,
                with_entropy=True,
                entropy_grad=True,
                vocab_block=block,
            )
        else:
            logp, entropy = _plain(h, w, b, labels, temperature)
        values = (logp.detach(), entropy.detach())
        grads.append(
            (values, torch.autograd.grad((coef_l * logp + coef_e * entropy).sum(), (h, w, b)))
        )
    (fused_vals, fused_grads), (plain_vals, plain_grads) = grads
    for a, e in zip((*fused_vals, *fused_grads), (*plain_vals, *plain_grads), strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [3, 13])
def test_logprobs_alone_in_vocabulary_blocks_match_plain_autograd(block: int) -> None:
    """Without the entropy the forward also runs block by block (a running logsumexp)."""
    h, w, b, labels, temperature = _problem()
    logp, _ = head_logprobs(h, w, b, labels, temperature, 4, vocab_block=block)
    plain = _plain(h, w, b, labels, temperature)[0]
    torch.testing.assert_close(logp, plain.detach(), atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(logp.sum(), (h, w, b))
    for a, e in zip(grads, torch.autograd.grad(plain.sum(), (h, w, b)), strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_entropy_without_grad_is_detached_and_leaves_the_gradient_alone() -> None:
    h, w, b, labels, temperature = _problem()
    logp, entropy = head_logprobs(h, w, b, labels, temperature, 4, with_entropy=True)
    assert logp.requires_grad and not entropy.requires_grad
    grad = torch.autograd.grad(logp.sum(), (h, w, b))
    plain = torch.autograd.grad(_plain(h, w, b, labels, temperature)[0].sum(), (h, w, b))
    for a, e in zip(grad, plain, strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
    assert head_logprobs(h, w, b, labels, temperature, 4)[1] is None


def test_tied_embedding_gradient_accumulates_both_uses() -> None:
    # The head's weight is the input embedding: hidden = tanh(E[x] A), logits = hidden E^T.
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(13, 6, generator=g, requires_grad=True)  # [V, H]
    mix = torch.randn(6, 6, generator=g)
    tokens, labels = (
        torch.randint(0, 13, (9,), generator=g),
        torch.randint(0, 13, (9,), generator=g),
    )
    temperature = torch.full((9,), 0.8)
    grads = []
    for fused in (True, False):
        hidden = torch.tanh(emb[tokens] @ mix)  # [M, H]
        if fused:
            logp, _ = head_logprobs(hidden, emb, None, labels, temperature, 4)
        else:
            logp, _ = _plain(hidden, emb, None, labels, temperature)
        grads.append(torch.autograd.grad(logp.sum(), emb)[0])
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [8, 8192])
def test_bf16_autocast_matches_the_autocast_path_and_casts_the_weight_once(block: int) -> None:
    h, w, b, labels, temperature = _problem(m=37, hidden=16, vocab=50)
    casts = _WeightCasts(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with casts:
            logp, entropy = head_logprobs(
                h,
                w,
                b,
                labels,
                temperature,
                8,
                with_entropy=True,
                entropy_grad=True,
                vocab_block=block,
            )
            fused = torch.autograd.grad((logp + entropy).sum(), (h, w, b))
        plain_logp, plain_entropy = _plain(h, w, b, labels, temperature)
        plain = torch.autograd.grad((plain_logp + plain_entropy).sum(), (h, w, b))
    assert logp.dtype == entropy.dtype == torch.float32
    assert casts.count == 1  # five chunks, forward and backward: one cast of W to bf16
    torch.testing.assert_close(logp, plain_logp.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(entropy, plain_entropy.detach(), atol=2e-2, rtol=2e-2)
    for a, e in zip(fused, plain, strict=True):
        assert a.dtype == e.dtype == torch.float32
        torch.testing.assert_close(a, e, atol=5e-2, rtol=5e-2)


class _WeightCasts(torch.overrides.TorchFunctionMode):
    """Counts ``Tensor.to`` calls on one tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.count = weight, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to and args and args[0] is self.weight:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_chunk_size_is_validated() -> None:
    h, w, b, labels, temperature = _problem()
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logprobs(h, w, b, labels, temperature, 0)
    with pytest.raises(ValueError, match="vocab_block"):
        head_logprobs(h, w, b, labels, temperature, 4, vocab_block=0)


@pytest.mark.parametrize("block", [2, 5, 13])
def test_running_entropy_keeps_its_digits_for_large_and_peaked_logits(block: int) -> None:
    # Rows: logits ~1e3 apart (entropy ~0), a flat row (entropy log 13), logits shifted by
    # +5e3 (the same entropies); the running sums over blocks give the fp64 reference's values
    # in fp32, the largest logit in any block of the row.
    w = torch.eye(13)  # logits = hidden, so the rows below are the logits themselves
    h = torch.stack(
        [
            torch.arange(13.0) * 1e3,
            torch.zeros(13),
            torch.arange(13.0).flip(0) * 0.5 + 5e3,
            torch.linspace(-3.0, 3.0, 13) * 7,
        ]
    )
    labels, temperature = torch.tensor([12, 3, 0, 5]), torch.ones(4)
    logp, entropy = head_logprobs(
        h, w, None, labels, temperature, vocab_block=block, with_entropy=True
    )
    ref = torch.log_softmax(h.double(), -1)  # [4, 13]
    ref_entropy = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=2e-6, rtol=1e-5)
    # log p = label score - logsumexp, both ~5e3 in row 2: fp32's spacing there is 4.9e-4
    torch.testing.assert_close(
        logp.double(), ref.gather(1, labels[:, None]).squeeze(1), atol=1e-3, rtol=1e-5
    )
    assert abs(float(entropy[1]) - math.log(13)) < 1e-5 and float(entropy[0]) < 1e-6


def test_kept_logits_give_the_recomputed_gradients_and_a_second_backward_recomputes(
    monkeypatch,
) -> None:
    from rlvr_lightning.device import chunked_head

    calls = []
    scores = chunked_head._scores
    monkeypatch.setattr(chunked_head, "_scores", lambda *a: calls.append(1) or scores(*a))
    results = []
    for keep_bytes in (0, 2**28):  # recompute, then keep (11 x 13 fp32 logits fit)
        monkeypatch.setattr(chunked_head, "KEEP_LOGITS_BYTES", keep_bytes)
        h, w, b, labels, temperature = _problem()
        logp, entropy = head_logprobs(
            h, w, b, labels, temperature, 4, with_entropy=True, entropy_grad=True, vocab_block=5
        )
        loss = (logp * torch.arange(11.0)).sum() + entropy.sum()
        calls.clear()
        first = torch.autograd.grad(loss, (h, w, b), retain_graph=True)
        backward_calls = len(calls)
        second = torch.autograd.grad(loss, (h, w, b))  # kept blocks are gone: recomputed
        results.append((first, backward_calls, second, len(calls) - backward_calls))
    (recomputed, n_recompute, _, _), (kept, n_kept, again, n_again) = results
    assert n_recompute == 3 * 3 and n_kept == 0 and n_again == 3 * 3  # 3 row x 3 vocab blocks
    for a, e, r in zip(kept, recomputed, again, strict=True):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(r, e, atol=1e-6, rtol=1e-6)
    assert not chunked_head._keep_logits(11, 13, torch.bfloat16)  # bf16 matmuls recompute
