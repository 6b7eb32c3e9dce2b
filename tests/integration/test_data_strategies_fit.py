"""Replay, curriculum and dynamic sampling in real ``Trainer.fit`` runs of the tiny model."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from rlvr_lightning import RLVRModule
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.testing import grouped, quiet_trainer
from rlvr_lightning.types import Sampling

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def coin(completions: list[str], **_: object) -> list[float]:
    """A binary reward a random tiny model earns about half the time."""
    return [float(bool(c) and ord(c[0]) % 2 == 0) for c in completions]


class Record(RLVRCallback):
    def __init__(self) -> None:
        self.steps: list[list[str]] = []
        self.metrics: list[dict[str, float]] = []

    def on_step_output(self, trainer, module, output) -> None:
        self.steps.append(list(output.prompt_ids))
        self.metrics.append(dict(output.metrics))


def module(**kwargs) -> RLVRModule:
    return RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[coin],
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=4),
            micro_batch_size=16,
            lr=1e-3,
            **kwargs,
        ),
    )


def datamodule(**kwargs) -> RLVRDataModule:
    return RLVRDataModule(
        train_size=40,
        val_size=4,
        prompts_per_step=4,
        replay=PromptReplay(cooldown_steps=1, min_pass_rate=0.25, max_pass_rate=0.75),
        curriculum=VarianceCurriculum(kappa_start=0.5, kappa_end=0.9, ramp_steps=4),
        **kwargs,
    )


def fit(max_steps: int, ckpt_path=None, **module_kwargs):
    pl.seed_everything(0)
    record = Record()
    trainer = quiet_trainer(max_steps=max_steps, callbacks=[record])
    dm = datamodule()
    trainer.fit(module(**module_kwargs), datamodule=dm, ckpt_path=ckpt_path)
    return trainer, dm, record


def test_resume_gives_the_same_prompts_and_statistics(tmp_path):
    _, full_dm, full = fit(6)
    trainer, _, head = fit(3)
    trainer.save_checkpoint(tmp_path / "k.ckpt")
    _, resumed_dm, tail = fit(6, ckpt_path=tmp_path / "k.ckpt")
    assert head.steps + tail.steps == full.steps
    assert resumed_dm.state_dict() == full_dm.state_dict()
    assert any(resumed_dm.stats.get(p).reused for p in resumed_dm.stats), "nothing replayed"
    saved = torch.load(tmp_path / "k.ckpt", weights_only=True)  # plain data only
    assert saved["RLVRDataModule"]["stats"]["records"]


def test_curriculum_mask_reaches_the_update_and_the_stats():
    _, dm, record = fit(3)
    fractions = [m["trained_group_frac"] for m in record.metrics]
    assert all(0.0 <= f <= 1.0 for f in fractions) and min(fractions) < 1.0
    trained_steps = {dm.stats.get(p).last_step for p in dm.stats}
    assert -1 in trained_steps or len(trained_steps) > 1


def test_dynamic_sampling_draws_extra_prompts_and_logs_rounds():
    _, dm, record = fit(2, dynamic_sampling=True, max_gen_rounds=2)
    for m, ids in zip(record.metrics, record.steps, strict=True):
        assert m["dynamic/prompts"] == len(ids) >= 4
        assert m["dynamic/rounds"] <= 2
        assert m["trained_group_frac"] * len(ids) <= 4 + 1e-6  # cut to the target
        assert len(set(ids)) == len(ids)
    assert dm.steps == 2


def test_lightning_does_not_replace_the_sampler_of_the_prompt_stream():
    from lightning.pytorch.trainer.states import RunningStage
    from torch.utils.data import DistributedSampler

    # A DDP trainer that is configured but never launched: what would it do to our loaders?
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=True)
    dm = RLVRDataModule(train_size=40, val_size=8, prompts_per_step=2)
    dm.trainer = trainer
    prepare = trainer._data_connector._prepare_dataloader
    train = dm.train_dataloader()
    prepared = prepare(train, shuffle=True, mode=RunningStage.TRAINING)
    assert prepared.dataset is train.dataset  # our stream, grouping and order untouched
    assert not isinstance(prepared.sampler, DistributedSampler)
    # The hazard it avoids: a map-style dataset of prompts would be re-split by a sampler.
    val = prepare(dm.val_dataloader()[0], shuffle=False, mode=RunningStage.VALIDATING)
    assert isinstance(val.sampler, DistributedSampler)


def never(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Correct only for the ground-truth reference's boxed answer: every sample is wrong."""
    return [float(f"\\boxed{{{a}}}" in c) for c, a in zip(completions, answer, strict=True)]


