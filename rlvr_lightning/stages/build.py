"""What ``RLVRModule.__init__`` builds from its arguments: checks, the policy, the update and
the rewards. Plain functions of the constructor's values, so the module keeps only the wiring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rlvr_lightning import models
from rlvr_lightning.algorithms.outcomes import InformativeBy
from rlvr_lightning.algorithms.presets import Preset
from rlvr_lightning.environments import SessionFactory
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.models.dropout import disable_dropout
from rlvr_lightning.options import LoRA, MultiTurn, Options, Rewards, Selection
from rlvr_lightning.rewards import OverlongPenalty, RewardCombiner, boxed_accuracy, boxed_format
from rlvr_lightning.stages.update import PolicyUpdate
from rlvr_lightning.types import Sampling


def validate_options(
    options: Options, sampling: Sampling, estimator: str, value_head: object, probe_head: object
) -> None:
    """Raise a ValueError that says how to fix an inconsistent module configuration (the heads:
    their factories, or None)."""
    u = options.update
    if sampling.group_size < 2:
        raise ValueError(
            f"sampling.group_size must be >= 2 for group advantages, got {sampling.group_size}."
        )
    if min(u.epochs_per_rollout, u.minibatches_per_rollout, u.micro_batch_size) < 1:
        raise ValueError(
            "update.epochs_per_rollout, update.minibatches_per_rollout and "
            "update.micro_batch_size must all be >= 1."
        )
    if u.head_chunk_tokens < 1:
        raise ValueError(
            f"update.head_chunk_tokens must be >= 1, got {u.head_chunk_tokens} (to use the "
            "model's own LM head and full logits, set update.chunked_head: false)."
        )
    if not 0.0 <= u.min_lr_ratio <= 1.0:
        raise ValueError(
            f"update.min_lr_ratio must be in [0, 1] (a share of lr), got {u.min_lr_ratio}."
        )
    if u.max_steps_without_update is not None and u.max_steps_without_update < 1:
        raise ValueError("update.max_steps_without_update must be >= 1, or null to never stop.")
    if options.offpolicy.baseline == "on_policy" and estimator not in ("grpo", "dr_grpo"):
        raise ValueError("offpolicy.baseline: on_policy needs estimator grpo or dr_grpo.")
    check_value_head(estimator, value_head is not None)
    check_probe_head(estimator, probe_head is not None)
    if options.multiturn.enabled and value_head is not None:
        raise ValueError(
            "A value head (GAE) is not supported with multi-turn rollouts (its returns would "
            "run across the environment's tokens); use estimator grpo, rloo or dr_grpo."
        )


def group_filter(preset: Preset, selection: Selection) -> tuple[bool, InformativeBy]:
    """Whether uninformative groups are dropped, and what must vary in a group: the
    ``selection`` options where given, else the preset's."""
    fzv = selection.filter_zero_variance
    fzv = preset.filter_zero_variance if fzv is None else fzv
    return fzv, selection.informative or preset.informative


def check_value_head(estimator: str, has_value_head: bool) -> None:
    """A value head exactly when the estimator uses one (``gae``); else say which to change."""
    if estimator == "gae" and not has_value_head:
        raise ValueError(
            "estimator: gae needs a critic: set model.init_args.value_head "
            "(class_path: rlvr_lightning.heads.ValueHead), or choose another estimator "
            "(grpo, dr_grpo, rloo)."
        )
    if estimator != "gae" and has_value_head:
        raise ValueError(
            f"model.init_args.value_head is set but estimator {estimator!r} never reads values "
            "(the head would train for nothing): set model.init_args.estimator: gae, or remove "
            "value_head."
        )


def check_probe_head(estimator: str, has_probe_head: bool) -> None:
    """A probe head exactly when the estimator uses one (``probe``); else say which to change."""
    if estimator == "probe" and not has_probe_head:
        raise ValueError(
            "estimator: probe needs POISE's probe: set model.init_args.probe_head "
            "(class_path: rlvr_lightning.heads.ProbeHead), or choose another estimator "
            "(grpo, dr_grpo, rloo)."
        )
    if estimator != "probe" and has_probe_head:
        raise ValueError(
            f"model.init_args.probe_head is set but estimator {estimator!r} never reads its "
            "predictions (it would fit for nothing): set model.init_args.estimator: probe, or "
            "remove probe_head."
        )


def probe_head(factory: Callable[[int], ProbeHead] | None, policy: Any) -> ProbeHead | None:
    """The probe head for ``policy``'s hidden size (the input width of its LM head), or None."""
    return _head(factory, policy, ProbeHead, "probe_head")


def value_head(factory: Callable[[int], ValueHead] | None, policy: Any) -> ValueHead | None:
    """The value head for ``policy``'s hidden size (the input width of its LM head), or None."""
    return _head(factory, policy, ValueHead, "value_head")


