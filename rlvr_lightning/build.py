"""What ``RLVRModule.__init__`` builds from its arguments: checks, the policy, the update and
the rewards. Plain functions of the constructor's values, so the module keeps only the wiring.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlvr_lightning import models
from rlvr_lightning.dropout import disable_dropout
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.presets import Preset
from rlvr_lightning.rewards import OverlongPenalty, RewardCombiner, boxed_accuracy, boxed_format
from rlvr_lightning.rewards.combine import NanPolicy
from rlvr_lightning.types import Sampling
from rlvr_lightning.update import PolicyUpdate


def validate_options(h: Mapping[str, Any], estimator: str) -> None:
    """Raise a ValueError that says how to fix an inconsistent module configuration."""
    group_size = h["sampling"]["group_size"]
    if group_size < 2:
        raise ValueError(
            f"sampling.group_size must be >= 2 for group advantages, got {group_size}."
        )
    if min(h["epochs_per_rollout"], h["minibatches_per_rollout"], h["micro_batch_size"]) < 1:
        raise ValueError(
            "epochs_per_rollout, minibatches_per_rollout and micro_batch_size must all be >= 1."
        )
    if h["head_chunk_tokens"] < 1:
        raise ValueError(
            f"head_chunk_tokens must be >= 1, got {h['head_chunk_tokens']} (to use the model's "
            "own LM head and full logits, set chunked_head: false)."
        )
    if not 0.0 <= h["min_lr_ratio"] <= 1.0:
        ratio = h["min_lr_ratio"]
        raise ValueError(f"min_lr_ratio must be in [0, 1] (a share of lr), got {ratio}.")
    if h["max_steps_without_update"] is not None and h["max_steps_without_update"] < 1:
        raise ValueError("max_steps_without_update must be >= 1, or null to never stop.")
    if h["offpolicy_baseline"] == "on_policy" and estimator not in ("grpo", "dr_grpo"):
        raise ValueError("offpolicy_baseline: on_policy needs estimator grpo or dr_grpo.")
    check_value_head(estimator, h["value_head"] is not None)
    check_probe_head(estimator, h["probe_head"] is not None)


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
    name: str,
    dtype: str,
    lora_rank: int,
    lora_alpha: float,
    lora_targets: list[str] | str,
    keep_dropout: bool = False,
) -> tuple[Any, Any]:
    """The trainable policy (LoRA-wrapped when ``lora_rank > 0``) and its left-padding tokenizer;
    every dropout rate 0 unless ``keep_dropout`` (``dropout.disable_dropout``)."""
    policy, tokenizer = models.load_policy(name, dtype)
    if not keep_dropout:
        disable_dropout(policy)  # the reference and the heads' trunk are this model or its copy
    tokenizer.padding_side = "left"
    policy.train()
    if lora_rank > 0:
        policy = models.add_lora(policy, lora_rank, lora_alpha, 0.0, lora_targets)
    return policy, tokenizer


def check_prompt_format(prompt_format: str, tokenizer: Any, policy: str) -> None:
    """Raise when ``prompt_format: chat`` meets a tokenizer without a chat template."""
    if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"prompt_format=chat, but the tokenizer of policy {policy!r} has no chat template "
            "(a base model?). Set model.init_args.prompt_format: plain to train on the prompt "
            "text without a template, or auto to choose by the tokenizer."
        )


def policy_update(preset: Preset, h: Mapping[str, Any], loss_fn: Callable | None) -> PolicyUpdate:
    """The loss settings: the module's arguments where given, else the preset's."""

    def pick(name: str) -> Any:
        return getattr(preset, name) if h[name] is None else h[name]

    return PolicyUpdate(
        loss_fn=loss_fn or preset.loss_fn,
        clip_low=pick("clip_low"),
        clip_high=pick("clip_high"),
        dual_clip=h["dual_clip"],
        agg_mode=pick("agg_mode"),
        norm_len=h["sampling"]["max_new_tokens"],
        kl_coef=h["kl_coef"],
        kl_estimator=h["kl_estimator"],
        entropy_coef=h["entropy_coef"],
        micro_batch_size=h["micro_batch_size"],
        offpolicy_weighting=h["offpolicy_weighting"],
        offpolicy_gamma=h["offpolicy_gamma"],
        offpolicy_exploration=h["offpolicy_exploration"],
        rollout_correction=h["rollout_correction"],
        correction_cap=h["rollout_correction_cap"],
        correction_level=h["rollout_correction_level"],
        head_chunk_tokens=h["head_chunk_tokens"] if h["chunked_head"] else None,
    )


def reward_combiner(
    fns: Sequence[Callable] | None,
    weights: Sequence[float] | None,
    timeout_s: float,
    overlong: bool,
    sampling: Sampling,
    isolate: bool | Sequence[str] | None = None,
    nan_policy: NanPolicy = "error",
) -> RewardCombiner:
    """The reward functions (default: boxed accuracy and format) with their weights; ``isolate``
    and ``nan_policy`` as in ``RewardCombiner``."""
    fns = list(fns) if fns is not None else [boxed_accuracy, boxed_format]
    weights = list(weights) if weights is not None else [1.0] * len(fns)
    if overlong:
        # DAPO's soft punishment; the buffer is a quarter of the budget (this project's choice).
        budget = sampling.max_new_tokens
        fns.append(OverlongPenalty(max_len=budget, buffer_len=max(budget // 4, 1)))
        weights.append(1.0)
    return RewardCombiner(fns, weights, timeout_s=timeout_s, isolate=isolate, nan_policy=nan_policy)


def accuracy_reward_name(requested: str | None, names: Sequence[str]) -> str:
    """The reward that defines "correct": ``requested``, or the first reward."""
    name = requested or names[0]
    if name not in names:
        raise ValueError(f"accuracy_reward={requested!r} is not one of the reward names {names}.")
    return name
