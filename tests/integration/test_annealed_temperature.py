"""EAD on a tiny model: the schedule reaches the sampler, π_old is recomputed at the base
temperature, the step survives a weights_only checkpoint, and ERPO composes with it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from rlvr_lightning.callbacks import AdaptiveTemperature, AnnealedTemperature

from rlvr_lightning import RLVRModule
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.testing import digit_fraction, grouped
from rlvr_lightning.types import Sampling

T_MAX = 8
# Fast annealing so that 8 tokens see it: d_s = 4 + 2 s, the first 2 tokens protected.
EAD = dict(tau_max=1.2, tau_min=0.3, d0=4.0, alpha=2.0, c=2)


def always_right(completions, **_):
    return [1.0] * len(completions)


def _run(tmp_path, max_steps: int, ckpt: str | None = None):
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[always_right, digit_fraction],
            sampling=Sampling(max_new_tokens=T_MAX, temperature=1.0, group_size=4),
            micro_batch_size=8,
        ),
    )
    seen = []
    generate = module.engine.generate

    def spy(ids, mask, sampling, temperatures=None, position_temperatures=None):
        r = generate(ids, mask, sampling, temperatures, position_temperatures=position_temperatures)
        seen.append((temperatures, position_temperatures, r))
        return r

    module.engine.generate = spy
    ead, erpo = AnnealedTemperature(**EAD), AdaptiveTemperature()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[erpo, ead, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
    )
    data = RLVRDataModule("addition", train_size=2, val_size=2, prompts_per_step=2)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    return trainer, ead, seen


def test_ead_fit_checkpoint_and_erpo(tmp_path):
    trainer, ead, seen = _run(tmp_path, max_steps=2)
    assert len(seen) == 2 and ead.step == 2
    for step, (temps, factors, r) in enumerate(seen):
        assert torch.allclose(factors, ead.schedule(step, T_MAX))
        # ERPO's per-row temperature times EAD's factor, position by position.
        base = torch.ones(8) if temps is None else temps
        t = r.completion_ids.shape[1]
        assert torch.allclose(r.position_temperature, base[:, None] * factors[None, :t])
    assert seen[1][0] is not None and torch.allclose(seen[1][0], torch.full((8,), 1.1))
    # Position 2 at step 0 (d = 4): 2.2 - e^0.5 = 0.5513; at step 1 (d = 6): 2.2 - e^(1/3) =
    # 0.804388; position 7 is at the floor both times (2.2 - e^(7/6) < 0.3).
    assert float(seen[0][1][2]) == pytest.approx(0.551279, abs=1e-5)
    assert float(seen[1][1][2]) == pytest.approx(0.804388, abs=1e-5)
    assert float(seen[0][1][7]) == float(seen[1][1][7]) == pytest.approx(0.3)
    logged = trainer.logged_metrics
    assert float(logged["train/mismatch/kl"]) > 0  # π_old recomputed at T = 1, TIS applies
    assert 0.3 <= float(logged["train/temperature/annealed_min"])
    assert float(logged["train/temperature/annealed_min"]) <= float(
        logged["train/temperature/annealed_mean"]
    )

    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert saved["callbacks"][ead.state_key] == {"step": 2}
    _, resumed, again = _run(tmp_path, max_steps=3, ckpt=str(tmp_path / "ckpt" / "last.ckpt"))
    assert len(again) == 1 and torch.allclose(again[0][1], resumed.schedule(2, T_MAX))
    assert resumed.step == 3
