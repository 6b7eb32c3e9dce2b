"""The argument groups of ``RLVRModule``: typed dataclasses, one per concern.

LightningCLI turns each into a YAML block (``model.init_args.loss.kl_coef``) and a section of
``--help``. A group also arrives as a plain dict (a checkpoint's hyperparameters) and becomes the
dataclass again (:func:`as_group`). Keys that stood at the top level before the groups existed
(``kl_coef``) are listed in :data:`MOVED`, so the CLI names their new place in one line and old
checkpoints load (:func:`regroup`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rlvr_lightning.algorithms.losses import AggMode
from rlvr_lightning.algorithms.outcomes import InformativeBy
from rlvr_lightning.options.asynchrony import Asynchrony
from rlvr_lightning.options.multiturn import MultiTurn


@dataclass(frozen=True)
class Rewards:
    """Reward functions and what counts as correct.

    Args:
        functions: reward functions ``fn(completions, **columns) -> list[float | None]``
            (TRL's contract); by default ``boxed_accuracy`` and ``boxed_format``. Besides the
            dataset's columns they may name ``prompts``, ``completion_ids`` and
            ``completion_length``; ``async def`` functions are awaited.
        weights: one weight per reward function (default: all 1).
        timeout_s: seconds a reward function may run before its rows score 0.
        isolate: which reward functions run in worker processes that are killed and replaced on
            timeout: None = those marked ``@rewards.run_in_process`` (the built-in
            ``boxed_accuracy`` and ``answer_accuracy``), true / false = all / none, or a list of
            reward names. The others run in a thread, abandoned on timeout.
        nan_policy: a NaN or infinite reward stops training with an error naming the function
            (``error``) or scores 0.0 and counts in ``reward/<name>/failures`` (``fail``).
            ``None`` always means "not applicable".
        accuracy_reward: name of the reward that defines "correct" (default: the first).
        accuracy_threshold: a row is correct when that reward is >= this value.
        max_failure_share: a reward that raises (or times out) on every row of a batch, or on
            more than this share of its rows over the last ``failure_window`` batches, stops the
            run naming it, its error and the fix; None never stops (failures stay counted
            warnings). 0.5 is this project's choice.
        failure_window: batches the failure share is judged over (once the window is full).
        max_abandoned_threads: a thread-run reward that timed out keeps running (Python cannot
            stop a thread): after this many still-running timed-out calls the run stops with
            the fix (``isolate`` the reward); None never stops.
        worker_memory_mb: address-space budget of each reward worker process (isolated
            rewards); an allocation past it fails those rows instead of the machine's memory
            running out. 4096 is this project's choice; None: no budget.
    """

    functions: Sequence[Callable] | None = None
    weights: Sequence[float] | None = None
    timeout_s: float = 30.0
    isolate: bool | list[str] | None = None
    nan_policy: Literal["error", "fail"] = "error"
    accuracy_reward: str | None = None
    accuracy_threshold: float = 1.0
    max_failure_share: float | None = 0.5
    failure_window: int = 10
    max_abandoned_threads: int | None = 3
    worker_memory_mb: int | None = 4096


@dataclass(frozen=True)
class Loss:
    """The per-token policy loss and its regularisers; None = the algorithm preset's value.

    Args:
        fn: a custom per-token policy loss (import path in YAML) with the signature of
            ``algorithms.losses.PolicyLossFn``; overrides the preset's loss.
        agg_mode: loss aggregation (see ``algorithms.losses.agg_loss``).
        clip_low: lower clip range.
        clip_high: upper clip range.
        dual_clip: dual-clip constant for negative advantages (None = off).
        kl_coef: weight of the KL-to-reference term; 0 skips the reference model.
        kl_estimator: ``k1``, ``k2`` or ``k3`` (spec §8.6).
        entropy_coef: weight of an entropy bonus.
    """

    fn: Callable | None = None
    agg_mode: AggMode | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0


@dataclass(frozen=True)
class Selection:
    """Which groups train: the data-strategy switches of a step.

    Args:
        filter_zero_variance: drop uninformative groups from the update; None = the preset's
            (on for ``dapo``).
        informative: what must vary within a group (as trained, injected members included) for
            it to be informative: ``accuracy`` (some but not all rows correct, spec §8.2) or the
            total ``reward``; None = the preset's (``accuracy`` for every preset).
        dynamic_sampling: DAPO dynamic sampling: extra rounds of prompts until the step has as
            many informative groups as prompts (``stages.dynamic``); implies filtering.
        max_gen_rounds: extra generation rounds dynamic sampling may run per step.
    """

    filter_zero_variance: bool | None = None
    informative: InformativeBy | None = None
    dynamic_sampling: bool = False
    max_gen_rounds: int = 3


@dataclass(frozen=True)
class Update:
    """How a rollout batch becomes optimiser steps, and what bounds its memory.

    Args:
        epochs_per_rollout: optimisation passes over each rollout batch.
        minibatches_per_rollout: optimiser steps per pass (each over a share of the rows).
        micro_batch_size: rows per forward/backward; bounds memory, not the maths.
        chunked_head: log-probs from the LM head's input ``head_chunk_tokens`` tokens at a time
            (forward and backward), so a micro-batch's ``[rows, tokens, vocab]`` logits never
            exist; the same maths. Models whose head is not a plain ``nn.Linear`` or that
            post-process logits keep their own head. False: the model's full logits.
        head_chunk_tokens: tokens per chunk of the chunked LM head.
        trim_heap: return the C heap's free pages to the OS around each micro-batch's backward
            (lower peak memory, some more update time); None = on the CPU. With one
            micro-batch a step there is nothing to trim between: false is faster.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up in optimiser steps, then ``lr_decay``.
        lr_decay: after the warm-up, ``none`` keeps the lr; ``linear`` and ``cosine`` bring it
            to ``min_lr_ratio * lr`` at ``trainer.max_steps`` optimiser steps (then required).
        min_lr_ratio: the decay's floor, as a share of ``lr``.
        grad_clip: max gradient norm (None = no clipping).
        max_nonfinite_steps: consecutive skipped non-finite updates before training stops.
        max_steps_without_update: consecutive rollout steps without an optimiser step (every
            group filtered out) before training stops with an error; None never stops. 50 is
            this project's choice.
    """

    epochs_per_rollout: int = 1
    minibatches_per_rollout: int = 1
    micro_batch_size: int = 8
    chunked_head: bool = True
    head_chunk_tokens: int = 1024
    trim_heap: bool | None = None
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    lr_decay: Literal["none", "linear", "cosine"] = "none"
    min_lr_ratio: float = 0.0
    grad_clip: float | None = 1.0
    max_nonfinite_steps: int = 3
    max_steps_without_update: int | None = 50


@dataclass(frozen=True)
class LoRA:
    """LoRA adapters (peft).

    Args:
        rank: LoRA rank; 0 trains all parameters.
        alpha: LoRA alpha.
        target_modules: modules LoRA wraps (peft names or ``all-linear``).
    """

    rank: int = 0
    alpha: float = 16.0
    target_modules: list[str] | str = "all-linear"


@dataclass(frozen=True)
class Correction:
    """Where ``π_old`` comes from and how sampler/trainer mismatch is weighted.

    Args:
        old_logprobs: ``engine`` (the behaviour log-probs recorded while sampling), ``trainer``
            (a no-grad forward in the update's precision; the behaviour log-probs then only
            weight the loss) or ``auto`` (``trainer`` when the engine holds its own weights,
            when the sampler truncates (``sampling.top_p < 1`` or ``top_k > 0``), or when
            sampled tokens were drawn at a temperature other than ``sampling.temperature``;
            else ``engine``). See ``algorithms.correction``.
        mode: tokens sampled by a different distribution: ``tis``
            (``min(π_old/π_behaviour, cap)``), ``mask`` (drop tokens whose ratio leaves
            ``[1/cap, cap]``) or ``none``.
        cap: the cap ``C`` (2.0, the value the EAD paper's draft and Yao et al. use).
        level: ratio per ``token`` or per ``sequence`` (product over the row's tokens).
    """

    old_logprobs: Literal["auto", "engine", "trainer"] = "auto"
    mode: Literal["tis", "mask", "none"] = "tis"
    cap: float = 2.0
    level: Literal["token", "sequence"] = "token"


@dataclass(frozen=True)
class OffPolicy:
    """Injected (off-policy) group members: their loss and baseline.

    Args:
        weighting: loss weighting of injected tokens (``algorithms.offpolicy_losses
            .offpolicy_token_loss``): ``shaping`` (LUFFY/ExGRPO ``f(w) = w/(w+gamma)``),
            ``mis`` (RL-PLUS) or ``on_policy`` (ratio 1, an advantage-weighted SFT term).
        gamma: ``gamma`` of the shaping (0.1 in LUFFY and ExGRPO).
        exploration: RL-PLUS exponent of ``(1 - pi)`` on off-policy advantages.
        baseline: group baseline with off-policy members: ``mixed`` (all members, LUFFY's
            script) or ``on_policy`` (on-policy members only).
    """

    weighting: Literal["shaping", "mis", "on_policy"] = "shaping"
    gamma: float = 0.1
    exploration: float = 0.5
    baseline: Literal["mixed", "on_policy"] = "mixed"


@dataclass(frozen=True)
class Options:
    """All groups together, as the module keeps them (``RLVRModule.options``)."""

    @classmethod
    def of(cls, **groups: Any) -> Options:
        """The groups given as dataclasses or dicts (a checkpoint's hyperparameters);
        ``asynchrony`` (top-level module arguments) as an ``Asynchrony``."""
        made = {n: v if n == "asynchrony" else as_group(GROUPS[n], v) for n, v in groups.items()}
        return cls(**made)

    rewards: Rewards = Rewards()
    loss: Loss = Loss()
    selection: Selection = Selection()
    update: Update = Update()
    lora: LoRA = LoRA()
    correction: Correction = Correction()
    offpolicy: OffPolicy = OffPolicy()
    multiturn: MultiTurn = MultiTurn()
    asynchrony: Asynchrony = Asynchrony()

    def __post_init__(self) -> None:
        if self.asynchrony.rollout_mode == "async" and self.selection.dynamic_sampling:
            raise ValueError(
                "rollout_mode: async with selection.dynamic_sampling: the extra rounds would be "
                "generated at training time, by the newest policy; use one or the other."
            )
        if self.asynchrony.partial and self.multiturn.enabled:
            raise ValueError(
                "concurrent_rollouts (partial rollouts) continues single-turn completions; "
                "multi-turn trajectories are not continued across steps in this version. Use "
                "rollout_mode: async without concurrent_rollouts (the delay line), or no tools."
            )


GROUPS: dict[str, type] = {
    "rewards": Rewards, "loss": Loss, "selection": Selection, "update": Update, "lora": LoRA,
    "correction": Correction, "offpolicy": OffPolicy, "multiturn": MultiTurn,
}  # fmt: skip

# The keys of the ungrouped signature whose name changed with their group.
_RENAMED = {
    "reward_fns": "rewards.functions", "reward_weights": "rewards.weights",
    "reward_timeout_s": "rewards.timeout_s", "reward_isolate": "rewards.isolate",
    "reward_nan_policy": "rewards.nan_policy", "loss_fn": "loss.fn",
    "lora_rank": "lora.rank", "lora_alpha": "lora.alpha",
    "lora_target_modules": "lora.target_modules", "rollout_correction": "correction.mode",
    "rollout_correction_cap": "correction.cap", "rollout_correction_level": "correction.level",
    "offpolicy_weighting": "offpolicy.weighting", "offpolicy_gamma": "offpolicy.gamma",
    "offpolicy_exploration": "offpolicy.exploration", "offpolicy_baseline": "offpolicy.baseline",
}  # fmt: skip
_KEPT_NAMES = ("rewards", "loss", "selection", "update", "correction")
# A group's field named at the top level -> group.field: every key of the ungrouped signature,
# and the fields added since (so a newer key in the old place is pointed to its group too).
MOVED: dict[str, str] = {
    **{
        f.name: f"{group}.{f.name}"
        for group in _KEPT_NAMES
        for f in dataclasses.fields(GROUPS[group])
        if f"{group}.{f.name}" not in _RENAMED.values()
    },
    **_RENAMED,
}

G = TypeVar("G")


def as_group(cls: type[G], value: G | Mapping[str, Any] | None) -> G:
    """``value`` as a ``cls`` instance: a dict (a checkpoint's hyperparameters) is converted,
    None gives the defaults."""
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        return cls(**value)
    return value


def regroup(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Hyperparameters with the pre-group top-level keys (:data:`MOVED`) moved into their
    groups, so checkpoints written before the groups existed load with their settings."""
    out: dict[str, Any] = {k: v for k, v in hparams.items() if k not in MOVED}
    for old, new in MOVED.items():
        if old in hparams:
            group, field = new.split(".")
            current = out.get(group)
            out[group] = {
                **(dict(current) if isinstance(current, Mapping) else {}),
                field: hparams[old],
            }
    return out


_M, _D = "model.init_args.", "data.init_args."
# TRL's GRPOConfig (and ModelConfig / ScriptArguments) names -> (the key here, what differs).
# The CLI's error for such a key names its place here; README "Coming from TRL" shows them.
TRL_NAMES: dict[str, tuple[str, str]] = {
    "model_name_or_path": (_M + "policy", "a Hub id or a local folder"),
    "num_generations": (_M + "sampling.group_size", ""),
    "beta": (_M + "loss.kl_coef", "0 skips the reference model, as in TRL"),
    "learning_rate": (_M + "update.lr", ""),
    "per_device_train_batch_size": (
        _D + "prompts_per_step", "counts prompts, not completions: TRL's value / num_generations"
    ),
    "gradient_accumulation_steps": (
        _M + "update.micro_batch_size", "rows per forward/backward; the maths is the same"
    ),
    "max_completion_length": (_M + "sampling.max_new_tokens", ""),
    "max_prompt_length": (_D + "max_prompt_tokens", ""),
    "temperature": (_M + "sampling.temperature", ""),
    "top_p": (_M + "sampling.top_p", ""),
    "top_k": (_M + "sampling.top_k", ""),
    "epsilon": (_M + "loss.clip_low", ""),
    "epsilon_high": (_M + "loss.clip_high", ""),
    "loss_type": (_M + "algorithm", "the grpo, dapo, dr_grpo presets; or loss.agg_mode alone"),
    "scale_rewards": (_M + "estimator", "grpo divides by the group's std, dr_grpo does not"),
    "importance_sampling_level": (_M + "algorithm", "sequence-level ratios: gspo"),
    "num_iterations": (_M + "update.epochs_per_rollout", ""),
    "steps_per_generation": (_M + "update.minibatches_per_rollout", ""),
    "reward_funcs": (_M + "rewards.functions", "import paths; TRL's functions run unchanged"),
    "reward_weights": (_M + "rewards.weights", ""),
    "use_vllm": (_M + "engine", "vllm (or auto)"),
    "vllm_importance_sampling_correction": (_M + "correction.mode", "tis"),
    "vllm_importance_sampling_cap": (_M + "correction.cap", ""),
    "max_grad_norm": (_M + "update.grad_clip", ""),
    "weight_decay": (_M + "update.weight_decay", ""),
    "warmup_steps": (_M + "update.warmup_steps", ""),
    "warmup_ratio": (_M + "update.warmup_steps", "in optimiser steps, not a ratio"),
    "lr_scheduler_type": (_M + "update.lr_decay", "none, linear or cosine"),
    "use_peft": (_M + "lora.rank", "a rank > 0 trains a LoRA adapter"),
    "lora_r": (_M + "lora.rank", ""),
    "lora_alpha": (_M + "lora.alpha", ""),
    "lora_target_modules": (_M + "lora.target_modules", ""),
    "dataset_name": (_D + "source", "a Hub id, a file or a built-in task"),
    "per_device_eval_batch_size": (_D + "val_prompts_per_batch", ""),
    "max_steps": ("trainer.max_steps", "optimiser steps"),
    "num_train_epochs": ("trainer.max_steps", "the prompts are a stream: count optimiser steps"),
    "output_dir": ("trainer.default_root_dir", ""),
    "logging_steps": ("trainer.log_every_n_steps", "1 by default here"),
    "eval_steps": ("trainer.val_check_interval", ""),
    "bf16": ("trainer.precision", "bf16-mixed"),
    "seed": ("seed_everything", ""),
}  # fmt: skip


def moved_message(key: str, under_model: bool = True) -> str | None:
    """The one-line fix for a pre-group key (``under_model``: it was given under
    ``model.init_args``) or a TRL name (:data:`TRL_NAMES`), or None for any other key."""
    new = MOVED.get(key) if under_model else None
    if new is not None:
        return (
            f"`model.init_args.{key}` moved: write `model.init_args.{new}` "
            f"(YAML: `{new.split('.')[0]}: {{{new.split('.')[1]}: ...}}` under init_args)."
        )
    if key in TRL_NAMES:
        here, note = TRL_NAMES[key]
        return f"`{key}` is TRL's name: here it is `{here}`" + (f" ({note})." if note else ".")
    return None
