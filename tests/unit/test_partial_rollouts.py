"""Partial rollouts (CoPRIS) on hand-made rows: the pool's order, concurrency and staleness
drop, early termination, rows continued under the next version with each token's behaviour
log-prob from the version that drew it, and the pool through a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr_lightning.algorithms.correction import correction_weights
from rlvr_lightning.asynchrony.partial import InFlight, PartialPool
from rlvr_lightning.asynchrony.plain import to_plain
from rlvr_lightning.rollout.partial import assemble
from rlvr_lightning.stages import partial
from rlvr_lightning.testing import byte_tokenizer
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling

EOS = 2


class ScriptedEngine:
    """Row ``r`` of a prompt whose first token is ``k`` writes ``LENGTHS[k]`` tokens in all
    (then EOS); every token it draws has log-prob ``-(version + 1) / 10``."""

    shares_policy = True

    def __init__(self, lengths: dict[int, int]) -> None:
        self.lengths, self.version, self.calls = lengths, 0, []

    def generate(self, ids, mask, sampling, temperatures=None, position_temperatures=None):
        self.calls.append(ids.shape[0])
        rows, logp = [], -(self.version + 1) / 10
        for p, m in zip(ids, mask, strict=True):
            real = p[m.bool()].tolist()
            total, written = self.lengths[real[0]], len(real) - 1
            left = total - written  # tokens before EOS
            row = [7] * min(left, sampling.max_new_tokens)
            if len(row) < sampling.max_new_tokens:
                row.append(EOS)
            rows.append(row)
        width = max(len(r) for r in rows)
        c = torch.zeros(len(rows), width, dtype=torch.long)
        cm = torch.zeros_like(c)
        for i, r in enumerate(rows):
            c[i, : len(r)], cm[i, : len(r)] = torch.tensor(r), 1
        return Rollouts(
            prompt_ids=ids, prompt_mask=mask, completion_ids=c, completion_mask=cm,
            behaviour_logp=cm * logp, temperature=torch.ones(len(rows)),
            truncated=torch.tensor([EOS not in r for r in rows]),
            completions=["x"] * len(rows), group_size=1,
        )  # fmt: skip

    def load_weights(self, named) -> None:  # pragma: no cover - shares the policy
        pass


def batch(first_tokens: list[int]) -> tuple[PromptBatch, tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.tensor([[k] for k in first_tokens])  # [B, 1]: one prompt token each
    b = PromptBatch(
        [f"p{k}" for k in first_tokens], [[{"role": "user", "content": "q"}]] * len(ids)
    )
    return b, (ids, torch.ones_like(ids))


SAMPLING = Sampling(max_new_tokens=8, temperature=1.0, group_size=2)


def step(pool, engine, prompts, version, cap=4, chunk=3):
    engine.version = version
    if prompts:
        b, enc = batch(prompts)
        partial.admit(pool, b, enc, SAMPLING, [], version)
    pool.drop_stale(version, 1)
    chunks = partial.decode_until(engine, 0, pool, SAMPLING, (cap, chunk, 2), version)
    return chunks, pool.take(2)


def test_early_termination_trains_the_short_groups_and_carries_the_long_ones():
    # Prompts 10, 11 end after 2 tokens (+EOS); prompts 12, 13 need 7 tokens (+EOS).
    engine, pool = ScriptedEngine({10: 2, 11: 2, 12: 7, 13: 7}), PartialPool()
    chunks, done = step(pool, engine, [12, 10, 13, 11], version=0)
    assert chunks == 1  # one chunk of 3 tokens finished 10 and 11: stop there
    assert [g.batch.prompt_ids[0] for g in done] == ["p10", "p11"]
    assert [len(g.written(0)) for g in pool.groups] == [3, 3]  # 12 and 13, carried
    chunks, done = step(pool, engine, [], version=1)
    assert chunks == 2 and [g.batch.prompt_ids[0] for g in done] == ["p12", "p13"]
    row = done[0].rows[0]
    assert [(s.version, len(s.ids)) for s in row] == [(0, 3), (1, 5)]  # 7 tokens + EOS


def test_concurrency_caps_the_groups_that_decode():
    engine, pool = ScriptedEngine({k: 7 for k in range(10, 16)}), PartialPool()
    _, done = step(pool, engine, [10, 11, 12, 13, 14, 15], version=0, cap=2)
    assert engine.calls == [4, 4, 4]  # 2 groups x 2 rows decode, 3 chunks to EOS
    assert [g.batch.prompt_ids[0] for g in done] == ["p10", "p11"]
    assert [g.oldest() for g in pool.groups] == [None] * 4  # waited, nothing written: no age


def test_a_group_written_more_than_max_staleness_versions_ago_is_dropped():
    engine, pool = ScriptedEngine({10: 2, 11: 2, 12: 30}), PartialPool()
    step(pool, engine, [10, 11, 12], version=0, chunk=2)
    step(pool, engine, [10, 11], version=1, chunk=2)  # 12 written by 0 and 1, unfinished
    assert pool.dropped_groups == 0
    step(pool, engine, [], version=3, chunk=2)  # 12's oldest segment lags 3 > 1
    assert (pool.dropped_groups, pool.dropped_rows) == (1, 2)
    assert all(g.batch.prompt_ids != ["p12"] for g in pool.groups)


def test_rows_whose_long_segments_differ_are_joined_to_the_longest_row():
    """Row 0 wrote 3 tokens under version 0 and 1 under version 1, row 1 the other way round:
    the segments' widths sum to 6, the longest row holds 4 (found on vLLM by the benchmark)."""
    tok = byte_tokenizer()
    segments = [
        [([7, 8, 9], [-0.1, -0.2, -0.3]), ([10], [-0.4])],
        [([7], [-0.5]), ([8, 9, 10], [-0.6, -0.7, -0.8])],
    ]
    r = assemble(tok, [[5], [5]], segments, [False, False], [1.0, 1.0], 2)
    assert r.completion_ids.tolist() == [[7, 8, 9, 10], [7, 8, 9, 10]]
    torch.testing.assert_close(
        r.behaviour_logp, torch.tensor([[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7, -0.8]])
    )
    with pytest.raises(ValueError, match="differ in length"):
        assemble(tok, [[5]], [[([7, 8], [-0.1])]], [False], [1.0], 1)


