"""MixedPolicyGuidance on the tiny in-process model: sources, injection policies, checkpoints."""

from __future__ import annotations

import copy
import dataclasses

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rlvr_lightning.callbacks import MixedPolicyGuidance
from rlvr_lightning.callbacks._policy_scores import answer_prefix, comprehension

from rlvr_lightning import RLVRModule
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.rewards import extract_boxed
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import PromptBatch, Sampling


def fake_accuracy(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Every sample of the prompt whose answer is ``easy`` is correct; otherwise a boxed match."""
    return [
        float(a == "easy" or extract_boxed(c) == a)
        for c, a in zip(completions, answer, strict=True)
    ]


def even_length(completions: list[str], **_: object) -> list[float]:
    """A coin flip per sample for random models: groups are mixed, so experience is stored."""
    return [float(len(c) % 2 == 0) for c in completions]


def _module(reward=fake_accuracy, g: int = 4) -> RLVRModule:
    return RLVRModule(
        "tiny:0", **grouped(reward_fns=[reward], sampling=Sampling(max_new_tokens=6, group_size=g))
    )


def _batch(columns: dict) -> PromptBatch:
    n = len(next(iter(columns.values())))
    return PromptBatch(
        prompt_ids=[f"p{i}" for i in range(n)],
        messages=[[{"role": "user", "content": f"q{i}"}] for i in range(n)],
        columns=columns,
    )


def _step(module, cb, batch, seed=0):
    batch = cb.on_before_rollout(None, module, batch) or batch
    torch.manual_seed(seed)
    return cb.on_after_score(None, module, module.score(batch, module.rollout(batch)))


def test_reference_always_replaces_num_replaced_slots_per_group():
    module = _module()
    cb = MixedPolicyGuidance(source="reference", injection="always", reward=1.0)
    out = _step(module, cb, _batch({"answer": ["easy", "7"], "solution": [None, "3 + 4 = 7"]}))
    tags = out.rollouts.sources
    assert [i for i, s in enumerate(tags) if s == "reference"] == [3, 7]
    assert out.rollouts.completions[7] == "3 + 4 = 7\n\n\\boxed{7}"
    assert out.rewards[3].item() == 1.0 and out.rewards[7].item() == 1.0  # forced reward
    assert out.metrics["guidance/injected"] == 2.0


def test_on_all_fail_injects_teachers_only_where_every_sample_failed():
    module = _module()
    cb = MixedPolicyGuidance(source="teacher", injection="on_all_fail", num_replaced=2)
    teachers = [["a \\boxed{easy}"], ["first \\boxed{7}", "second \\boxed{7}", "third"]]
    out = _step(module, cb, _batch({"answer": ["easy", "7"], "teacher_responses": teachers}))
    rows = [i for i, s in enumerate(out.rollouts.sources) if s == "teacher"]
    assert len(rows) == 2 and all(4 <= r < 8 for r in rows)  # AMPO: random incorrect slots
    assert [out.rollouts.completions[r] for r in rows] == ["first \\boxed{7}", "second \\boxed{7}"]


def test_teacher_model_writes_the_guidance_of_failing_groups():
    module = _module()
    cb = MixedPolicyGuidance(
        source="teacher", injection="on_all_fail", teacher_model="tiny:1", teacher_candidates=3
    )
    cb.setup(None, module, "fit")
    assert cb.teacher is not None and not any(
        p.requires_grad for p in cb.teacher.model.parameters()
    )
    batch = _batch({"answer": ["easy", "7"]})
    torch.manual_seed(5)
    three = dataclasses.replace(module.sampling, group_size=3)
    expected = cb.teacher.complete([batch.messages[1]], three, module.device)[0]
    cb.on_before_rollout(None, module, batch)
    torch.manual_seed(0)
    scored = module.score(batch, module.rollout(batch))
    torch.manual_seed(5)  # the teacher samples the same completions as above
    out = cb.on_after_score(None, module, scored)
    assert out.rollouts.sources == ("policy",) * 7 + ("teacher",)
    assert out.rollouts.completions[7] == expected[0]
    assert len(expected) == 3


def test_comprehension_selection_orders_teachers_by_ground_truth_probability():
    module = _module()
    cb = MixedPolicyGuidance(
        source="teacher", num_replaced=1, teacher_selection="comprehension", answer_column="answer"
    )
    teachers = ["x \\boxed{12}", "yy \\boxed{3}", "zzz"]
    batch = _batch({"answer": ["7"], "teacher_responses": [teachers]})
    rollouts = module.rollout(batch)
    scores = comprehension(module, rollouts, 0, teachers, "7")
    assert scores.shape == (3,) and bool(((scores > 0) & (scores < 1)).all())
    out = _step(module, cb, batch)
    assert out.rollouts.completions[3] == teachers[int(scores.argmax())]


def test_answer_prefix():
    assert answer_prefix("so \\boxed{12} done") == "so \\boxed{"
    assert answer_prefix("no box ") == "no box \\boxed{"


def test_setup_requires_room_in_the_group():
    cb = MixedPolicyGuidance(num_replaced=3)
    with pytest.raises(ValueError, match="group_size to at least 5"):
        cb.setup(None, _module(), "fit")


def test_experience_is_collected_then_replayed_with_behaviour_logprobs():
    module = _module(even_length)
    cb = MixedPolicyGuidance(source="experience", injection="always", experience_ratio=0.5)
    cb.setup(None, module, "fit")
    first = _batch({"answer": ["1", "2", "3", "4"]})
    _step(module, cb, first)
    assert len(cb.pool) > 0
    second = PromptBatch(
        prompt_ids=[f"n{i}" for i in range(4)],
        messages=[[{"role": "user", "content": f"new {i}"}] for i in range(4)],
        columns={"answer": ["5", "6", "7", "8"]},
    )
    before = {
        tuple(t["token_ids"]): t["behaviour_logp"]
        for e in cb.pool.entries.values()
        for t in e["trajectories"]
    }
    out = _step(module, cb, second, seed=1)
    pooled = [b for b, pid in enumerate(cb._batch.prompt_ids) if not pid.startswith("n")]
    assert len(pooled) == min(len(before), 2) and cb._batch.prompt_ids[:2] == ["n0", "n1"]
    rows = [i for i, s in enumerate(out.rollouts.sources) if s == "experience"]
    assert [r // 4 for r in rows] == pooled
    assert all(r % 4 == 3 for r in rows)  # ExGRPO: G - 1 samples, the trajectory appended
    for row in rows:
        n = int(out.rollouts.completion_mask[row].sum())
        stored = before[tuple(out.rollouts.completion_ids[row, :n].tolist())]
        assert torch.allclose(out.rollouts.behaviour_logp[row, :n], torch.tensor(stored))
        assert out.rollouts.offpolicy_mask[row, :n].all()


def test_delayed_start_waits_for_the_solve_rate():
    module = _module()
    cb = MixedPolicyGuidance(source="reference", injection="delayed", start_solve_rate=0.35)
    hard = _batch({"answer": ["7", "8"]})  # solve rate 0: stays off
    out = _step(module, cb, hard)
    assert not cb.active and out.metrics["guidance/injected"] == 0.0
    easy = _batch({"answer": ["easy", "8"]})  # solve rate 0.5 > 0.35: switched on
    out = _step(module, cb, easy)
    assert cb.active and out.metrics["guidance/injected"] == 2.0


def test_experience_pool_survives_a_checkpoint_round_trip(tmp_path):
    def run(max_steps: int, cb: MixedPolicyGuidance, ckpt: str | None = None) -> pl.Trainer:
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=max_steps,
            limit_val_batches=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[cb, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        )
        data = RLVRDataModule(train_size=32, val_size=4, prompts_per_step=4)
        trainer.fit(_module(even_length), datamodule=data, ckpt_path=ckpt)
        return trainer

    first = Snapshotting(source="experience", injection="always")
    run(2, first)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    state = saved["callbacks"][first.state_key]
    assert state["pool"]["entries"], "nothing was collected"
    assert state["pool"]["entries"] == first.pool.entries and state["steps"] == 2
    resumed = Snapshotting(source="experience", injection="always")
    run(3, resumed, ckpt=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.at_start == (first.pool.entries, first.steps)
    assert resumed.steps == 3


class Snapshotting(MixedPolicyGuidance):
    """Records the pool as the fit starts, after Lightning restored the checkpoint."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.at_start = (copy.deepcopy(self.pool.entries), self.steps)
