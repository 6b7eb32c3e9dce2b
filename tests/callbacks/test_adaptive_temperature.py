"""AdaptiveTemperature (ERPO): per-prompt temperatures from sampled outcomes, with correction."""

from __future__ import annotations

import pytest
import torch
from rlvr_lightning.callbacks import AdaptiveTemperature
from rlvr_lightning.callbacks.adaptive_temperature import next_temperature

from rlvr_lightning import RLVRModule
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.testing import digit_fraction, grouped, quiet_trainer
from rlvr_lightning.types import Sampling


def always_right(completions, **_):
    return [1.0] * len(completions)


def test_next_temperature_by_hand():
    # All correct: +0.1 up to the cap; mixed: reset, or halve the distance to t0.
    assert next_temperature(1.0, 1.0, 1.0, 0.1, 1.5, "reset", 0.5) == 1.1
    assert next_temperature(1.45, 1.0, 1.0, 0.1, 1.5, "reset", 0.5) == 1.5
    assert next_temperature(1.3, 0.25, 1.0, 0.1, 1.5, "reset", 0.5) == 1.0
    assert next_temperature(1.4, 0.5, 1.0, 0.1, 1.5, "decay", 0.5) == 1.2  # 1 + 0.5 * 0.4
    assert next_temperature(1.4, 0.0, 1.0, 0.1, 1.5, "decay", 0.0) == 1.0


def _fit(rewards, steps=3, callback=None):
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=rewards,
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=4),
            micro_batch_size=8,
        ),
    )
    seen = []
    generate = module.engine.generate

    def spy(ids, mask, sampling, temperatures=None, **kwargs):
        seen.append(None if temperatures is None else [round(t, 4) for t in temperatures.tolist()])
        return generate(ids, mask, sampling, temperatures, **kwargs)

    module.engine.generate = spy
    callback = callback or AdaptiveTemperature()
    data = RLVRDataModule("addition", train_size=2, val_size=2, prompts_per_step=2)
    trainer = quiet_trainer(max_steps=steps, callbacks=[callback])
    trainer.fit(module, datamodule=data)
    return trainer, callback, seen


def test_all_correct_prompts_heat_up_and_the_loss_is_corrected():
    trainer, cb, seen = _fit([always_right, digit_fraction])
    # The same two prompts every step, always all correct: 1.0, 1.1, 1.2 for all 8 rows.
    assert [sorted(set(t)) for t in seen] == [[1.0], [1.1], [1.2]]
    assert sorted(cb.temperatures.values()) == [1.3, 1.3]
    logged = trainer.logged_metrics
    assert float(logged["train/temperature/raised_prompts"]) == 2.0
    # Rows sampled at 1.2 are scored by the trainer at 1.0: π_old != behaviour, TIS applies.
    assert float(logged["train/mismatch/kl"]) > 0
    state = cb.state_dict()
    restored = AdaptiveTemperature()
    restored.load_state_dict(state)
    assert restored.temperatures == cb.temperatures


def test_prompts_that_are_not_mastered_stay_at_the_base_temperature():
    # The tiny random model never gets a sum right: every group all wrong, nothing changes.
    trainer, cb, seen = _fit(None, steps=2)
    assert cb.temperatures == {} and all(set(t) == {1.0} for t in seen)
    assert "train/mismatch/kl" not in trainer.logged_metrics  # HF engine, base temperature


def test_greedy_sampling_is_refused():
    module = RLVRModule("tiny:0", **grouped(reward_fns=[digit_fraction]))
    module.sampling = Sampling(max_new_tokens=4, temperature=0.0, group_size=2)
    with pytest.raises(ValueError, match="temperature > 0"):
        AdaptiveTemperature().setup(None, module, "fit")