def test_cross_stage_rows_carry_each_versions_log_probs_by_hand():
    tok = byte_tokenizer()
    prompts = [[5, 6], [5]]
    segments = [[([7, 8], [-0.1, -0.2]), ([9], [-0.3])], [([7], [-0.5])]]
    r = assemble(tok, prompts, segments, [False, True], [1.0, 1.0], 2)
    pad = tok.pad_token_id
    assert r.prompt_ids.tolist() == [[5, 6], [pad, 5]] and r.prompt_mask.tolist() == [
        [1, 1],
        [0, 1],
    ]
    assert r.completion_ids.tolist() == [[7, 8, 9], [7, pad, pad]]
    torch.testing.assert_close(
        r.behaviour_logp, torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]])
    )
    # Through the rollout correction (TIS, sequence level): row 0's weight is the product of
    # its per-token ratios over both segments, exp((-0.15 - 0.25 - 0.05) - (-0.1 - 0.2 - 0.3)).
    old = torch.tensor([[-0.15, -0.25, -0.05], [-0.5, 0.0, 0.0]])
    w = correction_weights(
        old, r.behaviour_logp, r.completion_mask.float(), "tis", 10.0, "sequence"
    )
    torch.testing.assert_close(w[0], torch.full((3,), math.exp(0.15)))
    torch.testing.assert_close(w[1], torch.tensor([1.0, 0.0, 0.0]))


def test_the_pool_survives_a_checkpoint_as_plain_data(tmp_path):
    engine, pool = ScriptedEngine({10: 2, 11: 2, 12: 9}), PartialPool()
    step(pool, engine, [10, 11, 12], version=0)
    torch.save(pool.state_dict(), tmp_path / "pool.pt")
    restored = PartialPool()
    restored.load_state_dict(torch.load(tmp_path / "pool.pt", weights_only=True))
    assert isinstance(restored.groups[0], InFlight) and restored.groups[0].written(0) == [7] * 3
    assert to_plain(restored.state_dict()) == to_plain(pool.state_dict())


def test_fewer_concurrent_rollouts_than_prompts_is_refused():
    from rlvr_lightning.options.asynchrony import Asynchrony

    with pytest.raises(ValueError, match="set rollout_mode: async too"):
        Asynchrony(concurrent_rollouts=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        Asynchrony(rollout_mode="async", concurrent_rollouts=0)


def test_a_prompt_served_again_while_in_flight_trains_once_a_step():
    # Replay served p10 again while its first group was in flight: both finish together.
    engine, pool = ScriptedEngine({10: 2, 11: 2}), PartialPool()
    b, enc = batch([10, 10, 11])
    partial.admit(pool, b, enc, SAMPLING, [], 0)
    partial.decode_until(engine, 0, pool, SAMPLING, (4, 3, 2), 0)
    assert pool.finished_count() == 2  # two prompts, though three groups
    first = [g.batch.prompt_ids[0] for g in pool.take(2)]
    assert first == ["p10", "p11"] and [g.batch.prompt_ids[0] for g in pool.take(2)] == ["p10"]