def _head(factory: Callable[[int], Any] | None, policy: Any, cls: type, key: str) -> Any:
    if factory is None:
        return None
    head = factory(policy.get_output_embeddings().weight.shape[1])
    if not isinstance(head, cls):
        raise TypeError(
            f"model.init_args.{key} must build a rlvr_lightning.heads.{cls.__name__}, got "
            f"{type(head).__name__}."
        )
    return head


def policy_and_tokenizer(
    name: str, dtype: str, lora: LoRA, keep_dropout: bool = False
) -> tuple[Any, Any]:
    """The trainable policy (LoRA-wrapped when ``lora.rank > 0``) and its left-padding tokenizer;
    every dropout rate 0 unless ``keep_dropout`` (``models.dropout.disable_dropout``)."""
    policy, tokenizer = models.load_policy(name, dtype)
    if not keep_dropout:
        disable_dropout(policy)  # the reference and the heads' trunk are this model or its copy
    tokenizer.padding_side = "left"
    policy.train()
    if lora.rank > 0:
        policy = models.add_lora(policy, lora.rank, lora.alpha, 0.0, lora.target_modules)
    return policy, tokenizer


def check_prompt_format(prompt_format: str, tokenizer: Any, policy: str) -> None:
    """Raise when ``prompt_format: chat`` meets a tokenizer without a chat template."""
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt_format=chat, but the tokenizer of policy {policy!r} has no chat template "
            "(a base model?). Set model.init_args.prompt_format: plain to train on the prompt "
            "text without a template, or auto to choose by the tokenizer."
        )


def policy_update(preset: Preset, options: Options, sampling: Sampling) -> PolicyUpdate:
    """The loss settings: the module's options where given, else the preset's."""
    loss, update, off, corr = options.loss, options.update, options.offpolicy, options.correction

    def pick(name: str) -> Any:
        value = getattr(loss, name)
        return getattr(preset, name) if value is None else value

    return PolicyUpdate(
        loss_fn=loss.fn or preset.loss_fn,
        clip_low=pick("clip_low"),
        clip_high=pick("clip_high"),
        dual_clip=loss.dual_clip,
        agg_mode=pick("agg_mode"),
        norm_len=sampling.max_new_tokens,
        kl_coef=loss.kl_coef,
        kl_estimator=loss.kl_estimator,
        entropy_coef=loss.entropy_coef,
        micro_batch_size=update.micro_batch_size,
        offpolicy_weighting=off.weighting,
        offpolicy_gamma=off.gamma,
        offpolicy_exploration=off.exploration,
        rollout_correction=corr.mode,
        correction_cap=corr.cap,
        correction_level=corr.level,
        head_chunk_tokens=update.head_chunk_tokens if update.chunked_head else None,
    )


def reward_combiner(rewards: Rewards, overlong: bool, sampling: Sampling) -> RewardCombiner:
    """The reward functions (default: boxed accuracy and format) with their weights, isolation,
    timeout, NaN policy and failure limits (``RewardCombiner``); DAPO's overlong penalty when
    ``overlong``."""
    fns = (
        list(rewards.functions) if rewards.functions is not None else [boxed_accuracy, boxed_format]
    )
    weights = list(rewards.weights) if rewards.weights is not None else [1.0] * len(fns)
    if overlong:
        # DAPO's soft punishment; the buffer is a quarter of the budget (this project's choice).
        budget = sampling.max_new_tokens
        fns.append(OverlongPenalty(max_len=budget, buffer_len=max(budget // 4, 1)))
        weights.append(1.0)
    return RewardCombiner(
        fns,
        weights,
        timeout_s=rewards.timeout_s,
        isolate=rewards.isolate,
        nan_policy=rewards.nan_policy,
        max_failure_share=rewards.max_failure_share,
        failure_window=rewards.failure_window,
        max_abandoned_threads=rewards.max_abandoned_threads,
        worker_memory_mb=rewards.worker_memory_mb,
    )


def accuracy_reward_name(requested: str | None, names: Sequence[str]) -> str:
    """The reward that defines "correct": ``requested``, or the first reward."""
    name = requested or names[0]
    if name not in names:
        raise ValueError(
            f"rewards.accuracy_reward={requested!r} is not one of the reward names {names}."
        )
    return name


def session_factory(options: MultiTurn) -> SessionFactory | None:
    """The multi-turn tools and environment (one environment built now, to check it), or None
    for single-turn rollouts."""
    if not options.enabled:
        return None
    return SessionFactory(
        tools=list(options.tools or ()),
        environment_factory=options.environment,
        max_tool_output_chars=options.max_tool_output_chars,
    )
