"""Asynchronous rollouts in the step (``options.Asynchrony``): the round to train, generated
``max_staleness`` steps earlier by the policy version it is tagged with, the weight pushes and
their check, the queue in checkpoints, the ``async/*`` metrics.

A mixin of ``RLVRModule``, as the other stages; the queue, schedule and fingerprint are in
``rlvr_lightning.asynchrony``. In ``sync`` mode (the default) ``next_round`` is
``generate_round`` and nothing else here runs, so a synchronous run is unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from rlvr_lightning.algorithms.staleness import staleness_shares
from rlvr_lightning.asynchrony import QueuedRound, RolloutQueue, WeightSync, fingerprint
from rlvr_lightning.asynchrony.fingerprint import module_sums
from rlvr_lightning.asynchrony.partial import PartialPool
from rlvr_lightning.device import weights_cast_once
from rlvr_lightning.rewards.trl_contract import RewardState
from rlvr_lightning.rollout.base import policy_weights
from rlvr_lightning.stages import partial
from rlvr_lightning.types import PromptBatch, Rollouts, Scored

# A round's own rollout (partial rollouts): its prompts and rows, None rows when none finished.
RoundRollout = Callable[[PromptBatch], tuple[PromptBatch, Rollouts | None]]
POSITION_REFUSAL = (
    "Partial rollouts (concurrent_rollouts) continue rows in chunks, and a temperature that "
    "changes along the completion (AnnealedTemperature, EAD) would restart at each chunk; "
    "drop the callback or set model.init_args.concurrent_rollouts: null."
)

CHECKPOINT_KEY = "rlvr_async"


class AsyncStage(pl.LightningModule):
    """``next_round`` (the step's round), ``push_weights`` (after the update), checkpoints."""

    _queue: RolloutQueue | None = None
    _partial_pool: PartialPool | None = None
    _warned_staleness = False
    _readable: list[str] | None = None  # modules the engine's weights can be read back from
    _weight_sync: WeightSync | None = None
    _in_flight: tuple | None = None  # the round the worker process decodes (overlapped)
    _overlap_s: dict[str, float] | None = None  # its wait and busy seconds, for the metrics

    @property
    def rollout_queue(self) -> RolloutQueue:
        """Rounds generated ahead of the update (empty in ``sync`` mode)."""
        if self._queue is None:
            self._queue = RolloutQueue()
        return self._queue

    @property
    def partial_pool(self) -> PartialPool:
        """Groups decoding across steps (partial rollouts; empty otherwise)."""
        if self._partial_pool is None:
            self._partial_pool = PartialPool()
        return self._partial_pool

    @property
    def weight_sync(self) -> WeightSync:
        """The pushes of the policy's weights: versions and fingerprints."""
        if self._weight_sync is None:
            self._weight_sync = WeightSync(keep=self.options.asynchrony.max_staleness + 2)
        return self._weight_sync

    @property
    def asynchronous(self) -> bool:
        return self.options.asynchrony.rollout_mode == "async"

    def next_round(self, batch: PromptBatch) -> tuple[PromptBatch, Scored | None, dict]:
        """The prompts and scored rows this step trains, and their ``async/*`` metrics.

        ``sync``: ``generate_round(batch)``. ``async``: ``batch`` is generated now by the
        policy's current version (checked against its last push) and queued; the step trains
        the oldest queued round once ``max_staleness`` rounds wait before it (None while the
        queue fills: the step then only generates).
        """
        if not self.asynchronous:
            return batch, self.generate_round(batch), {}
        if self.options.asynchrony.partial:
            return self._partial_round(batch)
        a = self.options.asynchrony
        version = self._checked_version()
        if hasattr(self.engine, "submit") and not self.options.multiturn.enabled:
            return self._overlapped_round(batch, version)
        scored = self.generate_round(batch)
        served = self._data_call("hold_step", [])
        self.rollout_queue.put(QueuedRound(batch, scored, version, self._rollout_step, served))
        queued = self.rollout_queue.take(version, a.max_staleness, ahead=a.max_staleness)
        metrics = self._queue_metrics(version, queued)
        self.log("async/queue", float(len(self.rollout_queue)), prog_bar=True, batch_size=1)
        if queued is None:  # a step that only generates still counts as a rollout step
            self._rollout_step += 1
            return batch, None, metrics
        self._data_call("resume_step", None, queued.served)
        self.step_batch = queued.batch
        return queued.batch, queued.scored, metrics

    def _overlapped_round(
        self, batch: PromptBatch, version: int
    ) -> tuple[PromptBatch, Scored | None, dict]:
        """The same schedule with the engine in its own process: ``batch`` is sent to it (by
        version ``version``), the oldest queued round trains while it decodes, and
        ``finish_round`` (after the update) scores its rows and queues them. The rounds, their
        versions and the RNG stream are those of the in-process schedule; the round's
        ``on_after_score`` hooks run when its rows arrive, after this step's update, and its
        rewards see the trainer's state of when it was sent (``RewardState``)."""
        a = self.options.asynchrony
        batch = self._run_hooks("on_before_generate", batch)
        ticket = self.submit_rollout(batch)
        served = self._data_call("hold_step", [])
        state = RewardState.of(self._trainer)
        self._in_flight = (batch, ticket, state, version, self._rollout_step, served)
        queued = self.rollout_queue.take(version, a.max_staleness, ahead=a.max_staleness - 1)
        metrics = self._queue_metrics(version, queued)
        self.log("async/queue", float(len(self.rollout_queue) + 1), prog_bar=True, batch_size=1)
        if queued is None:  # nothing to train yet: wait for it now
            self.finish_round()
            self._overlap_s = None
            self._rollout_step += 1
            return batch, None, metrics
        self._data_call("resume_step", None, queued.served)
        self.step_batch = queued.batch
        return queued.batch, queued.scored, metrics

    def finish_round(self) -> None:
        """The round sent by ``_overlapped_round``, once decoded: scored, through the
        ``on_after_score`` hooks, queued (a no-op when none is in flight). ``step_batch``
        keeps the trained round's prompts for the rest of the step."""
        if self._in_flight is None:
            return
        batch, ticket, state, version, step, served = self._in_flight
        self._in_flight, trained = None, getattr(self, "step_batch", None)
        waited = time.perf_counter()
        rollouts = self.engine.collect(ticket)
        waited = time.perf_counter() - waited
        busy = self.engine.take_busy()
        scored = self.scored_round(batch, rollouts, busy, state)
        self.rollout_queue.put(QueuedRound(batch, scored, version, step, served))
        self.step_batch = trained
        self._overlap_s = {"wait": waited, "busy": busy}

    def _partial_round(self, batch: PromptBatch) -> tuple[PromptBatch, Scored | None, dict]:
        """Partial rollouts (``stages.partial``): ``batch`` joins the groups in flight, which
        decode until as many have finished as ``batch`` has prompts; those train now (None:
        none finished), the unfinished continue at the next step under the next version."""
        a = self.options.asynchrony
        if a.concurrent_rollouts < len(batch):
            raise ValueError(
                f"concurrent_rollouts is {a.concurrent_rollouts} but a step has {len(batch)} "
                "prompts: a step would wait for more finished groups than may decode at once. "
                f"Set model.init_args.concurrent_rollouts >= {len(batch)}."
            )
        self._warn_long_rows()
        version = self._checked_version()
        taken: list = []

        def partial_rollout(round_batch: PromptBatch) -> tuple[PromptBatch, Rollouts | None]:
            self._fill_pool(round_batch)
            pool = self.partial_pool
            pool.drop_stale(version, a.max_staleness)
            self.sync_engine()
            limits = (a.concurrent_rollouts, a.partial_chunk_tokens, len(round_batch))
            with weights_cast_once(self.device.type):
                taken.append(partial.decode_until(
                    self.engine, self.tokenizer.pad_token_id, pool, self.sampling, limits, version
                ))  # fmt: skip
            taken.append(pool.take(len(round_batch)))
            if not taken[-1]:
                return round_batch, None
            return partial.round_of(self.tokenizer, taken[-1], self.device)

        scored = self.generate_round(batch, partial_rollout)
        chunks, groups = taken
        metrics = partial.partial_metrics(
            self.partial_pool, groups, version, a.max_staleness, chunks
        )
        self.log("async/queue", float(len(self.partial_pool)), prog_bar=True, batch_size=1)
        if scored is None:
            self._rollout_step += 1
            return batch, None, metrics
        metrics["async/sample_version"] = float(min(g.oldest() for g in groups))
        self._data_call("resume_step", None, sorted({p for g in groups for p in g.served}))
        return self.step_batch, scored, metrics

    def _warn_long_rows(self) -> None:
        """Once: a row needing more chunks than ``max_staleness + 1`` may be dropped."""
        a, chunk = self.options.asynchrony, self.options.asynchrony.partial_chunk_tokens
        chunks = -(-self.sampling.max_new_tokens // chunk)
        if self._warned_staleness or a.max_staleness >= chunks - 1:
            return
        self._warned_staleness = True
        rank_zero_warn(
            f"Partial rollouts: a row of max_new_tokens={self.sampling.max_new_tokens} takes "
            f"up to {chunks} chunks of {chunk} tokens, one a step when short groups end the "
            f"steps early, so it may span {chunks - 1} versions; max_staleness="
            f"{a.max_staleness} drops such rows (async/dropped_rows). Set max_staleness: "
            f"{chunks - 1} or a larger partial_chunk_tokens to keep them."
        )

    def _fill_pool(self, batch: PromptBatch) -> None:
        """``batch`` joins the pool, then fresh prompts from the data module (through the
        ``on_before_generate`` hooks) until ``concurrent_rollouts`` groups are unfinished:
        CoPRIS keeps that many in flight, so groups that finish late are carried, not waited
        for. Every rank draws the same number (the most any rank misses)."""
        if batch.position_temperatures is not None:
            raise ValueError(POSITION_REFUSAL)
        pool, cap = self.partial_pool, self.options.asynchrony.concurrent_rollouts
        step, s, start = self._rollout_step, self.sampling, len(pool.groups)
        partial.admit(pool, batch, self.encode_prompts(batch), s, [], step)
        missing = max(cap - sum(not g.finished for g in pool.groups), 0)
        missing = int(self.trainer.strategy.reduce(torch.tensor(float(missing)), reduce_op="max"))
        datamodule = getattr(self.trainer, "datamodule", None)
        if missing and hasattr(datamodule, "draw_prompts"):
            exclude = [g.batch.prompt_ids[0] for g in pool.groups]
            extra = self._run_hooks("on_before_generate", datamodule.draw_prompts(missing, exclude))
            if len(extra):
                partial.admit(pool, extra, self.encode_prompts(extra), s, [], step)
        served = self._data_call("hold_step", [])
        for g in pool.groups[start:]:
            g.served = [p for p in served if p == g.batch.prompt_ids[0]]

    def _queue_metrics(self, version: int, queued: QueuedRound | None) -> dict[str, float]:
        a, q = self.options.asynchrony, self.rollout_queue
        lags = torch.tensor([] if queued is None else [version - queued.version])  # [1] or [0]
        shares = staleness_shares(lags, a.max_staleness)
        out = {f"async/staleness_{k}": share for k, share in shares.items()}
        out.update(
            {
                "async/queue_depth": float(len(q)),
                "async/policy_version": float(version),  # the trainer's, before this update
                # The version that drew the trained rows: their outcomes (StepOutput) are its.
                "async/sample_version": float(version if queued is None else queued.version),
                "async/dropped_rounds": float(q.dropped_rounds),
                "async/dropped_rows": float(q.dropped_rows),
            }
        )
        return out

    def step_metrics(self, rollouts: Rollouts) -> dict[str, float]:
        """The step clock's metrics; in ``async`` mode also the idle shares of both sides. In
        this process the two take turns: the trainer is idle while the round is generated and
        scored, the generator while the update runs. With the engine in its own process
        (``_overlapped_round``) the trainer is idle while it waits for the rows, the worker
        for the rest of the step (its busy time is its own clock's)."""
        out = self._clock.metrics(rollouts)
        overlap, self._overlap_s = self._overlap_s, None
        if overlap is not None:
            out["step_time_s"] += overlap["wait"] + out["score_time_s"]
            step = max(out["step_time_s"], 1e-9)
            out["async/trainer_idle_s"] = overlap["wait"]
            out["async/worker_idle_s"] = max(step - overlap["busy"], 0.0)
            out["async/trainer_idle_share"] = out["async/trainer_idle_s"] / step
            out["async/worker_idle_share"] = out["async/worker_idle_s"] / step
        elif self.asynchronous:
            step = max(out["step_time_s"], 1e-9)
            out["async/trainer_idle_s"] = out["gen_time_s"] + out["score_time_s"]
            out["async/worker_idle_s"] = out["update_time_s"]
            out["async/trainer_idle_share"] = out["async/trainer_idle_s"] / step
            out["async/worker_idle_share"] = out["async/worker_idle_s"] / step
        return out

    def push_weights(self) -> None:
        """After an update (``async``): the policy's weights become the next version, with
        their fingerprint (``asynchrony.fingerprint``)."""
        if self.asynchronous:
            self.weight_sync.push(self.weight_sync.version + 1, prints=self._pushed_prints())

    def _checked_version(self) -> int:
        """The version the generator's weights hold: the last pushed, else an error naming
        both (``asynchrony.WeightSyncError``). The run's first step pushes version 0."""
        sync = self.weight_sync
        if not self.engine.shares_policy:
            self.sync_engine()  # vLLM: its own copy, reloaded from the policy, then read back
        held = self._held_prints()
        if not sync.pushes:
            sync.push(0, prints=self._pushed_prints())
        return sync.check(prints=held)

    def _pushed_prints(self) -> dict:
        """The fingerprint of the policy's weights as the generator should hold them: the
        position-weighted prints (HF engine: the policy itself), or the module sums of the
        weights cast to the engine's dtype (an engine with its own layout, vLLM)."""
        if self.engine.shares_policy or not hasattr(self.engine, "read_weights"):
            return fingerprint(self.policy.named_parameters())
        with policy_weights(self.policy) as named:
            return module_sums(named, self.engine.weights_dtype, only=self._readable)

    def _held_prints(self) -> dict:
        """The same fingerprint of the weights the generator holds, read from it (the modules
        it can show: ``asynchrony.fingerprint.module_sums``)."""
        if self.engine.shares_policy or not hasattr(self.engine, "read_weights"):
            return fingerprint(self.policy.named_parameters())
        held = self.engine.read_weights(module_sums)
        self._readable = sorted(held) if self._readable is None else self._readable
        return held

    def _data_call(self, name: str, default: Any, *args: Any) -> Any:
        """``datamodule.composer.<name>(*args)`` when the data module has a step composer
        (``RLVRDataModule``); ``default`` otherwise."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        method = getattr(getattr(datamodule, "composer", None), name, None)
        return default if method is None else method(*args)

    # ---- checkpoints --------------------------------------------------------------------------

    def save_async_state(self, checkpoint: dict[str, Any]) -> None:
        """The queue (rounds, versions, log-probs, scores) and the pushes, in ``async`` mode;
        the generator's RNG is the process's, saved with the sampling RNG."""
        if self.asynchronous:
            checkpoint[CHECKPOINT_KEY] = {
                "queue": self.rollout_queue.state_dict(),
                "partial": self.partial_pool.state_dict(),
                "weight_sync": self.weight_sync.state_dict(),
            }

    def load_async_state(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            return
        if not self.asynchronous:
            raise ValueError(
                "This checkpoint was written with rollout_mode: async and holds queued rounds; "
                "resume it with model.init_args.rollout_mode: async (or start a new run)."
            )
        self.rollout_queue.load_state_dict(state["queue"])
        if "partial" in state:
            self.partial_pool.load_state_dict(state["partial"])
        self.weight_sync.load_state_dict(state["weight_sync"])
