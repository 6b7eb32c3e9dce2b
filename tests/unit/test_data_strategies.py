"""Per-prompt statistics, replay and curriculum inside RLVRDataModule (no model involved)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.data.stats import PromptStats, group_outcome, observations
from rlvr_lightning.types import PromptBatch, StepOutput

G = 4


def fake_correct(prompt_id: str, step: int) -> list[bool]:
    """A deterministic group outcome per prompt and step: k in 0..G."""
    k = hashlib.sha1(f"{prompt_id}:{step}".encode()).digest()[0] % (G + 1)
    return [True] * k + [False] * (G - k)


def report(dm: RLVRDataModule, batch: PromptBatch, step: int) -> StepOutput:
    correct = torch.tensor([fake_correct(p, step) for p in batch.prompt_ids])  # [B, G]
    rewards = correct.float()
    trained = dm.train_group_mask(correct, rewards)
    out = StepOutput(
        step=step, prompt_ids=batch.prompt_ids, group_size=G, rewards=rewards, correct=correct,
        lengths=torch.ones(len(batch), G), pass_rate=rewards.mean(1),
        group_variance=rewards.var(1), trained=trained,
    )  # fmt: skip
    dm.on_step_output(out)
    return out


def make_dm(**kwargs) -> RLVRDataModule:
    kwargs = {"train_size": 60, "val_size": 20, "prompts_per_step": 8, **kwargs}
    dm = RLVRDataModule(**kwargs)
    dm.setup("fit")
    return dm


def run(dm: RLVRDataModule, steps: int, start: int = 0) -> list[list[str]]:
    seen = []
    for step in range(start, start + steps):
        batch = dm.compose_step()
        seen.append(batch.prompt_ids)
        report(dm, batch, step)
    return seen


def test_group_outcome():
    assert [group_outcome(k, 4) for k in (0, 2, 4)] == ["all_wrong", "mixed", "all_correct"]


def test_stats_record_history_outcomes_and_reuse():
    stats = PromptStats(history=2)
    out = StepOutput(
        step=0, prompt_ids=["a", "b"], group_size=4, rewards=torch.zeros(2, 4),
        correct=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]).bool(), lengths=torch.ones(2, 4),
        pass_rate=torch.tensor([0.5, 1.0]), group_variance=torch.tensor([1 / 3, 0.0]),
        trained=torch.tensor([True, False]),
    )  # fmt: skip
    stats.record(0, observations(out))
    stats.record(3, observations(out, replayed={"a"}))
    stats.record(5, observations(out, replayed={"a"}))
    a, b = stats.get("a"), stats.get("b")
    assert (a.seen, a.reused, a.last_step, list(a.pass_rates)) == (3, 2, 5, [0.5, 0.5])
    assert (b.last_step, list(b.outcomes)) == (-1, ["all_correct", "all_correct"])  # never trained
    assert stats.outcome_fractions() == {"all_correct": 0.5, "all_wrong": 0.0, "mixed": 0.5}
    restored = PromptStats()
    restored.load_state_dict(stats.state_dict())
    assert restored.state_dict() == stats.state_dict()


def test_every_step_reaches_the_stats():
    dm = make_dm()
    seen = run(dm, 3)
    assert len(dm.stats) == len({p for step in seen for p in step})
    assert dm.steps == 3


def test_replay_serves_mid_pass_rate_prompts_within_budget():
    dm = make_dm(replay=PromptReplay(fraction=0.5, cooldown_steps=1, min_pass_rate=0.25,
                                     max_pass_rate=0.75))  # fmt: skip
    seen = run(dm, 8)
    fresh_order = run(make_dm(), 8)
    replays = [[p for p in step if dm.stats.get(p).reused > 0] for step in seen]
    assert any(replays), "no prompt was ever replayed"
    for step in seen:
        assert len(step) == 8 and len(set(step)) == 8
    # Each step holds at most 4 replays (budget min(floor(8 * 0.5), 4)).
    fresh_seen = {p for step in fresh_order for p in step}
    for i, step in enumerate(seen):
        earlier = {p for s in seen[:i] for p in s}
        assert len([p for p in step if p in earlier]) <= 4
    assert sum(dm.stats.get(p).reused for p in dm.stats) > 0 and fresh_seen


def test_last_observed_marks_the_prompts_served_again():
    dm = make_dm(replay=PromptReplay(cooldown_steps=1))
    earlier: set[str] = set()
    replayed = 0
    for step in range(8):
        batch = dm.compose_step()
        report(dm, batch, step)
        assert [o.prompt_id for o in dm.last_observed] == batch.prompt_ids
        assert [o.replayed for o in dm.last_observed] == [p in earlier for p in batch.prompt_ids]
        earlier |= set(batch.prompt_ids)
        replayed += sum(o.replayed for o in dm.last_observed)
    assert replayed == sum(r.reused for r in dm.stats.records.values()) > 0


def test_curriculum_masks_low_variance_groups_and_refills_from_the_bank():
    cur = VarianceCurriculum(kappa_start=0.75, kappa_end=0.75, bank_min_score=0.75)
    dm = make_dm(curriculum=cur)
    batch = dm.compose_step()
    out = report(dm, batch, 0)
    scores = [cur.observation_score(o) for o in observations(out)]
    assert out.trained.tolist() == [s >= 0.75 for s in scores]
    banked = [p for p, s in zip(batch.prompt_ids, scores, strict=True) if s >= 0.75]
    freed = sum(s < 0.75 for s in scores)
    following = dm.compose_step().prompt_ids
    expected = min(freed, 4, len(banked))
    assert len(set(following) & set(banked)) == expected


def test_full_state_round_trip_resumes_the_same_sequence_and_stats():
    def strategies():
        return {
            "replay": PromptReplay(cooldown_steps=1, pass_rate_cooldown=(1, 2, 2, 3), seed=1),
            "curriculum": VarianceCurriculum(kappa_start=0.3, kappa_end=0.8, ramp_steps=6),
        }

    full = make_dm(**strategies())
    uninterrupted = run(full, 10)
    first = make_dm(**strategies())
    head = run(first, 4)
    resumed = make_dm(**strategies())
    resumed.load_state_dict(first.state_dict())
    tail = run(resumed, 6, start=4)
    assert head + tail == uninterrupted
    assert resumed.state_dict() == full.state_dict()


def test_resume_needs_the_same_strategies():
    state = make_dm(replay=PromptReplay()).state_dict()
    with pytest.raises(ValueError, match="configure it the same way"):
        make_dm().load_state_dict(state)


def test_draw_prompts_gives_fresh_prompts_not_in_the_step():
    dm = make_dm()
    batch = dm.compose_step()
    extra = dm.draw_prompts(5, batch.prompt_ids)
    assert len(extra) == 5 and not set(extra.prompt_ids) & set(batch.prompt_ids)


def test_ranks_compose_the_same_global_step_and_keep_disjoint_slices():
    from types import SimpleNamespace

    ranks = [make_dm(prompts_per_step=4, replay=PromptReplay(cooldown_steps=1)) for _ in range(2)]
    for r, dm in enumerate(ranks):
        dm.trainer = SimpleNamespace(global_rank=r, world_size=2)
    for step in range(6):
        slices = [dm.compose_step() for dm in ranks]
        assert not set(slices[0].prompt_ids) & set(slices[1].prompt_ids)
        union = PromptBatch(
            slices[0].prompt_ids + slices[1].prompt_ids, slices[0].messages + slices[1].messages
        )
        for dm in ranks:  # what gather_observations gives every rank under DDP
            report(dm, union, step)
    assert ranks[0].state_dict() == ranks[1].state_dict()
    assert any(ranks[0].stats.get(p).reused for p in ranks[0].stats)
