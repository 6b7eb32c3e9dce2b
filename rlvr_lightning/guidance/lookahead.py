"""Train ahead, keep the weights, roll back: the look-ahead of NPO (spec §6).

:func:`capture` copies, in memory, everything a training step changes: the module's weights
and counters, the optimiser and scheduler, the data module, the RNGs, the step counter Lightning
keeps, and the state of the ``RLVRCallback``\\ s that shape training. :func:`train_ahead` runs
``RLVRModule.training_step`` (through the strategy, as Lightning calls it) on the data module's
next steps, as the run itself would, and keeps copies of the policy's trainable weights at the
steps asked for; :func:`restore` puts the captured state back, so the run goes on exactly as if
it had never looked ahead.

It relies on the contract resuming already needs: what a callback or the data module must carry
across steps is in its ``state_dict``. Callbacks that only observe (no hook before the update,
e.g. ``CompletionsTable``) do not see the look-ahead steps, and nothing is logged from them.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from rlvr_lightning.stages.hooks import RLVRCallback

# Module attributes a training step changes besides its weights (see module.py, lifecycle.py).
MODULE_COUNTERS = (
    "_rollout_step",
    "_nonfinite_streak",
    "_no_update_streak",
    "_weights_touched",
    "_open_step",
    "last_step",
    "step_batch",
    "_queue",  # asynchronous rollouts: the queued rounds and the weight pushes
    "_weight_sync",
    "_partial_pool",  # partial rollouts: the groups in flight
)
_SHAPING_HOOKS = ("on_before_rollout", "on_before_generate", "on_after_score")


def shapes_training(callback: pl.Callback) -> bool:
    """Whether ``callback`` is an ``RLVRCallback`` overriding a hook that runs before the
    update (it changes what is trained, so the look-ahead must run it)."""
    if not isinstance(callback, RLVRCallback):
        return False
    return any(getattr(type(callback), h) is not getattr(RLVRCallback, h) for h in _SHAPING_HOOKS)


def trainable_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the parameters that train (all of a full fine-tune, a LoRA's adapters)."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _step_progress(trainer: pl.Trainer) -> Any:
    return trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress


def capture(
    trainer: pl.Trainer, module: pl.LightningModule, skip: Iterable[pl.Callback] = ()
) -> dict:
    """A deep copy of the training state (see the module docstring); ``skip``: callbacks
    left out (the caller itself)."""
    skipped = {id(cb) for cb in skip}
    dm = trainer.datamodule
    return copy.deepcopy(
        {
            "module": module.state_dict(),
            "counters": {k: getattr(module, k, None) for k in MODULE_COUNTERS},
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs],
            "datamodule": None if dm is None else dm.state_dict(),
            "last_observed": getattr(dm, "last_observed", None),
            "callbacks": {
                i: cb.state_dict()
                for i, cb in enumerate(trainer.callbacks)
                if shapes_training(cb) and id(cb) not in skipped
            },
            "rng": _rng_state(),
            "progress": _step_progress(trainer).state_dict(),
        }
    )


def restore(trainer: pl.Trainer, module: pl.LightningModule, state: dict) -> None:
    """Put back what :func:`capture` copied; an engine with its own weights reloads them."""
    state = copy.deepcopy(state)
    module.load_state_dict(state["module"])
    for key, value in state["counters"].items():
        setattr(module, key, value)
    for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(saved)
    for config, saved in zip(trainer.lr_scheduler_configs, state["schedulers"], strict=True):
        config.scheduler.load_state_dict(saved)
    dm = trainer.datamodule
    if dm is not None:
        dm.load_state_dict(state["datamodule"])
        if hasattr(dm, "last_observed"):
            dm.last_observed = state["last_observed"]
    for i, saved in state["callbacks"].items():
        trainer.callbacks[i].load_state_dict(saved)
    _set_rng_state(state["rng"])
    _step_progress(trainer).load_state_dict(state["progress"])
    module._engine_synced_at = -1  # the engine's copy (vLLM) holds look-ahead weights


@contextmanager
def _quiet(
    trainer: pl.Trainer, module: pl.LightningModule, skip: Iterable[pl.Callback]
) -> Iterator[None]:
    """No logging, and only the callbacks that shape training, while looking ahead."""
    skipped = {id(cb) for cb in skip}
    callbacks = trainer.callbacks
    trainer.callbacks = [cb for cb in callbacks if shapes_training(cb) and id(cb) not in skipped]
    module.log = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        del module.log
        trainer.callbacks = callbacks


def train_ahead(
    trainer: pl.Trainer,
    module: pl.LightningModule,
    steps: int,
    keep_at: Iterable[int],
    skip: Iterable[pl.Callback] = (),
) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``steps`` training steps on the data module's next prompts and return copies of the
    trainable weights after each step count in ``keep_at`` (``1..steps``). The training state
    is changed: :func:`capture` before and :func:`restore` after."""
    dm = trainer.datamodule
    if dm is None or not hasattr(dm, "compose_step"):
        raise TypeError(
            "Looking ahead draws the next steps' prompts from the data module: use "
            "rlvr_lightning.RLVRDataModule (or a subclass with compose_step)."
        )
    wanted = {int(k) for k in keep_at}
    if not wanted or min(wanted) < 1 or max(wanted) > steps:
        raise ValueError(f"keep_at must lie in 1..{steps}, got {sorted(wanted)}.")
    kept: dict[int, dict[str, torch.Tensor]] = {}
    skip = list(skip)
    with _quiet(trainer, module, skip):
        for done in range(1, steps + 1):
            # through the strategy: the precision's autocast (and DDP's wrapper) as in a real step
            trainer.strategy.training_step(dm.compose_step(), 0)
            if done in wanted:
                kept[done] = trainable_state(module.policy)
    return kept
