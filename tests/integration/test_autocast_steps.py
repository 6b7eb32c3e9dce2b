"""Several optimiser steps inside one bf16-mixed training step.

The update casts each weight once per optimiser step (``precision.weights_cast_once``): autocast
then keeps the cast copies, so unless the cache is dropped at every optimiser step the second
mini-batch's forward would run on the first one's weights.
"""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.stages.update import PolicyUpdate
from rlvr_lightning.testing import quiet_trainer, tiny_module


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_each_optimiser_step_of_a_rollout_sees_the_previous_steps_weights(monkeypatch, precision):
    torch.manual_seed(0)
    module = tiny_module(lr=1e-2, minibatches_per_rollout=2)
    linear = module.policy.model.layers[0].mlp.up_proj  # a matmul: autocast casts its weight
    probe = torch.ones(1, linear.in_features)
    seen = []
    micro_loss = PolicyUpdate._micro_loss

    def spy(self, *args, **kwargs):
        with torch.no_grad():  # where the update's own forwards run, under the same autocast
            seen.append((linear(probe).float(), linear.weight.detach().clone()))
        return micro_loss(self, *args, **kwargs)

    monkeypatch.setattr(PolicyUpdate, "_micro_loss", spy)
    data = RLVRDataModule("addition", train_size=16, val_size=4, prompts_per_step=2)
    quiet_trainer(max_steps=1, precision=precision).fit(module, datamodule=data)
    (first, w_first), (second, w_second) = seen  # two mini-batches, two optimiser steps
    assert not torch.equal(w_first, w_second), "the first optimiser step changed nothing"
    assert not torch.equal(first, second), "the second mini-batch ran on stale weights"


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_fused_optimiser_still_clips_the_gradient_norm(precision):
    """AdamW runs fused; Lightning's plugin refuses to clip for it, so the module clips."""
    torch.manual_seed(0)
    module = tiny_module(lr=1e-2, grad_clip=1e-4)
    data = RLVRDataModule("addition", train_size=16, val_size=4, prompts_per_step=2)
    trainer = quiet_trainer(max_steps=1, precision=precision)
    trainer.fit(module, datamodule=data)
    assert trainer.optimizers[0].param_groups[0]["fused"]
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    assert 0 < norm <= 1e-4 * 1.001  # the step's gradient, as clipped before opt.step()


@pytest.mark.parametrize(
    ("precision", "trim_heap", "expected"),
    [
        ("bf16-mixed", None, True),
        ("32-true", None, True),
        ("32-true", False, False),
        ("bf16-mixed", False, False),
    ],
)
def test_heap_trimmed_around_each_backward_on_the_cpu_unless_turned_off(
    monkeypatch, precision, trim_heap, expected
):
    from rlvr_lightning.stages import optimise

    calls, backwards = [], []
    monkeypatch.setattr(optimise, "release_free_pages", lambda: calls.append(1) or True)
    torch.manual_seed(0)
    module = tiny_module(trim_heap=trim_heap, micro_batch_size=4)  # 8 rows: 2 micro-batches
    monkeypatch.setattr(
        module, "manual_backward", lambda loss: backwards.append(1) or loss.backward()
    )
    data = RLVRDataModule("addition", train_size=16, val_size=4, prompts_per_step=2)
    quiet_trainer(max_steps=1, precision=precision).fit(module, datamodule=data)
    assert len(backwards) == 2
    assert len(calls) == (2 * len(backwards) if expected else 0)
