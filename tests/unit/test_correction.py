"""Rollout correction maths: ratios, TIS weights, masking, mismatch statistics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlvr_lightning.algorithms.correction import (
    correction_weights,
    log_ratio,
    mismatch_metrics,
    needs_trainer_logprobs,
)
from rlvr_lightning.rollout.factory import engine_dtype
from rlvr_lightning.stages.old_logprobs import deferred_trainer_logprobs, with_trainer_logprobs
from rlvr_lightning.testing import tiny_policy
from rlvr_lightning.types import Rollouts

LN2 = math.log(2.0)
# Two rows of three tokens; row 1's last token is padding.
OLD = torch.tensor([[0.0, -LN2, -1.0], [-2.0, -1.0, 0.0]])
BEH = torch.tensor([[-LN2, 0.0, -1.0], [-1.0, -1.0 - 2 * LN2, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def test_token_and_sequence_log_ratio():
    # Token log-ratios old - beh: row 0: [ln2, -ln2, 0]; row 1: [-1, 2 ln2, (pad) 0].
    tok = log_ratio(OLD, BEH, "token", MASK)
    assert torch.allclose(tok, torch.tensor([[LN2, -LN2, 0.0], [-1.0, 2 * LN2, 0.0]]))
    # Sequence: row sums broadcast over real tokens: row 0: 0; row 1: 2 ln2 - 1.
    seq = log_ratio(OLD, BEH, "sequence", MASK)
    assert torch.allclose(seq, torch.tensor([[0.0] * 3, [2 * LN2 - 1, 2 * LN2 - 1, 0.0]]))


def test_tis_caps_ratios_and_zeroes_padding():
    # Ratios: row 0: [2, 1/2, 1]; row 1: [e^-1, 4 -> capped at 2, pad 0].
    w = correction_weights(OLD, BEH, MASK, "tis", cap=2.0)
    expected = torch.tensor([[2.0, 0.5, 1.0], [math.exp(-1), 2.0, 0.0]])
    assert torch.allclose(w, expected)


def test_mask_drops_tokens_outside_the_band():
    # |log ratio| <= ln 2 keeps 2 and 1/2 (boundary included) and 1; e^-1 < 1/2 and 4 > 2 are
    # out. Padding 0. With cap e^1.5 (|log ratio| at most 2 ln2 = 1.386) all five stay.
    w = correction_weights(OLD, BEH, MASK, "mask", cap=2.0)
    assert w.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert correction_weights(OLD, BEH, MASK, "mask", cap=math.exp(1.5)).tolist() == MASK.tolist()
    assert torch.equal(correction_weights(OLD, BEH, MASK, "none", cap=2.0), MASK)
    with pytest.raises(ValueError, match="> 1"):
        correction_weights(OLD, BEH, MASK, "tis", cap=1.0)


def test_mismatch_metrics_by_hand():
    # Five real tokens, ratios r = [2, 1/2, 1, e^-1, 4]; k3 = r - 1 - ln r:
    # 2: 1 - ln2 = 0.30685; 1/2: -0.5 + ln2 = 0.19315; 1: 0; e^-1: e^-1 - 1 + 1 = 0.36788;
    # 4: 3 - 2 ln2 = 1.61371. Mean = 2.48159 / 5 = 0.49632. One of five exceeds the cap 3.
    m = mismatch_metrics(OLD, BEH, MASK, cap=3.0)
    assert m["kl"] == pytest.approx(0.49632, abs=1e-4)
    assert m["ratio_min"] == pytest.approx(math.exp(-1))
    assert m["ratio_max"] == pytest.approx(4.0)
    assert m["capped_frac"] == pytest.approx(0.2)
    assert mismatch_metrics(OLD, OLD, MASK, cap=2.0)["kl"] == 0.0
    assert mismatch_metrics(OLD, BEH, torch.zeros_like(MASK), cap=2.0) == {}


def test_engine_dtype_follows_precision():
    assert engine_dtype("float32", "bf16-mixed") == "bfloat16"
    assert engine_dtype("float32", "bf16-true") == "bfloat16"
    assert engine_dtype("float32", "16-mixed") == "float16"
    assert engine_dtype("float32", "32-true") == "float32"
    assert engine_dtype("bfloat16", None) == "bfloat16"


def _rollouts(position_temperature=None, offpolicy_mask=None) -> Rollouts:
    # Two rows of three tokens at base temperature 1.0; row 1's last token is padding.
    return Rollouts(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1),
        completion_ids=torch.ones(2, 3, dtype=torch.long), completion_mask=MASK.long(),
        behaviour_logp=BEH, temperature=torch.ones(2), truncated=torch.zeros(2, dtype=torch.bool),
        completions=["a", "b"], group_size=1, offpolicy_mask=offpolicy_mask,
        position_temperature=position_temperature,
    )  # fmt: skip


def test_a_position_schedule_counts_as_a_sampler_that_differs():
    assert not needs_trainer_logprobs("auto", True, _rollouts(), 1.0)
    assert needs_trainer_logprobs("auto", True, _rollouts(torch.tensor([[1, 0.9, 0.8]] * 2)), 1.0)
    # Only sampled tokens count: a schedule that differs on padding only changes nothing...
    pad_only = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.5]])
    assert not needs_trainer_logprobs("auto", True, _rollouts(pad_only), 1.0)
    # ... nor on an injected row's tokens.
    off = torch.tensor([[0, 0, 0], [1, 1, 1]])
    injected = torch.tensor([[1.0, 1.0, 1.0], [0.6, 0.6, 0.6]])
    assert not needs_trainer_logprobs("auto", True, _rollouts(injected, off), 1.0)
    assert not needs_trainer_logprobs("engine", True, _rollouts(pad_only * 0.5), 1.0)


def test_trainer_logprobs_drop_the_schedule():
    model, _ = tiny_policy(seed=0)
    r = _rollouts(torch.tensor([[1, 0.9, 0.8]] * 2))
    out, _ = with_trainer_logprobs(model, r, micro_batch_size=2, base_temperature=1.0, cap=2.0)
    assert out.position_temperature is None and out.temperature.tolist() == [1.0, 1.0]
    assert out.old_logp is not None and torch.equal(out.behaviour_logp, BEH)


def test_deferred_pi_old_marks_the_tokens_the_update_forward_fills():
    # Row 0 on-policy, sampled at 0.7; row 1 injected (stored log-probs kept). MASK: row 1's
    # last token is padding.
    off = torch.tensor([[0, 0, 0], [1, 1, 1]])
    r = dataclasses.replace(_rollouts(offpolicy_mask=off), temperature=torch.tensor([0.7, 0.5]))
    out = deferred_trainer_logprobs(r, base_temperature=1.0)
    assert out.old_logp[0].isnan().all()  # all three tokens of the on-policy row: from the update
    assert torch.equal(out.old_logp[1], torch.tensor([BEH[1, 0], BEH[1, 1], 0.0]))
    assert out.temperature.tolist() == [1.0, 0.5]  # the injected row keeps its temperature
    assert out.position_temperature is None
