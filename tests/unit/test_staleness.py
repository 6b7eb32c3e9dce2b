"""Asynchronous rollouts' pure parts: staleness, the drop, cross-stage IS weights (hand-computed),
the queue's schedule, the weight fingerprint and the batch types as plain data."""

from __future__ import annotations

import io
import math

import pytest
import torch

from rlvr_lightning.algorithms.correction import correction_weights
from rlvr_lightning.algorithms.staleness import (
    cross_stage_behaviour_logp,
    staleness,
    staleness_shares,
    within_staleness,
)
from rlvr_lightning.asynchrony import (
    QueuedRound,
    RolloutQueue,
    WeightSync,
    WeightSyncError,
    from_plain,
    to_plain,
)
from rlvr_lightning.asynchrony.fingerprint import module_sums
from rlvr_lightning.types import PromptBatch, Rollouts, Scored


def test_staleness_is_the_lag_behind_the_trainer_and_the_drop_cuts_past_the_bound():
    versions = torch.tensor([5, 4, 3, 2])
    assert staleness(5, versions).tolist() == [0, 1, 2, 3]
    assert within_staleness(5, versions, 1).tolist() == [True, True, False, False]
    assert within_staleness(5, versions, 2).tolist() == [True, True, True, False]
    with pytest.raises(ValueError, match="version 6 but the trainer holds version 5"):
        staleness(5, torch.tensor([6]))


def test_staleness_shares_are_the_histogram_over_0_to_max():
    shares = staleness_shares(torch.tensor([0, 1, 1, 2]), 2)
    assert shares == {0: 0.25, 1: 0.5, 2: 0.25}
    assert staleness_shares(torch.tensor([]), 1) == {0: 0.0, 1: 0.0}


def test_cross_stage_is_weights_on_a_two_segment_trajectory_equal_the_hand_computed_product():
    # Row 0: version 0 drew 2 tokens (log-probs -1.0, -2.0), version 1 continued with 1 (-0.5).
    # Row 1: version 0 drew 1 token (-0.2), version 1 continued with 2 (-0.3, -0.4).
    seg0 = torch.tensor([[-1.0, -2.0, 0.0], [-0.2, 0.0, 0.0]])
    mask0 = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    seg1 = torch.tensor([[-0.5, 0.0], [-0.3, -0.4]])
    mask1 = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    behaviour, mask = cross_stage_behaviour_logp([seg0, seg1], [mask0, mask1])
    expected_logp = [[-1.0, -2.0, -0.5, 0, 0], [-0.2, -0.3, -0.4, 0, 0]]
    torch.testing.assert_close(behaviour, torch.tensor(expected_logp))
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    old = torch.tensor([[-1.5, -1.0, -0.5, 0, 0], [-0.2, -0.1, -0.4, 0, 0]])  # π_old
    # Token level: π_old / π_(version that drew the token):
    # row 0: e^(-1.5+1.0) = e^-0.5, e^(-1.0+2.0) = e^1, e^(-0.5+0.5) = 1
    # row 1: e^0 = 1, e^(-0.1+0.3) = e^0.2, e^0 = 1
    tokens = correction_weights(old, behaviour, mask, "tis", cap=10.0, level="token")
    expected = [[math.exp(-0.5), math.e, 1, 0, 0], [1, math.exp(0.2), 1, 0, 0]]
    torch.testing.assert_close(tokens, torch.tensor(expected))
    # Sequence level: the product of the segments' ratios, e^-0.5 * e^1 * 1 = e^0.5; e^0.2.
    seq = correction_weights(old, behaviour, mask, "tis", cap=10.0, level="sequence")
    torch.testing.assert_close(seq[:, 0], torch.tensor([math.exp(0.5), math.exp(0.2)]))
    # TIS caps the product: with C = 1.5, row 0's e^0.5 = 1.65 becomes 1.5.
    capped = correction_weights(old, behaviour, mask, "tis", cap=1.5, level="sequence")
    torch.testing.assert_close(capped[:, 0], torch.tensor([1.5, math.exp(0.2)]))


def _rollouts(n: int = 4, t: int = 3, env: bool = False) -> Rollouts:
    g = torch.Generator().manual_seed(n)
    return Rollouts(
        prompt_ids=torch.randint(0, 9, (n, 2), generator=g),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        completion_ids=torch.randint(0, 9, (n, t), generator=g),
        completion_mask=torch.ones(n, t, dtype=torch.long),
        behaviour_logp=-torch.rand(n, t, generator=g),
        temperature=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool),
        completions=[f"c{i}" for i in range(n)],
        group_size=2,
        sources=("policy",) * n,
        env_mask=torch.zeros(n, t, dtype=torch.long).index_fill_(1, torch.tensor([1]), 1)
        if env
        else None,
    )


def _round(version: int, step: int = 0, env: bool = False) -> QueuedRound:
    r = _rollouts(env=env)
    scored = Scored(r, torch.arange(4.0), {"f": torch.ones(4)}, torch.ones(4, dtype=torch.bool))
    batch = PromptBatch(["a", "b"], [[{"role": "user", "content": "x"}]] * 2, {"answer": [1, 2]})
    return QueuedRound(batch, scored, version, step, served=["a"])


