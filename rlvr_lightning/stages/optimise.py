"""Update stage of ``RLVRModule``: ``π_old``, the optimiser steps, the stopping rule.

A mixin, so ``module.py`` keeps the step's orchestration; it reads the module's attributes
(``policy``, ``value_head``, ``updater``, ``hparams``, ``reference``, ``engine``, ...). The
maths is in ``update.PolicyUpdate``, ``losses`` and ``correction``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import lightning.pytorch as pl
import torch

from rlvr_lightning.algorithms import correction
from rlvr_lightning.device import release_free_pages, trainer_forward, weights_cast_once
from rlvr_lightning.runtime import ranks
from rlvr_lightning.stages import old_logprobs
from rlvr_lightning.types import Scored


class UpdateStage(pl.LightningModule):
    """The ``update`` stage of ``RLVRModule`` and what it needs."""

    def update(
        self, scored: Scored, advantages: torch.Tensor, groups: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Optimise the policy on the scored rollouts (``groups``: ``[B]`` bool to use, None:
        all); returns the step's loss metrics."""
        rows = torch.arange(scored.rollouts.num_rows, device=self.device)  # [N]
        if groups is not None:
            rows = rows[groups.to(self.device).repeat_interleave(scored.rollouts.group_size)]
        # Under DDP every rank takes the same optimiser steps, each with one gradient
        # all-reduce, so skipping and the mini-batch count follow the rank with most rows.
        most_rows = int(ranks.over_ranks(self.trainer.strategy, rows.numel(), "max", self.device))
        if most_rows == 0:
            return {"update/skipped_empty": 1.0}
        opt, sched = self.optimizers(), self.lr_schedulers()
        value = None if self.value_head is None else self.value_head.targets(scored)
        metrics: dict[str, float] = {}
        h = self.options.update
        for _ in range(h.epochs_per_rollout):
            perm = rows[torch.randperm(rows.numel(), device=rows.device)]
            for mb in torch.tensor_split(perm, min(h.minibatches_per_rollout, most_rows)):
                opt.zero_grad(set_to_none=True)
                with weights_cast_once(self.device.type):  # ends before opt.step()
                    loss, m = self.updater.accumulate(
                        self.policy,
                        scored.rollouts,
                        advantages,
                        mb,
                        self.reference_logprobs,
                        self._backward,
                        mean_over_ranks=self._mean_over_ranks,
                        no_sync=lambda: ranks.no_backward_sync(self.trainer.strategy),
                        value=value,
                    )
                metrics = {**m, "loss": loss}
                # A finite loss can still give NaN/inf gradients (e.g. a huge lr); under DDP
                # they are all-reduced already, so every rank takes the same decision.
                norms = self._grad_norms()  # before clipping: spikes stay visible
                problem = self._nonfinite_problem(loss, m.get("value_loss", 0.0), norms)
                if problem is not None:
                    self._skip_nonfinite(problem[1], problem[0])
                    opt.zero_grad(set_to_none=True)
                    continue
                self._nonfinite_streak = 0
                self._clip(opt)
                clipped = self._grad_norms() if h.grad_clip is not None else norms
                metrics |= norms | {f"{k}_clipped": v for k, v in clipped.items()}
                self._weights_touched = True  # checkpoints on exception: see lifecycle
                opt.step()
                sched.step()
        return metrics

    def _backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward; with ``trim_heap`` the heap's free pages go back to the
        OS before and after it (``device.release_free_pages``), so that a micro-batch does not
        grow the resident size beside the pages the previous one freed."""
        trim = self.options.update.trim_heap
        if trim is None:  # activations on the host heap: trim there
            trim = self.device.type == "cpu"
        if trim:
            release_free_pages()
        self.manual_backward(loss)
        if trim:
            release_free_pages()

    def _grad_norms(self) -> dict[str, float]:
        """``grad_norm`` of the policy and, with a value head, ``value_grad_norm``."""
        norms = {"grad_norm": self._grad_norm()}
        if self.value_head is not None:
            norms["value_grad_norm"] = self._grad_norm(self.value_head.parameters())
        return norms

    @staticmethod
    def _nonfinite_problem(
        loss: float, value_loss: float, norms: dict[str, float]
    ) -> tuple[str, float] | None:
        """``(what, value)`` of the first non-finite loss or gradient norm, else None."""
        names = {"grad_norm": "gradient norm", "value_grad_norm": "value head gradient norm"}
        checks = [("loss", loss), ("value loss", value_loss)]
        checks += [(names[k], v) for k, v in norms.items()]
        for what, number in checks:
            if not math.isfinite(number):
                return what, number
        return None

    def _clip(self, opt: torch.optim.Optimizer) -> None:
        """Clip the gradient norm to ``grad_clip``; with a value head, the policy's and the
        head's parameter groups each to their own norm, so the young critic's large gradients
        never shrink the policy's step (verl clips actor and critic separately)."""
        h = self.options.update
        if h.grad_clip is None:
            return
        fused = any(group.get("fused") for group in opt.param_groups)
        if self.value_head is None and not fused:
            self.clip_gradients(opt, gradient_clip_val=h.grad_clip, gradient_clip_algorithm="norm")
            return
        # Lightning's mixed-precision plugin refuses to clip for a fused optimiser (it unscales
        # internally); without a GradScaler (the only case it is fused) plain clipping is exact.
        for group in opt.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], h.grad_clip)

    def recompute_old_logprobs(self, scored: Scored) -> tuple[Scored, dict[str, float]]:
        """``π_old`` from the trainer where the sampler differs from it
        (``correction.old_logprobs``, ``algorithms.correction``) and, with a value head,
        ``V_old`` (``Rollouts.old_values``), with a probe head its inputs
        (``Rollouts.probe_features``), from the same no-grad forward; without a ``π_old``
        recomputation the heads' inputs cost one no-grad forward of their own. Without heads,
        an update of one optimiser step takes ``π_old`` from its own forwards instead
        (``old_logprobs.deferred_trainer_logprobs``; the mismatch metrics then come from
        ``update``). Returns the scored batch and the mismatch metrics."""
        o, r = self.options, scored.rollouts
        mb = o.update.micro_batch_size
        base = self.sampling.temperature
        chunk = self.updater.head_chunk_tokens
        heads = self.value_head is not None or self.probe_head is not None
        choice, s = o.correction.old_logprobs, self.sampling
        truncated = s.top_p < 1.0 or s.top_k > 0  # the sampler's log-probs are not π_θ's
        # Asynchronous rows were drawn by an older version: π_old is the trainer's (decoupled).
        shares = self.engine.shares_policy and not self.asynchronous
        if correction.needs_trainer_logprobs(choice, shares, r, base, truncated):
            if self._one_step_per_rollout() and not heads:
                # the update's forwards run on π_old's weights: no separate pass needed
                r = old_logprobs.deferred_trainer_logprobs(r, base)
                return dataclasses.replace(scored, rollouts=r), {}
            with weights_cast_once(self.device.type):
                r, stats = old_logprobs.with_trainer_logprobs(
                    self.policy,
                    r,
                    mb,
                    base,
                    o.correction.cap,
                    self.value_head,
                    chunk,
                    self.probe_head,
                )
            metrics = {f"mismatch/{k}": v for k, v in stats.items()}
        elif heads:
            with weights_cast_once(self.device.type):
                _, values, features = trainer_forward(
                    self.policy, r, mb, self.value_head, chunk, self.probe_head
                )
            r, metrics = dataclasses.replace(r, old_values=values, probe_features=features), {}
        else:
            return scored, {}
        return dataclasses.replace(scored, rollouts=r), metrics

    def _one_step_per_rollout(self) -> bool:
        """Whether ``update`` takes a single optimiser step over all of a rollout's rows (then
        every micro-batch's forward sees ``π_old``'s weights)."""
        h = self.options.update
        return h.epochs_per_rollout == 1 and h.minibatches_per_rollout == 1

    def _mean_over_ranks(self, value: float) -> float:
        return ranks.over_ranks(self.trainer.strategy, value, "mean", self.device)

    def _check_progress(self, stepped: bool) -> None:
        """Raise once ``max_steps_without_update`` rollout steps in a row took no optimiser
        step: ``max_steps`` counts optimiser steps, so such a run would never end. The
        decision is the same on every rank (``update`` steps or skips on all of them)."""
        self._no_update_streak = 0 if stepped else self._no_update_streak + 1
        limit = self.options.update.max_steps_without_update
        if limit is None or self._no_update_streak < limit:
            return
        raise RuntimeError(
            f"{self._no_update_streak} rollout steps in a row took no optimiser step (rollout "
            f"step {self._rollout_step}, global step {self.global_step}): every group was "
            "filtered out (filter_zero_variance / dynamic_sampling: no group's outcome varied; "
            "or the curriculum's mask), and `trainer.max_steps` counts optimiser steps. Check "
            "that the rewards can vary (a constant reward never trains), raise "
            "`sampling.group_size`, lower the curriculum's threshold, or set "
            "`model.update.max_steps_without_update` (null: never stop)."
        )

    def reference_logprobs(
        self, compute: Callable[[torch.nn.Module], torch.Tensor]
    ) -> torch.Tensor:
        """Run ``compute`` under the reference policy (LoRA: the adapter disabled)."""
        with torch.no_grad():
            if self.reference is not None:
                return compute(self.reference)
            with self.policy.disable_adapter():
                return compute(self.policy)