def test_an_all_wrong_group_reaches_the_injection_hook_before_dynamic_sampling_judges_it():
    from rlvr_lightning.callbacks import GroundTruthInjection

    class Seen(GroundTruthInjection):
        """Records the sampled outcome of every group the hook receives."""

        def __init__(self) -> None:
            super().__init__(reward_capping=False)
            self.seen: list[int] = []  # sampled correct count per group

        def on_after_score(self, trainer, module, scored):
            g = scored.rollouts.group_size
            self.seen += scored.sampled_correct.view(-1, g).sum(1).tolist()
            return super().on_after_score(trainer, module, scored)

    pl.seed_everything(0)
    seen, record = Seen(), Record()
    model = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[never],
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=4),
            dynamic_sampling=True,
            max_gen_rounds=2,
            micro_batch_size=16,
        ),
    )
    dm = RLVRDataModule(train_size=40, val_size=4, prompts_per_step=4)
    quiet_trainer(max_steps=2, callbacks=[seen, record]).fit(model, datamodule=dm)
    assert seen.seen == [0] * 8  # every group all wrong, and each one reached the hook
    for m in record.metrics:
        # The references made each group informative: no extra round, all groups trained.
        assert m["dynamic/rounds"] == 0 and m["trained_group_frac"] == 1.0
        assert m["accuracy"] == 0.0 and m["accuracy_with_offpolicy"] == 0.25
    assert seen.injected_total == 8
    assert all(r.pass_rate == 0.0 for r in dm.stats.records.values())


def test_partial_rollouts_with_replay_curriculum_injection_and_adaptive_temperature(
    uneven_lengths,
):
    """Partial rollouts under every mechanism that reads or shapes a group: replay and the
    curriculum read outcomes of groups admitted steps earlier, ground-truth injection sees each
    finished round, adaptive temperature sets the temperature of prompts as they join."""
    from rlvr_lightning.callbacks import AdaptiveTemperature, GroundTruthInjection

    pl.seed_everything(0)
    record, inject = Record(), GroundTruthInjection(reward_capping=False)
    model = module(
        rollout_mode="async", max_staleness=3, concurrent_rollouts=8, partial_chunk_tokens=4
    )
    model.sampling = Sampling(max_new_tokens=12, temperature=1.0, group_size=4)
    dm = datamodule()
    trainer = quiet_trainer(max_steps=6, callbacks=[record, AdaptiveTemperature(), inject])
    trainer.fit(model, datamodule=dm)
    # Every reported step is a trained round (the curriculum may leave one without an update).
    assert trainer.global_step == 6 and dm.composer.steps == len(record.steps) >= 6
    crossed = sum(m["async/partial_cross_stage_rows"] for m in record.metrics)
    assert crossed > 0  # some trained rows were continued under a newer version
    for ids, m in zip(record.steps, record.metrics, strict=True):
        assert len(ids) == 4 and len(set(ids)) == 4  # a step trains its prompt count, once each
        assert m["async/dropped_rows"] == 0.0
    trained = [p for ids in record.steps for p in ids]
    assert set(dm.stats.records) >= set(trained)  # every trained group reported to the data


def test_the_rollout_worker_under_replay_curriculum_injection_and_adaptive_temperature():
    """The overlapped schedule (the HF engine on its own policy copy in a worker process) under
    every mechanism that reads or shapes a group: each round is sent one version ahead and
    scored under the reward state of when it was sent, so replay and the curriculum read
    outcomes a step late, injection sees every round, adaptive temperature sets the temperature
    of the prompts as they are sent."""
    from rlvr_lightning.callbacks import AdaptiveTemperature, GroundTruthInjection

    from rlvr_lightning.rollout.process import ProcessEngine

    class Temperatures(AdaptiveTemperature):
        def __init__(self) -> None:
            super().__init__()
            self.set: list[list[float | None]] = []

        def on_before_generate(self, trainer, module, batch):
            batch = super().on_before_generate(trainer, module, batch)
            self.set.append(list(batch.temperatures or []))
            return batch

    pl.seed_everything(0)
    record, temps = Record(), Temperatures()
    inject = GroundTruthInjection(reward_capping=False)
    model = module(rollout_mode="async", max_staleness=1, engine_kwargs={"process": True})
    dm = datamodule()
    trainer = quiet_trainer(max_steps=5, callbacks=[record, temps, inject])
    trainer.fit(model, datamodule=dm)
    assert isinstance(model.engine, ProcessEngine)  # the worker ran, overlapped
    assert trainer.global_step == 5 and len(record.steps) >= 5
    for ids, m in zip(record.steps, record.metrics, strict=True):
        assert len(ids) == 4 and len(set(ids)) == 4
        assert m["async/dropped_rows"] == 0.0
        assert m["async/staleness_0"] + m["async/staleness_1"] == 1.0
        assert "async/trainer_idle_s" in m and "async/worker_idle_s" in m
    assert sum(m["async/staleness_1"] for m in record.metrics) > 0  # trained one version late
    trained = [p for ids in record.steps for p in ids]
    assert set(dm.stats.records) >= set(trained)  # every trained group reported to the data
    assert any(dm.stats.get(p).reused for p in dm.stats), "nothing replayed"
    assert len(temps.set) >= len(record.steps) and all(len(t) == 4 for t in temps.set)
    assert inject.injected_total > 0
    model.engine.close()
