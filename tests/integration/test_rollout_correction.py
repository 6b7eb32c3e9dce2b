"""π_old under an engine whose numerics differ from the trainer's (vLLM, another dtype).

``OffsetEngine`` is the HF engine claiming to hold its own weights and reporting behaviour
log-probs shifted by a constant, as an engine with other kernels or another dtype would; a
bf16-mixed fit must then use the trainer's log-probs as ``π_old`` and weight by TIS.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.testing import quiet_trainer, tiny_module

OFFSET = 0.3


class OffsetEngine(HFEngine):
    @property
    def shares_policy(self) -> bool:
        return False

    def generate(self, *args, **kwargs):
        r = super().generate(*args, **kwargs)
        return dataclasses.replace(
            r, behaviour_logp=(r.behaviour_logp - OFFSET) * r.completion_mask
        )


def _fit(old_logprobs: str, precision: str = "bf16-mixed", separate_pass: bool = False):
    torch.manual_seed(0)
    module = tiny_module(old_logprobs=old_logprobs)
    module._engine = OffsetEngine(module.policy, module.tokenizer)
    if separate_pass:  # π_old from its own no-grad pass, as for several optimiser steps
        module._one_step_per_rollout = lambda: False
    seen = []
    loss_fn = module.updater.loss_fn

    def spy(logp, old_logp, advantages, mask, **clip):
        seen.append((logp.detach().float(), old_logp.detach().float(), mask.bool()))
        return loss_fn(logp, old_logp, advantages, mask, **clip)

    module.updater = dataclasses.replace(module.updater, loss_fn=spy)
    data = RLVRDataModule("addition", train_size=16, val_size=4, prompts_per_step=2)
    trainer = quiet_trainer(max_steps=2, precision=precision)
    trainer.fit(module, datamodule=data)
    trainer.module = module
    return trainer, seen


def _old_vs_trainer(seen) -> float:
    """Largest |π_old - trainer log-prob| over the first micro-batch of each step (before the
    step's optimiser update, so the trainer's log-probs are still those of π_old)."""
    return max(float((old - logp)[m].abs().max()) for logp, old, m in seen)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_trainer_old_logprobs_when_the_engine_holds_its_own_weights(precision):
    trainer, seen = _fit("auto", precision)
    assert trainer.global_step == 2 and len(seen) == 2  # one micro-batch per step
    assert _old_vs_trainer(seen) < 0.05 < OFFSET  # π_old is the trainer's, not the engine's
    logged = trainer.logged_metrics
    # The mismatch is the engine's offset: ratio e^0.3 on every sampled token.
    assert float(logged["train/mismatch/ratio_min"]) == pytest.approx(1.3499, abs=0.05)
    assert float(logged["train/mismatch/capped_frac"]) == 0.0
    assert float(logged["train/mismatch/kl"]) > 0.03  # k3 of r = e^0.3: 0.0499


def test_engine_old_logprobs_inherit_the_engine_offset():
    trainer, seen = _fit("engine")
    assert _old_vs_trainer(seen) == pytest.approx(OFFSET, abs=0.05)
    assert "train/mismatch/kl" not in trainer.logged_metrics


def test_pi_old_from_the_update_forward_equals_a_separate_pass():
    # One optimiser step per rollout: the update's own forward runs on π_old's weights, so
    # taking π_old from it must train exactly as the extra no-grad pass did.
    deferred, seen_deferred = _fit("auto", "32-true")
    separate, seen_separate = _fit("auto", "32-true", separate_pass=True)
    for (_, old_d, m), (_, old_s, _) in zip(seen_deferred, seen_separate, strict=True):
        assert torch.allclose(old_d[m], old_s[m], atol=1e-5)
    for p_d, p_s in zip(
        deferred.module.policy.parameters(), separate.module.policy.parameters(), strict=True
    ):
        assert torch.allclose(p_d, p_s, atol=1e-6)
    for key in ("kl", "ratio_min", "ratio_max"):
        logged_d = float(deferred.logged_metrics[f"train/mismatch/{key}"])
        assert logged_d == pytest.approx(float(separate.logged_metrics[f"train/mismatch/{key}"]))
