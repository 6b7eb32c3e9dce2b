"""The parts of ``RLVRModule`` around the training step: validation, prediction, the
optimiser, checkpoint hooks (one consistent state per checkpoint, finite weights only) and the
non-finite guard. A mixin, so the module file keeps only the step's orchestration; it reads the
module's attributes (``policy``, ``score``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch

from rlvr_lightning.algorithms.metrics import EvalMetrics
from rlvr_lightning.runtime import checkpointing
from rlvr_lightning.stages.predictions import prediction_records
from rlvr_lightning.types import PromptBatch, Sampling

log = logging.getLogger("rlvr_lightning.module")


def lr_factor(step: int, warmup: int, decay: str, total: int, floor: float) -> float:
    """Multiplier of the lr for optimiser step ``step`` (0-based): ``(step + 1) / warmup``
    during the warm-up, then ``1`` (``decay`` ``none``) or a decay from 1 at ``step == warmup``
    towards ``floor`` at ``step == total``: ``linear`` (``floor + (1 - floor) * (total - step)
    / (total - warmup)``, as transformers' linear schedule with a floor) or ``cosine`` (half a
    cosine period over the same span)."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "none":
        return 1.0
    progress = min(1.0, (step - warmup) / max(total - warmup, 1))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (1.0 - floor) * shape


