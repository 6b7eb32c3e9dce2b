"""RLVRModule: the policy, its reference, and a training step that orchestrates the stages.

``training_step`` = ``rollout`` -> ``score`` -> ``recompute_old_logprobs`` ->
``select_groups`` -> ``compute_advantages`` -> ``update`` -> ``publish``; each is a public
method a subclass may override. The maths lives in ``algorithms``, the stages in ``stages``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from rlvr_lightning import models
from rlvr_lightning import options as opt
from rlvr_lightning.algorithms.metrics import EvalMetrics
from rlvr_lightning.algorithms.offpolicy import mixed_advantages
from rlvr_lightning.algorithms.outcomes import informative_groups
from rlvr_lightning.algorithms.presets import AlgorithmName, EstimatorName, Preset, get_preset
from rlvr_lightning.device import prepare_model
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.rewards.trl_contract import RewardState
from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.factory import resolve_engine
from rlvr_lightning.stages import build
from rlvr_lightning.stages.asynchronous import AsyncStage, RoundRollout
from rlvr_lightning.stages.dynamic import DynamicStage, keep_first
from rlvr_lightning.stages.generation import GenerationStage
from rlvr_lightning.stages.hooks import run_hooks
from rlvr_lightning.stages.lifecycle import StepLifecycle, plain_hparam
from rlvr_lightning.stages.multiturn import turn_credit
from rlvr_lightning.stages.optimise import UpdateStage
from rlvr_lightning.stages.scoring import score_rollouts
from rlvr_lightning.stages.summary import StepClock, summarise_step
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored, StepOutput


class RLVRModule(StepLifecycle, GenerationStage, UpdateStage, DynamicStage, AsyncStage):
    """GRPO-style RL with verifiable rewards.

    Args:
        policy: model name: a local folder or Hub id, ``embedded:smollm2-135m-instruct``, or
            ``tiny:<seed>`` for an in-process random model.
        dtype: parameter dtype of the policy (``float32`` or ``bfloat16``).
        algorithm: preset filling the defaults of the loss, clipping, aggregation and advantage
            estimator: ``grpo``, ``dapo``, ``dr_grpo``, ``gspo`` or ``cispo``.
        estimator: advantage estimator (``grpo``, ``dr_grpo``, ``rloo``, ``gae``: per-token
            GAE with ``value_head`` as critic, spec §8.7, or ``probe``: POISE's baseline from
            ``probe_head``, spec §7.1); None = the preset's.
        sampling: training sampling (``group_size`` is G).
        val_sampling: validation sampling; temperature 0 is greedy, ``group_size`` > 1 adds
            pass@k with k = group_size (sampled at the given temperature).
        prompt_format: how prompts become tokens: ``chat`` (the tokenizer's chat template),
            ``plain`` (the messages' contents joined by blank lines; for base models) or
            ``auto`` (``chat`` when the tokenizer has a chat template, else ``plain``).
        rewards: reward functions, weights, isolation and what counts as correct.
        loss: the per-token policy loss, clipping, KL and entropy terms.
        selection: which groups train (zero-variance filter, dynamic sampling).
        update: optimiser steps per rollout, micro-batches, learning rate and its schedule.
        lora: LoRA rank, alpha and target modules (rank 0 trains all parameters).
        correction: where ``π_old`` comes from, and TIS / masking of sampler mismatch.
        offpolicy: loss weighting and baseline of injected (off-policy) members.
        multiturn: tools, an environment and turn limits (multi-turn trajectories).
        value_head: the critic of ``estimator: gae``, called with the policy's hidden size:
            ``heads.ValueHead`` (class path and init args in YAML); saved in checkpoints.
        probe_head: POISE's probe of ``estimator: probe``, called with the policy's hidden
            size: ``heads.ProbeHead``; its rows and fit are saved in checkpoints.
        engine: rollout engine: ``hf`` (the policy itself, our decode loop), ``vllm`` (a
            colocated ``vllm.LLM`` with its own weights, synced after each optimiser step) or
            ``auto`` (``vllm`` when installed, see ``rollout.factory.resolve_engine``).
        engine_kwargs: constructor arguments of the engine (``HFEngine`` or ``VLLMEngine``).
        keep_dropout: keep the model's dropout; by default every rate is set to 0 at load, as
            TRL does (dropout makes ``pi / pi_old`` differ from 1 on on-policy tokens).
        rollout_mode, max_staleness, deterministic_schedule, concurrent_rollouts,
            partial_chunk_tokens: see ``options.Asynchrony``.

    Each group is a dataclass of ``rlvr_lightning.options`` (its own ``--help`` section).
    """

    def __init__(
        self,
        policy: str = models.EMBEDDED_DEFAULT,
        *,
        dtype: Literal["float32", "bfloat16"] = "float32",
        algorithm: AlgorithmName = "grpo",
        estimator: EstimatorName | None = None,
        sampling: Sampling = Sampling(max_new_tokens=64, temperature=1.0, group_size=8),
        val_sampling: Sampling = Sampling(max_new_tokens=64, temperature=0.0, group_size=1),
        prompt_format: Literal["chat", "plain", "auto"] = "auto",
        rewards: opt.Rewards = opt.Rewards(),
        loss: opt.Loss = opt.Loss(),
        selection: opt.Selection = opt.Selection(),
        update: opt.Update = opt.Update(),
        lora: opt.LoRA = opt.LoRA(),
        correction: opt.Correction = opt.Correction(),
        offpolicy: opt.OffPolicy = opt.OffPolicy(),
        multiturn: opt.MultiTurn = opt.MultiTurn(),
        value_head: Callable[[int], ValueHead] | None = None,
        probe_head: Callable[[int], ProbeHead] | None = None,
        engine: Literal["hf", "vllm", "auto"] = "hf",
        engine_kwargs: dict[str, Any] | None = None,
        keep_dropout: bool = False,
        rollout_mode: Literal["sync", "async"] = "sync",
        max_staleness: int = 1,
        deterministic_schedule: bool = True,
        concurrent_rollouts: int | None = None,
        partial_chunk_tokens: int = 16,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        for key, value in self.hparams.items():
            self.hparams[key] = plain_hparam(value)
        self.automatic_optimization = False
        self.options = opt.Options.of(
            rewards=rewards, loss=loss, selection=selection, update=update, lora=lora,
            correction=correction, offpolicy=offpolicy, multiturn=multiturn,
            asynchrony=opt.Asynchrony(rollout_mode, max_staleness, deterministic_schedule,
                                      concurrent_rollouts, partial_chunk_tokens),
        )  # fmt: skip
        self.sampling, self.val_sampling = (
            opt.as_group(Sampling, s) for s in (sampling, val_sampling)
        )
        heads = (value_head, probe_head)
        self._build(policy, dtype, keep_dropout, get_preset(algorithm), estimator, *heads)
        self.rewards = build.reward_combiner(
            self.options.rewards, self.preset.overlong_shaping, self.sampling
        )
        self.accuracy_reward = build.accuracy_reward_name(
            self.options.rewards.accuracy_reward, self.rewards.names
        )
        build.check_prompt_format(prompt_format, self.tokenizer, policy)
        resolve_engine(engine, policy)  # a missing vLLM is a setup error; built on first use
        self._start_state()

    def _start_state(self) -> None:
        """What a run changes as it goes, at its start."""
        self._engine: RolloutEngine | None = None
        self._engine_synced_at = 0  # global step whose weights the engine holds
        self.val_metrics = EvalMetrics(self.val_sampling.group_size)
        self.test_metrics = EvalMetrics(self.val_sampling.group_size)
        self.last_step: StepOutput | None = None
        self.step_batch: PromptBatch | None = None  # prompts of the rows being scored
        self._rollout_step = 0
        self._nonfinite_streak = 0
        self._no_update_streak = 0  # rollout steps in a row without an optimiser step
        self._clock = StepClock()

    def _build(self, policy: str, dtype: str, keep_dropout: bool, preset: Preset,
               estimator: str | None, value_head: Callable | None, probe_head: Callable | None,
               ) -> None:  # fmt: skip
        """The models and the update, after the options are checked."""
        o = self.options
        self.preset, self.estimator = preset, estimator or preset.estimator
        build.validate_options(o, self.sampling, self.estimator, value_head, probe_head)
        self.filter_zero_variance, self.informative = build.group_filter(preset, o.selection)
        self.policy, self.tokenizer = build.policy_and_tokenizer(
            policy, dtype, o.lora, keep_dropout
        )
        self.value_head = build.value_head(value_head, self.policy)  # a submodule: checkpointed
        self.probe_head = build.probe_head(probe_head, self.policy)  # buffers: checkpointed
        # Not registered as a submodule: the frozen copy never enters checkpoints or optimisers.
        frozen = o.loss.kl_coef > 0 and o.lora.rank == 0
        self._reference = (models.frozen_copy(self.policy),) if frozen else ()
        self.updater = build.policy_update(preset, o, self.sampling)
        self._sessions = build.session_factory(o.multiturn)

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference policy (None when KL is off or LoRA provides it)."""
        return self._reference[0] if self._reference else None

    def setup(self, stage: str) -> None:
        """The models prepared for the run's device (``device.prepare_model``, the one seam)."""
        device = self.trainer.strategy.root_device.type
        for model in (self.policy, self.reference):
            if model is not None:
                prepare_model(model, device)

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)

    # ---- stages (rollout: stages/generation.py, update and π_old: stages/optimise.py) --------

    def score(self, batch: PromptBatch, rollouts: Rollouts, state: Any = None) -> Scored:
        """Run the reward functions (``stages.scoring``: the batch's columns repeated ``G``
        times, plus ``prompts``, ``completion_ids`` and ``completion_length``) under ``state``
        (a ``RewardState``; None: the trainer's now)."""
        r, state = self.options.rewards, state or RewardState.of(self._trainer)
        return score_rollouts(
            self.rewards, batch, rollouts, self.accuracy_reward, r.accuracy_threshold, state
        )

    def compute_advantages(self, scored: Scored) -> torch.Tensor:
        """Advantages ``[N]`` (or ``[N, T]``) from the rewards; override to change the estimator.

        Groups with off-policy members use ``algorithms.offpolicy.mixed_advantages``; ``gae``
        reads the value head's ``V_old`` and whitens over ``scored.trained_groups``' tokens,
        ``probe`` the probe head's predictions.
        """
        extra, groups = {}, scored.trained_groups
        if self.value_head is not None:
            rows = None if groups is None else groups.repeat_interleave(scored.rollouts.group_size)
            extra = self.value_head.estimator_kwargs(scored.rollouts, rows)
        if self.probe_head is not None:
            extra = self.probe_head.estimator_kwargs(scored)
        adv = mixed_advantages(scored, self.estimator, self.options.offpolicy.baseline, **extra)
        return turn_credit(scored, adv, self.options.multiturn)  # multi-turn: per-turn credit

    def select_groups(self, batch: PromptBatch, scored: Scored) -> torch.Tensor:
        """``[B]`` bool: groups the update uses.

        With filtering or dynamic sampling on, a group must be informative as trained
        (``algorithms.outcomes.informative_groups`` by ``self.informative``, injected members
        included); the data module's curriculum, if any, judges the rows its ``judge`` names
        (as trained by default, ``data.curriculum.VarianceCurriculum``).
        """
        g = scored.rollouts.group_size
        keep = torch.ones(len(batch), dtype=torch.bool)  # [B]
        if self.filter_zero_variance or self.options.selection.dynamic_sampling:
            keep &= informative_groups(scored.correct, scored.rewards, g, self.informative)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        if hasattr(datamodule, "judged_group_mask"):  # the curriculum's κ
            mask = datamodule.judged_group_mask(scored)
            keep = keep if mask is None else keep & mask.cpu()
        return keep

    # ---- the step ---------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self._clock.start()
        batch = self._run_hooks("on_before_rollout", batch)
        target = len(batch)
        batch, scored, extra = self.next_round(batch)  # async: a round generated earlier
        if scored is None:  # async: the queue is still filling, nothing trains yet
            return
        if self.options.selection.dynamic_sampling:
            batch, scored, extra = self._refill(batch, scored)
        self._clock.lap()
        scored, mismatch = self.recompute_old_logprobs(scored)
        groups = self.select_groups(batch, scored)  # [B]
        if self.options.selection.dynamic_sampling:
            groups = keep_first(groups, target)
        scored = dataclasses.replace(scored, trained_groups=groups)
        advantages = self.compute_advantages(scored)
        if self.probe_head is not None:  # POISE: advantages first, then the step's rows
            extra.update(self.probe_head.observe(scored))
        optimiser_steps = self.global_step
        update_metrics = self.update(scored, advantages, groups)
        self.push_weights()  # async: the weights become the next policy version
        self._clock.lap()
        self.finish_round()  # async with a worker process: the round it decoded meanwhile
        output = self.step_output(batch, scored, advantages, update_metrics, groups)
        output.metrics.update({**extra, **mismatch, **self.step_metrics(scored.rollouts)})
        self.publish(output)
        self._rollout_step += 1
        self._check_progress(self.global_step > optimiser_steps)

    def generate_round(
        self, batch: PromptBatch, rollout: RoundRollout | None = None
    ) -> Scored | None:
        """Rollout, score, then the ``on_after_score`` hooks, for one round of prompts.

        Dynamic sampling calls it again for each extra round, so the hooks see every group
        (with ``step_batch`` its prompts) before anything judges it informative: a group a hook
        rescues (e.g. an all-wrong one given its reference) is never thrown away first.
        ``rollout`` (partial rollouts) returns the round's own prompts with its rows, or None
        rows when nothing finished (then this returns None).
        """
        start = time.perf_counter()
        batch = self._run_hooks("on_before_generate", batch)
        batch, rollouts = (batch, self.rollout(batch)) if rollout is None else rollout(batch)
        gen_s = time.perf_counter() - start
        if rollouts is None:
            self._clock.add(gen=gen_s, score=0.0)
            return None
        return self.scored_round(batch, rollouts, gen_s)

    def scored_round(
        self, batch: PromptBatch, rollouts: Rollouts, gen_s: float, state: Any = None
    ) -> Scored:
        """Score a round's rows (``state``: the ``RewardState`` to score under, else the
        trainer's now), then the ``on_after_score`` hooks (``step_batch`` its prompts)."""
        start = time.perf_counter()
        scored = self.score(batch, rollouts, state)
        self.step_batch = batch  # the prompts of the scored rows, for on_after_score hooks
        scored = self._run_hooks("on_after_score", scored)
        self._clock.add(gen=gen_s, score=time.perf_counter() - start)
        return scored

    def step_output(self, batch: PromptBatch, scored: Scored, advantages: torch.Tensor,
                    update_metrics: dict[str, float], groups: torch.Tensor | None = None,
                    ) -> StepOutput:  # fmt: skip
        """Summarise the step for logging, the data module and callbacks."""
        lr = self.optimizers().param_groups[0]["lr"]
        return summarise_step(
            self._rollout_step, batch, scored, advantages, update_metrics, lr=lr, trained=groups
        )

    def publish(self, output: StepOutput) -> None:
        """Log the step and hand it to the data module and the callbacks."""
        self.last_step = output
        bar = {"train/reward", "train/accuracy"}
        for key, value in output.metrics.items():
            name = f"train/{key}"
            self.log(name, value, prog_bar=name in bar, batch_size=len(output.prompt_ids))
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "on_step_output"):
            datamodule.on_step_output(output)
        run_hooks(self.trainer, self, "on_step_output", output)

    def _run_hooks(self, name: str, value: Any) -> Any:
        return run_hooks(self.trainer, self, name, value)
