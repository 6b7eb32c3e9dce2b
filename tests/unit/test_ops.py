from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algorithms.ops import (
    entropy_from_logits,
    last_n_mean,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [2, 3]
MASK = torch.tensor([[1, 1, 0], [0, 0, 1]])  # [2, 3]


def test_masked_sum_total_and_per_row() -> None:
    # Valid: 1, 2 in row 0 and 6 in row 1 -> total 9, rows [3, 6].
    assert masked_sum(X, MASK).item() == 9.0
    torch.testing.assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 6.0]))


def test_masked_sum_ignores_non_finite_padding() -> None:
    # -inf * 0 would be NaN; padding must simply not count: 1 + 2 + 6 = 9.
    x = X.clone()  # [2, 3]
    x[0, 2], x[1, 0] = -math.inf, math.nan
    assert masked_sum(x, MASK).item() == 9.0


def test_masked_mean_values_and_empty_rows() -> None:
    # Total 9 over 3 valid -> 3; rows: (1+2)/2 = 1.5 and 6/1 = 6.
    assert masked_mean(X, MASK).item() == pytest.approx(3.0)
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 6.0]))
    # An empty row and an empty mask give 0, not NaN.
    empty_row = torch.tensor([[1, 1, 0], [0, 0, 0]])  # [2, 3]
    torch.testing.assert_close(masked_mean(X, empty_row, dim=-1), torch.tensor([1.5, 0.0]))
    assert masked_mean(X, torch.zeros_like(MASK)).item() == 0.0


def test_masked_mean_accepts_bool_and_broadcast_mask() -> None:
    # Column mask [1, 0, 1] over both rows: (1 + 3 + 4 + 6) / 4 = 3.5.
    col = torch.tensor([True, False, True])  # [3]
    assert masked_mean(X, col).item() == pytest.approx(3.5)


def test_masked_var_biased_unbiased_and_degenerate() -> None:
    # Valid [1, 2, 3, 4], mean 2.5, squared deviations 2.25 + .25 + .25 + 2.25 = 5:
    # biased 5 / 4 = 1.25, unbiased 5 / 3 = 1.6667. The masked 100 must not count.
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])  # [5]
    mask = torch.tensor([1, 1, 1, 1, 0])  # [5]
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(1.25)
    assert masked_var(x, mask).item() == pytest.approx(5 / 3)
    # One valid value or none: variance 0, not NaN.
    assert masked_var(x, torch.tensor([0, 1, 0, 0, 0])).item() == 0.0
    assert masked_var(x, torch.zeros(5)).item() == 0.0


def test_masked_whiten() -> None:
    # Valid [1, 2, 3]: mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> [-1, 0, 1]; padding -> 0.
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])  # [4]
    mask = torch.tensor([1, 1, 1, 0])  # [4]
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([-1.0, 0.0, 1.0, 0.0]))
    # shift_mean=False adds the mean 2 back: [1, 2, 3], padding still 0.
    torch.testing.assert_close(
        masked_whiten(x, mask, shift_mean=False), torch.tensor([1.0, 2.0, 3.0, 0.0])
    )


def test_logprobs_from_logits_hand_value() -> None:
    # logits log([1, 2, 1]) -> softmax [.25, .5, .25]; labels 1 and 0 -> log .5 and log .25.
    logits = torch.log(torch.tensor([[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]))  # [2, 3]
    out = logprobs_from_logits(logits, torch.tensor([1, 0]))  # [2]
    torch.testing.assert_close(out, torch.tensor([math.log(0.5), math.log(0.25)]))


@pytest.mark.parametrize("chunk_rows", [1, 3, 1024])
def test_logprobs_from_logits_matches_log_softmax_and_gradient(chunk_rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, requires_grad=True)  # [N, T, V]
    labels = torch.randint(0, 11, (2, 5), generator=gen)  # [N, T]
    out = logprobs_from_logits(logits, labels, chunk_rows=chunk_rows)  # [N, T]
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)  # [N, T]
    torch.testing.assert_close(out, ref)
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(grad, ref_grad)


def test_logprobs_from_logits_bf16_computes_in_fp32() -> None:
    # The bf16 logits are exact in fp32, so the result must equal fp32 math on them,
    # far tighter than bf16's ~3 significant digits.
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 4, 50, generator=gen) * 5).bfloat16()  # [N, T, V]
    labels = torch.randint(0, 50, (3, 4), generator=gen)  # [N, T]
    out = logprobs_from_logits(logits, labels)  # [N, T]
    assert out.dtype == torch.float32
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_entropy_from_logits_hand_values() -> None:
    # Uniform over 3 -> log 3. Probabilities [.5, .25, .25] -> .5 log 2 + 2 * .25 log 4
    # = 1.5 log 2.
    logits = torch.stack([torch.zeros(3), torch.log(torch.tensor([0.5, 0.25, 0.25]))])  # [2, 3]
    expected = torch.tensor([math.log(3), 1.5 * math.log(2)])  # [2]
    torch.testing.assert_close(entropy_from_logits(logits), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits_matches_definition(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3, 7, generator=gen) * 3).to(dtype)  # [N, T, V]
    out = entropy_from_logits(logits, chunk_rows=4)  # [N, T]
    logp = torch.log_softmax(logits.float(), -1)  # [N, T, V]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)


def test_last_n_mean_takes_the_last_valid_positions_of_each_row() -> None:
    # Row 0 left-padded [pad, 1, 2, 3], n = 2 -> mean(2, 3) = 2.5; row 1 right-padded
    # [4, 6, pad, pad] -> mean(4, 6) = 5; row 2 one valid [pad, pad, 7, pad] -> 7; row 3 none -> 0.
    x = torch.tensor([[0, 1, 2, 3], [4, 6, 9, 9], [9, 9, 7, 9], [9, 9, 9, 9.0]])[..., None]
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
    out = last_n_mean(x, mask, 2)  # [R, 1]
    torch.testing.assert_close(out[:, 0], torch.tensor([2.5, 5.0, 7.0, 0.0]))