def plain_hparam(value: Any) -> Any:
    """Hyperparameters as plain data, so checkpoints load with ``weights_only=True`` and
    LightningCLI can re-read them: dataclasses become dicts, importable functions and classes
    their import path, a ``functools.partial`` of a class (what LightningCLI makes of a
    ``Callable[[int], ValueHead]`` argument) ``{class_path, init_args}``; other callables
    (instances) their ``repr``, which is informative only.
    """
    if isinstance(value, functools.partial):
        classes = [a for a in (value.func, *value.args) if isinstance(a, type)]
        if classes:
            kwargs = {k: plain_hparam(v) for k, v in value.keywords.items()}
            return {"class_path": plain_hparam(classes[-1]), "init_args": kwargs}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_hparam(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: plain_hparam(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_hparam(v) for v in value]
    if callable(value):
        qualname = getattr(value, "__qualname__", "")
        if qualname and "<" not in qualname:
            return f"{value.__module__}.{qualname}"
        return repr(value)
    return value


def val_split_name(trainer: pl.Trainer, dataloader_idx: int) -> str:
    """Name of validation loader ``dataloader_idx``: the data module's ``val_split_names``
    (``RLVRDataModule``: ``""``, then ``paraphrased``), else ``""`` for the first loader and
    ``dataloader_idx_N`` for the others."""
    names = getattr(getattr(trainer, "datamodule", None), "val_split_names", None)
    if names is not None and dataloader_idx < len(names):
        return names[dataloader_idx]
    return f"dataloader_idx_{dataloader_idx}" if dataloader_idx else ""


class StepLifecycle(pl.LightningModule):
    """Validation, prediction, optimisation and checkpoint hooks of ``RLVRModule``."""

    # Checkpoint consistency (see `on_save_checkpoint`); class defaults, set per instance.
    _boundary: dict[str, Any] | None = None  # snapshot of the state at the last step's end
    _open_step: int | None = None  # `_rollout_step` of the step in progress
    _weights_touched = False  # an optimiser step ran since `_boundary` was taken
    _snapshotting = False

    def _grad_norm(self, params: Iterable[torch.nn.Parameter] | None = None) -> float:
        """Gradient norm over ``params`` (default: the policy's)."""
        params = self.policy.parameters() if params is None else params
        grads = [p.grad for p in params if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )

    def _skip_nonfinite(self, value: float, what: str = "loss") -> None:
        self._nonfinite_streak += 1
        log.warning(
            "Non-finite %s (%s) at rollout step %d: skipped this optimiser step (%d in a row).",
            what,
            value,
            self._rollout_step,
            self._nonfinite_streak,
        )
        if self._nonfinite_streak >= self.options.update.max_nonfinite_steps:
            raise FloatingPointError(
                f"The loss or gradient norm was non-finite for {self._nonfinite_streak} "
                "optimiser steps in a row. Lower `model.update.lr`, check the reward functions for "
                f"inf/NaN, or use float32. {self._last_good_state()}"
            )

    def _last_good_state(self) -> str:
        """Which checkpoint holds the last good state, for the non-finite error."""
        trainer = self.trainer
        newest = checkpointing.describe_newest(checkpointing.checkpoint_dirs(trainer))
        text = (
            f"Skipped steps leave the weights alone: they are those of optimiser step "
            f"{trainer.global_step}; on disk {newest}"
        )
        if self._weights_touched:
            return text + " (no on-exception checkpoint: this step had already updated them)."
        return text + (
            "; an on-exception checkpoint, if configured, is written now with the state at the "
            f"end of rollout step {self._rollout_step - 1} (optimiser step {trainer.global_step})."
        )

    # No `transfer_batch_to_device` override: a `PromptBatch` holds text (tokens are made on the
    # right device in `encode_prompts`), so Lightning's default move only copies it, and an
    # override here makes Lightning warn on every run that uses the data module.

    # ---- validation ------------------------------------------------------------------------

    def validation_step(self, batch: PromptBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        split = val_split_name(self.trainer, dataloader_idx)
        if not split:
            self._evaluate(batch, "val", "val_metrics")
            return
        if "val_split_metrics" not in self._modules:
            self.val_split_metrics = torch.nn.ModuleDict()
        if split not in self.val_split_metrics:  # made on first use; states not checkpointed
            metrics = EvalMetrics(self.val_sampling.group_size).to(self.device)
            self.val_split_metrics[split] = metrics
        self._evaluate(batch, "val", f"val_split_metrics.{split}", f"_{split}")

    def test_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test", "test_metrics")

    def _evaluate(self, batch: PromptBatch, stage: str, attribute: str, suffix: str = "") -> None:
        """Greedy accuracy and reward, plus pass@k of ``val_sampling`` when it samples k > 1
        (the unbiased estimator; its interval is logged at the epoch's end), into the
        ``EvalMetrics`` at ``attribute``. ``suffix`` ends every name
        (``val/accuracy_paraphrased``); names carry no ``/dataloader_idx_N``."""
        metrics: EvalMetrics = self.get_submodule(attribute)  # type: ignore[assignment]

        def emit(name: str, field: str, **kwargs: Any) -> None:
            # The metric's attribute is named: Lightning looks them up once, maybe before a
            # split's metrics exist.
            self.log(
                f"{stage}/{name}{suffix}", getattr(metrics, field), batch_size=len(batch),
                add_dataloader_idx=False, metric_attribute=f"{attribute}.{field}", **kwargs,
            )  # fmt: skip

        greedy = Sampling(
            max_new_tokens=self.val_sampling.max_new_tokens, temperature=0.0, group_size=1
        )
        scored = self.score(batch, self.rollout(batch, greedy))
        metrics.accuracy.update(scored.correct.float())
        metrics.reward.update(scored.rewards)
        emit("accuracy", "accuracy", prog_bar=True)
        emit("reward", "reward")
        for key in ("first_turn_accuracy", "turns"):  # multi-turn: the first answer, turns used
            if f"multiturn/{key}" in scored.metrics:
                value = scored.metrics[f"multiturn/{key}"]
                self.log(
                    f"{stage}/{key}{suffix}", value, batch_size=len(batch), add_dataloader_idx=False
                )
        if metrics.pass_at_k is not None:
            sampled = self.score(batch, self.rollout(batch, self.val_sampling))
            metrics.pass_at_k.update(sampled.correct.view(len(batch), -1))
            emit(f"pass@{metrics.pass_at_k.k}", "pass_at_k")

    def on_validation_epoch_end(self) -> None:
        self._log_pass_at_k_summary("val", self.val_metrics)
        for split, metrics in getattr(self, "val_split_metrics", {}).items():
            self._log_pass_at_k_summary("val", metrics, f"_{split}")

    def on_test_epoch_end(self) -> None:
        self._log_pass_at_k_summary("test", self.test_metrics)

    def _log_pass_at_k_summary(self, stage: str, metrics: EvalMetrics, suffix: str = "") -> None:
        """``<stage>/pass@k_ci95_low``, ``_ci95_high``, ``_prompts``, ``_samples`` beside the
        pass@k itself (its metric is reset after this hook, by Lightning), then ``suffix``."""
        pass_k = metrics.pass_at_k
        if pass_k is None or not pass_k.update_called:
            return
        for key, value in pass_k.summary().items():
            self.log(f"{stage}/pass@{pass_k.k}_{key}{suffix}", value)

    def predict_step(self, batch: PromptBatch, batch_idx: int) -> list[dict[str, Any]]:
        """One record per prompt: its ``val_sampling.group_size`` completions with every
        reward, and pass@1 / pass@k (see ``prediction_records``)."""
        scored = self.score(batch, self.rollout(batch, self.val_sampling))
        return prediction_records(batch, scored)

    # ---- optimisation ----------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        groups = [{"params": [p for p in self.policy.parameters() if p.requires_grad]}]
        if self.value_head is not None:
            groups.append(self.value_head.param_group())  # its own lr and weight decay
        # The fused kernel steps the embedded model in 0.04 s against 0.29 s (2 CPU cores). It
        # unscales gradients itself, so not with a GradScaler (fp16), where the plugin unscales
        # before clipping; optimise._clip clips it outside Lightning's plugin.
        fused = "16-mixed" != str(self.trainer.precision) and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda")
            for g in groups
            for p in g["params"]
        )
        h = self.options.update
        opt = torch.optim.AdamW(groups, lr=h.lr, weight_decay=h.weight_decay, fused=fused or None)
        decay, total = h.lr_decay, self.trainer.max_steps
        if decay != "none" and total <= 0:
            raise ValueError(
                f"update.lr_decay={decay!r} decays the lr over trainer.max_steps optimiser "
                f"steps, but trainer.max_steps is {total}: set trainer.max_steps, or "
                "update.lr_decay: none."
            )
        schedule = functools.partial(
            lr_factor,
            warmup=h.warmup_steps,
            decay=decay,
            total=total,
            floor=h.min_lr_ratio,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---- checkpoints ----------------------------------------------------------------------

    @property
    def updating_weights(self) -> bool:
        """True from the first optimiser step of a rollout step until the step has returned:
        the weights then belong to a state no checkpoint can describe yet."""
        return self._weights_touched and self._open_step == self._rollout_step

    def _take_boundary(self) -> None:
        self._snapshotting = True
        try:
            self._boundary = checkpointing.boundary_snapshot(self.trainer)
        finally:
            self._snapshotting = False
        self._weights_touched = False

    def on_train_start(self) -> None:
        self._take_boundary()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._open_step = self._rollout_step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # After every callback (ModelCheckpoint included): the state a checkpoint now holds.
        self._open_step = None
        self._take_boundary()

    def on_train_end(self) -> None:
        self._boundary, self._open_step = None, None

    def _exception_save_problem(self, checkpoint: dict[str, Any]) -> str | None:
        """Make an on-exception checkpoint consistent; return why it cannot be, else None.

        Before the step's first optimiser step the weights still match the snapshot taken when
        the previous step ended, so the snapshot supplies everything else (RNG, data, callbacks,
        loops). After it, only a step that has returned is consistent.
        """
        if self._boundary is None:
            return "training had not started, there is nothing new to save"
        if not self._weights_touched:
            checkpointing.use_snapshot(checkpoint, self._boundary)
            return None
        if self._open_step == self._rollout_step:
            return (
                f"interrupted during the weight update of rollout step {self._rollout_step}: "
                "the weights had changed but the rest of the step had not"
            )
        return None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rlvr_rollout_step"] = self._rollout_step
        self.save_async_state(checkpoint)  # the queued rounds (stages.asynchronous)
        # Sampling RNG, so a resumed single-device run draws the rollouts an uninterrupted one
        # would have drawn (Lightning does not save it).
        checkpoint["rlvr_rng"] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            checkpoint["rlvr_rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        if self._snapshotting:
            return
        interrupted = self._trainer is not None and self.trainer.interrupted
        problem = self._exception_save_problem(checkpoint) if interrupted else None
        bad = checkpointing.nonfinite_tensors(checkpoint.get("state_dict", {}))
        if bad and problem is None:
            problem = f"{len(bad)} weight tensors are non-finite (e.g. {bad[0]})"
            if not interrupted:  # a regular save: fail loudly (on an exception: just skip it)
                dirs = checkpointing.checkpoint_dirs(self.trainer)
                raise FloatingPointError(
                    f"Refusing to save a checkpoint: {problem}; "
                    f"{checkpointing.describe_newest(dirs)}."
                )
        if problem is not None:
            checkpoint[checkpointing.UNSAFE_KEY] = problem

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if problem := checkpoint.get(checkpointing.UNSAFE_KEY):
            raise checkpointing.CheckpointError(f"This checkpoint is not consistent: {problem}.")
        self._rollout_step = checkpoint.get("rlvr_rollout_step", 0)
        self.load_async_state(checkpoint)
        rng = checkpoint.get("rlvr_rng", {})
        if "cpu" in rng:
            torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
