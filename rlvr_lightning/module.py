"""RLVRModule: the policy, its reference, and a training step that orchestrates pure functions.

``training_step`` = ``rollout`` -> ``score`` -> ``compute_advantages`` -> ``update``; each is a
public method a subclass may override. The math lives in ``losses``, ``advantages`` and ``ops``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from rlvr_lightning import build, models
from rlvr_lightning.dynamic import keep_first, refill_step
from rlvr_lightning.generation import GenerationStage
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.hooks import RLVRCallback
from rlvr_lightning.lifecycle import StepLifecycle, plain_hparam
from rlvr_lightning.metrics import EvalMetrics
from rlvr_lightning.offpolicy import mixed_advantages
from rlvr_lightning.optimise import UpdateStage
from rlvr_lightning.outcomes import InformativeBy, informative_groups, sampled_rows
from rlvr_lightning.presets import AlgorithmName, EstimatorName, get_preset
from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.factory import resolve_engine
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored, StepOutput

AggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]

log = logging.getLogger(__name__)


class RLVRModule(StepLifecycle, GenerationStage, UpdateStage, pl.LightningModule):
    """GRPO-style RL with verifiable rewards.

    Args:
        policy: model name: a local folder or Hub id, ``embedded:smollm2-135m-instruct``, or
            ``tiny:<seed>`` for an in-process random model.
        dtype: parameter dtype of the policy (``float32`` or ``bfloat16``).
        algorithm: preset filling the defaults of the loss, clipping, aggregation and advantage
            estimator: ``grpo``, ``dapo``, ``dr_grpo``, ``gspo`` or ``cispo``.
        loss_fn: a custom per-token policy loss (import path in YAML) with the signature of
            ``losses.PolicyLossFn``; overrides the preset's loss.
        estimator: advantage estimator (``grpo``, ``dr_grpo``, ``rloo``, ``gae``: per-token
            GAE with ``value_head`` as critic, spec §8.7, or ``probe``: POISE's baseline from
            ``probe_head``, spec §7.1); None = the preset's.
        value_head: the critic of ``estimator: gae``, called with the policy's hidden size:
            ``heads.ValueHead`` (class path and init args in YAML: MLP, lr, value clipping,
            ``gamma``, ``lam``); None without it. It is saved in checkpoints.
        probe_head: POISE's probe of ``estimator: probe``, called with the policy's hidden
            size: ``heads.ProbeHead`` (layer, PCA sizes, ridge ``alpha``, bootstrap, refit,
            buffer); None without it. Its rows and fit are saved in checkpoints.
        agg_mode: loss aggregation (see ``losses.agg_loss``); None = the preset's.
        clip_low: lower clip range; None = the preset's.
        clip_high: upper clip range; None = the preset's.
        dual_clip: dual-clip constant for negative advantages (None = off).
        filter_zero_variance: drop uninformative groups from the update; None = the preset's
            (on for ``dapo``).
        informative: what must vary within a group (as trained, injected members included)
            for it to be informative: ``accuracy`` (some but not all rows correct, spec §8.2)
            or the total ``reward`` (a format reward then makes an all-wrong group count);
            None = the preset's (``accuracy`` for every preset).
        dynamic_sampling: DAPO dynamic sampling: generate extra rounds of prompts (drawn from
            the data module) until the step has as many informative groups as prompts (see
            ``dynamic.py``); implies dropping uninformative groups.
        max_gen_rounds: extra generation rounds dynamic sampling may run per step.
        reward_fns: reward functions ``fn(completions, **columns) -> list[float | None]``; by
            default ``boxed_accuracy`` and ``boxed_format``. Besides the dataset's columns they
            may name ``prompts``, ``completion_ids`` and ``completion_length`` (see ``score``);
            ``async def`` functions are awaited.
        reward_weights: one weight per reward function (default: all 1).
        reward_timeout_s: seconds a reward function may run before its rows score 0.
        reward_isolate: which reward functions run in worker processes that are killed and
            replaced on timeout: None = those marked ``@rewards.run_in_process`` (the built-in
            ``boxed_accuracy`` and ``answer_accuracy``), true / false = all / none, or a list of
            reward names. The others run in a thread, abandoned on timeout.
        reward_nan_policy: a NaN or infinite reward value stops training with an error naming
            the function (``error``) or scores 0.0 and counts in ``reward/<name>/failures``
            (``fail``). ``None`` always means "not applicable".
        prompt_format: how prompts become tokens: ``chat`` (the tokenizer's chat template),
            ``plain`` (no template: the messages' contents joined by blank lines, roles
            dropped; for base models) or ``auto`` (``chat`` when the tokenizer has a chat
            template, else ``plain``).
        accuracy_reward: name of the reward that defines "correct" (default: the first).
        accuracy_threshold: a row is correct when that reward is >= this value.
        sampling: training sampling (``group_size`` is G).
        val_sampling: validation sampling; temperature 0 is greedy, ``group_size`` > 1 adds
            pass@k with k = group_size (sampled at the given temperature).
        epochs_per_rollout: optimisation passes over each rollout batch.
        minibatches_per_rollout: optimiser steps per pass (each over a share of the rows).
        micro_batch_size: rows per forward/backward; bounds memory, not the maths.
        chunked_head: compute the log-probs from the LM head's input ``head_chunk_tokens``
            tokens at a time (``chunked_head.head_logprobs``, forward and backward), so the
            ``[rows, tokens, vocab]`` logits of a micro-batch never exist; the same maths.
            Models whose head is not a plain ``nn.Linear`` (e.g. LoRA on ``lm_head``) or that
            post-process logits (soft-capping) keep their own head (``forward.fused_head``).
            False: the model's full logits, as transformers computes them.
        head_chunk_tokens: tokens per chunk of the chunked LM head; bounds its working set to
            about ``3 * head_chunk_tokens * vocab`` fp32 numbers.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up in optimiser steps, then ``lr_decay``.
        lr_decay: after the warm-up, ``none`` keeps the lr constant; ``linear`` and ``cosine``
            bring it down to ``min_lr_ratio * lr`` at ``trainer.max_steps`` optimiser steps
            (``lifecycle.lr_factor``), which must then be set.
        min_lr_ratio: the decay's floor, as a share of ``lr``.
        grad_clip: max gradient norm (None = no clipping).
        trim_heap: after each micro-batch's backward, return the C heap's free pages to the OS
            (``heap.py``: lower peak memory, ~10% more update time as pages fault back in);
            None = on the CPU (fp32 with oneDNN's products, ``cpu_linear``: peak 4.82 ->
            4.32 GiB for 6% more step time in ``vs_trl.py``). With one micro-batch a step
            there is nothing to trim between: false is faster (the quickstart's step: 8.5 ->
            7.4 s median).
        kl_coef: weight of the KL-to-reference term in the loss; 0 skips the reference model.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (spec §8.6).
        entropy_coef: weight of an entropy bonus in the loss.
        lora_rank: LoRA rank; 0 trains all parameters.
        lora_alpha: LoRA alpha.
        lora_target_modules: modules LoRA wraps (peft names or ``all-linear``).
        keep_dropout: keep the model's dropout; by default every rate is set to 0 at load, as
            TRL does (dropout makes ``pi / pi_old`` differ from 1 on on-policy tokens).
        max_nonfinite_steps: consecutive skipped non-finite updates before training stops.
        max_steps_without_update: consecutive rollout steps without an optimiser step (every
            group filtered out) before training stops with an error, since ``max_steps``
            counts optimiser steps and would never be reached; None never stops. 50 is this
            project's choice: a curriculum may filter a few steps, a constant reward all.
        engine: rollout engine: ``hf`` (transformers ``generate`` on the policy itself),
            ``vllm`` (a colocated ``vllm.LLM`` holding its own copy of the weights, synced from
            the policy before the first rollout after each optimiser step) or ``auto``
            (``vllm`` when vLLM is installed, see ``rollout.factory.resolve_engine``).
        engine_kwargs: constructor arguments of the engine (``HFEngine`` or ``VLLMEngine``,
            e.g. ``gpu_memory_utilization``, ``dtype``, ``enable_sleep``). vLLM's ``dtype``
            follows the trainer's precision unless given (``rollout.factory.engine_dtype``).
        old_logprobs: where ``π_old`` comes from: ``engine`` (the behaviour log-probs recorded
            while sampling, no extra forward), ``trainer`` (a no-grad forward of the policy in
            the update's precision; the behaviour log-probs then only weight the loss) or
            ``auto`` (``trainer`` when the engine holds its own weights, i.e. vLLM, or when
            sampled tokens were drawn at a temperature other than ``sampling.temperature``:
            per-row, or per-position as EAD's; else ``engine``). With ``trainer`` the loss
            scores every sampled row at ``sampling.temperature``; an update of one optimiser
            step (and no value or probe head) reads it from its own forward instead of an extra
            pass, the same numbers. See ``correction.py``.
        rollout_correction: with ``π_old`` from the trainer, how tokens sampled by a
            different distribution are weighted: ``tis`` (``min(π_old/π_behaviour, cap)``),
            ``mask`` (drop tokens whose ratio leaves ``[1/cap, cap]``) or ``none``.
        rollout_correction_cap: the cap ``C`` (2.0, the value the EAD paper's draft and
            Yao et al. use).
        rollout_correction_level: ratio per ``token`` or per ``sequence`` (product over the
            row's tokens).
        offpolicy_weighting: loss weighting of injected (off-policy) tokens, see
            ``losses.offpolicy_token_loss``: ``shaping`` (LUFFY/ExGRPO ``f(w) = w/(w+gamma)``),
            ``mis`` (RL-PLUS) or ``on_policy`` (ratio 1, an advantage-weighted SFT term).
        offpolicy_gamma: ``gamma`` of the shaping (0.1 in LUFFY and ExGRPO).
        offpolicy_exploration: RL-PLUS exponent of ``(1 - pi)`` on off-policy advantages.
        offpolicy_baseline: group baseline when a group holds off-policy members: ``mixed``
            (all members, LUFFY's script) or ``on_policy`` (on-policy members only).
    """

    def __init__(
        self,
        policy: str = models.EMBEDDED_DEFAULT,
        *,
        dtype: Literal["float32", "bfloat16"] = "float32",
        algorithm: AlgorithmName = "grpo",
        loss_fn: Callable | None = None,
        estimator: EstimatorName | None = None,
        value_head: Callable[[int], ValueHead] | None = None,
        probe_head: Callable[[int], ProbeHead] | None = None,
        agg_mode: AggMode | None = None,
        clip_low: float | None = None,
        clip_high: float | None = None,
        dual_clip: float | None = None,
        filter_zero_variance: bool | None = None,
        informative: InformativeBy | None = None,
        dynamic_sampling: bool = False,
        max_gen_rounds: int = 3,
        reward_fns: Sequence[Callable] | None = None,
        reward_weights: Sequence[float] | None = None,
        reward_timeout_s: float = 30.0,
        reward_isolate: bool | list[str] | None = None,
        reward_nan_policy: Literal["error", "fail"] = "error",
        prompt_format: Literal["chat", "plain", "auto"] = "auto",
        accuracy_reward: str | None = None,
        accuracy_threshold: float = 1.0,
        sampling: Sampling = Sampling(max_new_tokens=64, temperature=1.0, group_size=8),
        val_sampling: Sampling = Sampling(max_new_tokens=64, temperature=0.0, group_size=1),
        epochs_per_rollout: int = 1,
        minibatches_per_rollout: int = 1,
        micro_batch_size: int = 8,
        chunked_head: bool = True,
        head_chunk_tokens: int = 1024,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_decay: Literal["none", "linear", "cosine"] = "none",
        min_lr_ratio: float = 0.0,
        grad_clip: float | None = 1.0,
        trim_heap: bool | None = None,
        kl_coef: float = 0.0,
        kl_estimator: Literal["k1", "k2", "k3"] = "k3",
        entropy_coef: float = 0.0,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: list[str] | str = "all-linear",
        keep_dropout: bool = False,
        max_nonfinite_steps: int = 3,
        max_steps_without_update: int | None = 50,
        engine: Literal["hf", "vllm", "auto"] = "hf",
        engine_kwargs: dict[str, Any] | None = None,
        old_logprobs: Literal["auto", "engine", "trainer"] = "auto",
        rollout_correction: Literal["tis", "mask", "none"] = "tis",
        rollout_correction_cap: float = 2.0,
        rollout_correction_level: Literal["token", "sequence"] = "token",
        offpolicy_weighting: Literal["shaping", "mis", "on_policy"] = "shaping",
        offpolicy_gamma: float = 0.1,
        offpolicy_exploration: float = 0.5,
        offpolicy_baseline: Literal["mixed", "on_policy"] = "mixed",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        for key, value in self.hparams.items():
            self.hparams[key] = plain_hparam(value)
        self.automatic_optimization = False
        preset = get_preset(algorithm)
        self.estimator = estimator or preset.estimator
        build.validate_options(self.hparams, self.estimator)
        self.filter_zero_variance = (
            preset.filter_zero_variance if filter_zero_variance is None else filter_zero_variance
        )
        self.informative: InformativeBy = informative or preset.informative
        self.sampling, self.val_sampling = sampling, val_sampling
        self.policy, self.tokenizer = build.policy_and_tokenizer(
            policy, dtype, lora_rank, lora_alpha, lora_target_modules, keep_dropout
        )
        self.value_head = build.value_head(value_head, self.policy)  # a submodule: checkpointed
        self.probe_head = build.probe_head(probe_head, self.policy)  # buffers: checkpointed
        build.check_prompt_format(prompt_format, self.tokenizer, policy)
        # Not registered as a submodule: the frozen copy never enters checkpoints or optimisers.
        self._reference = (
            (models.frozen_copy(self.policy),) if kl_coef > 0 and lora_rank == 0 else ()
        )
        self.updater = build.policy_update(preset, self.hparams, loss_fn)
        self.rewards = build.reward_combiner(
            reward_fns,
            reward_weights,
            reward_timeout_s,
            preset.overlong_shaping,
            sampling,
            isolate=reward_isolate,
            nan_policy=reward_nan_policy,
        )
        self.accuracy_reward = build.accuracy_reward_name(accuracy_reward, self.rewards.names)
        resolve_engine(engine, policy)  # a missing vLLM is a setup error; built on first use
        self._engine: RolloutEngine | None = None
        self._engine_synced_at = 0  # global step whose weights the engine holds
        self.val_metrics = EvalMetrics(val_sampling.group_size)
        self.test_metrics = EvalMetrics(val_sampling.group_size)
        self.last_step: StepOutput | None = None
        self.step_batch: PromptBatch | None = None  # prompts of the rows being scored
        self._rollout_step = 0
        self._nonfinite_streak = 0
        self._no_update_streak = 0  # rollout steps in a row without an optimiser step
        self._round_times = {"gen": 0.0, "score": 0.0}  # this step's seconds, all rounds

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference policy (None when KL is off or LoRA provides it)."""
        return self._reference[0] if self._reference else None

    def on_fit_start(self) -> None:
        if self.reference is not None:
            self.reference.to(self.device)

    # ---- the stages (rollout: generation.py, update: optimise.py) ---------------------------

    def score(self, batch: PromptBatch, rollouts: Rollouts) -> Scored:
        """Run the reward functions; columns are repeated ``G`` times to align with rows.

        Besides the batch's columns, each row has ``prompts`` (the data module's ``prompts``
        column: the prompt text, or the message list of a conversational prompt; the messages
        for batches without it), ``completion_ids`` (the completion's token ids up to and
        including EOS) and ``completion_length`` (their number).
        """
        g = rollouts.group_size
        columns = {k: [v for v in vals for _ in range(g)] for k, vals in batch.columns.items()}
        columns.setdefault("prompts", [m for m in batch.messages for _ in range(g)])
        mask = rollouts.completion_mask.bool()  # [N, T]
        columns["completion_ids"] = [
            ids[keep].tolist() for ids, keep in zip(rollouts.completion_ids, mask, strict=True)
        ]
        columns["completion_length"] = rollouts.lengths.tolist()
        result = self.rewards(rollouts.completions, columns)
        acc = result.per_function[self.accuracy_reward].nan_to_num(0.0)  # [N]
        rewards, correct = result.total.to(self.device), acc >= self.hparams.accuracy_threshold
        return Scored(
            rollouts=rollouts,
            rewards=rewards,
            per_function=result.per_function,
            correct=correct,
            metrics=result.metrics,
            sampled_correct=correct,
            sampled_rewards=rewards,
        )

    def compute_advantages(self, scored: Scored) -> torch.Tensor:
        """Advantages ``[N]`` (or ``[N, T]``) from the rewards; override to change the estimator.

        Groups with off-policy members use ``offpolicy.mixed_advantages`` (baseline choice, caps);
        ``gae`` reads the value head's ``V_old`` (``Rollouts.old_values``), ``probe`` the probe
        head's predictions (``Rollouts.probe_features``).
        """
        extra = {} if self.value_head is None else self.value_head.estimator_kwargs(scored.rollouts)
        if self.probe_head is not None:
            extra = self.probe_head.estimator_kwargs(scored)
        return mixed_advantages(scored, self.estimator, self.hparams.offpolicy_baseline, **extra)

    def select_groups(self, batch: PromptBatch, scored: Scored) -> torch.Tensor:
        """``[B]`` bool: groups the update uses.

        With filtering or dynamic sampling on, a group must be informative as trained
        (``outcomes.informative_groups`` by ``self.informative``, injected members included);
        the data module's curriculum, if any, judges the sampled rows only.
        """
        g = scored.rollouts.group_size
        keep = torch.ones(len(batch), dtype=torch.bool)  # [B]
        if self.filter_zero_variance or self.hparams.dynamic_sampling:
            keep &= informative_groups(scored.correct, scored.rewards, g, self.informative)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        if hasattr(datamodule, "train_group_mask"):
            correct, rewards = sampled_rows(scored)
            mask = datamodule.train_group_mask(correct.view(-1, g), rewards.view(-1, g))
            keep = keep if mask is None else keep & mask.cpu()
        return keep

    # ---- the step ---------------------------------------------------------------------------

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return clock[-1] - clock[-2]

        batch = self._run_hooks("on_before_rollout", batch)
        target = len(batch)
        self._round_times = {"gen": 0.0, "score": 0.0}
        scored = self.generate_round(batch)
        extra_metrics: dict[str, float] = {}
        if self.hparams.dynamic_sampling:
            batch, scored, extra_metrics = refill_step(self, batch, scored)
            self.step_batch = batch
        lap()
        gen_s, score_s = self._round_times["gen"], self._round_times["score"]
        scored, mismatch = self.recompute_old_logprobs(scored)
        extra_metrics.update(mismatch)
        advantages = self.compute_advantages(scored)
        if self.probe_head is not None:  # POISE: advantages first, then the step's rows
            extra_metrics.update(self.probe_head.observe(scored))
        groups = self.select_groups(batch, scored)  # [B]
        if self.hparams.dynamic_sampling:
            groups = keep_first(groups, target)
        optimiser_steps = self.global_step
        update_metrics = self.update(scored, advantages, groups)
        update_s = lap()
        output = self.step_output(batch, scored, advantages, update_metrics, groups)
        output.metrics.update(extra_metrics)
        output.metrics.update(
            gen_tokens_per_s=float(scored.rollouts.lengths.sum()) / max(gen_s, 1e-9),
            gen_time_s=gen_s,
            score_time_s=score_s,
            update_time_s=update_s,
            step_time_s=clock[-1] - clock[0],
        )
        self.publish(output)
        self._rollout_step += 1
        self._check_progress(self.global_step > optimiser_steps)

    def generate_round(self, batch: PromptBatch) -> Scored:
        """Rollout, score, then the ``on_after_score`` hooks, for one round of prompts.

        Dynamic sampling calls it again for each extra round, so the hooks see every group
        (with ``step_batch`` its prompts) before anything judges it informative: a group a hook
        rescues (e.g. an all-wrong one given its reference) is never thrown away first.
        """
        start = time.perf_counter()
        batch = self._run_hooks("on_before_generate", batch)
        rollouts = self.rollout(batch)
        generated = time.perf_counter()
        scored = self.score(batch, rollouts)
        self.step_batch = batch  # the prompts of the scored rows, for on_after_score hooks
        scored = self._run_hooks("on_after_score", scored)
        self._round_times["gen"] += generated - start
        self._round_times["score"] += time.perf_counter() - generated
        return scored

    def step_output(
        self,
        batch: PromptBatch,
        scored: Scored,
        advantages: torch.Tensor,
        update_metrics: dict[str, float],
        groups: torch.Tensor | None = None,
    ) -> StepOutput:
        """Summarise the step for logging, the data module and callbacks."""
        from rlvr_lightning.summary import summarise_step

        return summarise_step(
            self._rollout_step,
            batch,
            scored,
            advantages,
            update_metrics,
            lr=self.optimizers().param_groups[0]["lr"],
            trained=groups,
        )

    def publish(self, output: StepOutput) -> None:
        """Log the step and hand it to the data module and the callbacks."""
        self.last_step = output
        bar = {"train/reward", "train/accuracy"}
        for key, value in output.metrics.items():
            self.log(
                f"train/{key}",
                value,
                prog_bar=f"train/{key}" in bar,
                batch_size=len(output.prompt_ids),
            )
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and hasattr(datamodule, "on_step_output"):
            datamodule.on_step_output(output)
        for cb in self._rlvr_callbacks():
            cb.on_step_output(self.trainer, self, output)

    def _rlvr_callbacks(self) -> list[RLVRCallback]:
        return [cb for cb in self.trainer.callbacks if isinstance(cb, RLVRCallback)]

    def _run_hooks(self, name: str, value: Any) -> Any:
        for cb in self._rlvr_callbacks():
            new = getattr(cb, name)(self.trainer, self, value)
            value = value if new is None else new
        return value