def test_the_queue_is_a_delay_line_and_drops_rounds_past_the_bound_whole():
    q = RolloutQueue()
    q.put(_round(0, step=0))
    assert q.take(version=0, max_staleness=1, ahead=1) is None  # still filling
    q.put(_round(1, step=1))
    taken = q.take(version=1, max_staleness=1, ahead=1)
    assert taken is not None and taken.step == 0 and len(q) == 1
    # Two rounds that lag 3 and 2 versions under version 4 with a bound of 1: both dropped.
    q = RolloutQueue()
    for v in (1, 2, 3, 4):
        q.put(_round(v, step=v))
    taken = q.take(version=4, max_staleness=1, ahead=1)
    assert taken is not None and taken.version == 3
    assert (q.dropped_rounds, q.dropped_rows) == (2, 8)
    assert q.lags(4) == [0]


def test_queued_rounds_save_as_plain_data_that_loads_weights_only_with_every_field():
    q = RolloutQueue()
    q.put(_round(3, step=7, env=True))
    buffer = io.BytesIO()
    torch.save(q.state_dict(), buffer)
    buffer.seek(0)
    back = RolloutQueue()
    back.load_state_dict(torch.load(buffer, weights_only=True))
    (a,), (b,) = q.rounds, back.rounds
    assert (b.version, b.step, b.served) == (3, 7, ["a"])
    assert b.batch == a.batch and b.scored.rollouts.sources == a.scored.rollouts.sources
    for f in ("completion_ids", "behaviour_logp", "env_mask"):
        assert torch.equal(getattr(b.scored.rollouts, f), getattr(a.scored.rollouts, f)), f
    assert torch.equal(b.scored.rollouts.loss_mask, a.scored.rollouts.loss_mask)
    assert torch.equal(b.scored.per_function["f"], a.scored.per_function["f"])


def test_to_plain_refuses_an_unregistered_dataclass():
    from dataclasses import dataclass

    @dataclass
    class Other:
        x: int = 1

    with pytest.raises(TypeError, match="Other is not registered"):
        to_plain(Other())
    assert from_plain(to_plain({"t": (1, [2, (3,)])})) == {"t": (1, [2, (3,)])}


def test_a_fingerprint_mismatch_names_both_versions():
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 3))
    sync = WeightSync()
    sync.push(0, model.named_parameters())
    assert sync.check(model.named_parameters()) == 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model[0].weight.add_(0.01)  # the update
    sync.push(1, model.named_parameters())
    assert sync.check(model.named_parameters()) == 1
    model.load_state_dict(before)  # a generator that kept version 0's weights
    with pytest.raises(WeightSyncError, match="holds version 0's, but version 1 was pushed"):
        sync.check(model.named_parameters())
    with torch.no_grad():
        model[1].bias.mul_(2)  # weights of no version
    with pytest.raises(WeightSyncError, match="no version pushed recently, but version 1") as e:
        sync.check(model.named_parameters())
    assert "2 of 4 parameters differ" in str(e.value)
    with pytest.raises(WeightSyncError, match="pushed after version 1"):
        sync.push(1, model.named_parameters())


def test_the_fingerprint_catches_a_swap_of_two_slices():
    # Position weights: the same values in another order give another fingerprint.
    a = torch.nn.Linear(4, 2, bias=False)
    sync = WeightSync()
    sync.push(0, a.named_parameters())
    with torch.no_grad():
        a.weight.copy_(a.weight.flip(0))
    with pytest.raises(WeightSyncError):
        sync.check(a.named_parameters())


def _split_and_fused(seed: int = 0):
    """One attention block under HF's names and as vLLM fuses it (q, k, v stacked)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, o = (torch.randn(8, 8, generator=gen) for _ in range(4))
    split = [
        ("model.layers.0.self_attn.q_proj.weight", q),
        ("model.layers.0.self_attn.k_proj.weight", k),
        ("model.layers.0.self_attn.v_proj.weight", v),
        ("model.layers.0.self_attn.o_proj.weight", o),
    ]
    fused = [
        ("model.layers.0.self_attn.qkv_proj.weight", torch.cat([q, k, v]).bfloat16()),
        ("model.layers.0.self_attn.o_proj.weight", o.bfloat16()),
    ]
    return split, fused


def test_module_sums_match_across_an_engines_fused_layout_and_dtype():
    split, fused = _split_and_fused()
    sync = WeightSync()
    sync.push(0, prints=module_sums(split, torch.bfloat16))  # the policy, as the engine holds it
    assert sync.check(prints=module_sums(fused)) == 0  # read back from the engine
    # The same block as the policy held it before its last update: a stale engine.
    stale = [(n, t.clone()) for n, t in split]
    with torch.no_grad():
        for _, t in split:
            t.add_(1e-2 * torch.randn_like(t))
    sync.push(1, prints=module_sums(split, torch.bfloat16))
    with pytest.raises(WeightSyncError, match="holds version 0's, but version 1 was pushed"):
        sync.check(prints=module_sums([(n, t.bfloat16()) for n, t in stale]))
    # A load that missed the attention block's output projection.
    with pytest.raises(WeightSyncError, match="1 of 1 parameters differ"):
        sync.check(prints=module_sums(fused[:1]))
