"""Batch types passed between the stages of a training step.

Dimension glossary (used in every shape comment of the package):

- ``B``: prompts in a step.
- ``G``: completions per prompt (the group size); groups are consecutive rows.
- ``N``: rows of a rollout batch, ``N = B * G``.
- ``P``: prompt tokens (left-padded).
- ``T``: completion tokens (right-padded).

Each stage reads the previous one and adds fields; nothing reaches back::

    PromptBatch [B] -> Rollouts [N, T] -> Scored [N] -> advantages [N] or [N, T] -> StepOutput
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SOURCE_POLICY = "policy"
"""Source tag of completions sampled from the current policy."""


@dataclass
class PromptBatch:
    """Prompts for one step, as the data module yields them.

    Args:
        prompt_ids: ``[B]`` stable ids; the same example keeps its id across runs and resumes.
        messages: ``[B]`` chat messages (``{"role", "content"}`` dicts) ending with the user turn;
            the module applies the tokenizer's chat template.
        columns: extra per-prompt columns (``answer``, ``solution``, task metadata, ...), each a
            list of length ``B``; reward functions receive them repeated ``G`` times.
        temperatures: ``[B]`` sampling temperature per prompt (``None`` entries, or no list:
            the module's ``sampling.temperature``); set by callbacks such as
            ``AdaptiveTemperature`` in ``on_before_generate``.
        position_temperatures: ``[T_max]`` factor on every row's temperature at completion
            position ``t`` (counted from 0), one per position up to ``max_new_tokens``; None =
            constant along the completion. Set by ``AnnealedTemperature`` (EAD).

    Not frozen only because Lightning's precision plugins rebuild dataclass batches field by
    field; treat it as immutable and make a new one to change it.
    """

    prompt_ids: list[str]
    messages: list[list[dict[str, str]]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    temperatures: list[float | None] | None = None
    position_temperatures: torch.Tensor | None = None  # [T_max]

    def __post_init__(self) -> None:
        n = len(self.prompt_ids)
        if self.temperatures is not None and len(self.temperatures) != n:
            raise ValueError(
                f"PromptBatch.temperatures must have length {n}, got {len(self.temperatures)}."
            )
        if len(self.messages) != n or any(len(v) != n for v in self.columns.values()):
            lengths = {k: len(v) for k, v in self.columns.items()}
            raise ValueError(
                f"PromptBatch fields must all have length {n} (prompt_ids); got "
                f"messages={len(self.messages)}, columns={lengths}."
            )

    def __len__(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Sampling:
    """How to sample completions.

    Args:
        max_new_tokens: completion budget ``T_max``.
        temperature: sampling temperature; ``0`` means greedy.
        top_p: nucleus threshold (``1.0`` disables it).
        top_k: keep the ``k`` most likely tokens (``0`` disables it).
        group_size: completions per prompt ``G``.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    group_size: int = 1

    def __post_init__(self) -> None:
        # Checked when the config is read, before any model loads.
        problems = [
            f"{name} is {value!r}; {need}"
            for name, value, bad, need in (
                ("max_new_tokens", self.max_new_tokens, self.max_new_tokens < 1, "use >= 1"),
                ("group_size", self.group_size, self.group_size < 1, "use >= 1"),
                ("temperature", self.temperature, self.temperature < 0, "use >= 0 (0: greedy)"),
                ("top_p", self.top_p, not 0 < self.top_p <= 1, "use 0 < top_p <= 1"),
                ("top_k", self.top_k, self.top_k < 0, "use >= 0 (0: off)"),
            )
            if bad
        ]
        if problems:
            raise ValueError("Sampling: " + "; ".join(problems) + ".")


@dataclass(frozen=True)
class Rollouts:
    """Completions of a prompt batch, ``G`` consecutive rows per prompt.

    ``behaviour_logp`` holds the log-probabilities of the sampled tokens under the exact
    distribution they were drawn from (after temperature, top-k and top-p), so importance
    ratios need no extra forward pass. Rows from other sources (injected solutions, a teacher)
    carry their own tag in ``sources``.
    """

    prompt_ids: torch.Tensor  # [N, P] left-padded prompt tokens
    prompt_mask: torch.Tensor  # [N, P] 1 on real prompt tokens
    completion_ids: torch.Tensor  # [N, T] right-padded completion tokens
    completion_mask: torch.Tensor  # [N, T] 1 on completion tokens up to and including EOS
    behaviour_logp: torch.Tensor  # [N, T] log-prob of each sampled token (0 on padding)
    temperature: torch.Tensor  # [N] sampling temperature of each row (1.0 for greedy rows)
    truncated: torch.Tensor  # [N] bool, True when the row hit max_new_tokens without EOS
    completions: list[str]  # [N] decoded completion text (special tokens removed)
    group_size: int
    sources: tuple[str, ...] = ()  # [N] source tag per row; empty means all SOURCE_POLICY
    # [N, T] 1 on tokens that were not sampled from the policy (injected members, see
    # ``offpolicy.py``); their ``behaviour_logp`` is the stored behaviour log-prob, or 0
    # (probability 1) when the behaviour policy is unknown. None means all on-policy.
    offpolicy_mask: torch.Tensor | None = None
    # [N, T] ``π_old`` recomputed by the trainer when the engine's numerics may differ from the
    # trainer's (``correction.py``); ``behaviour_logp`` then only weights the loss (TIS). None
    # means ``behaviour_logp`` is ``π_old``.
    old_logp: torch.Tensor | None = None
    # [N, T] temperature each token was drawn at, where it varies along the row (a position
    # schedule, EAD); None means every token of a row was drawn at its ``temperature``.
    position_temperature: torch.Tensor | None = None
    # [N, T] values ``V_old`` of a value head at rollout time (the no-grad forward before the
    # update, ``heads/value.py``); None without a value head.
    old_values: torch.Tensor | None = None
    # [N, F] inputs of a probe head (``heads/probe_head.py``: layer means and mean token
    # entropy) from that same forward; None without a probe head.
    probe_features: torch.Tensor | None = None
    # [N, T] 1 on tokens an environment wrote into a multi-turn trajectory (tool results,
    # feedback, the chat template's turn markers between model turns): they are context the
    # model attends to but never trained on (``loss_mask``); their ``behaviour_logp`` is 0.
    # None: single-turn rows, every completion token is the model's.
    env_mask: torch.Tensor | None = None
    # [N] the turns after the prompt of a multi-turn trajectory, as messages (assistant turns,
    # tool results, feedback); reward functions get them as TRL's ``completions``. None:
    # single-turn rows.
    conversations: tuple[tuple[dict, ...], ...] | None = None
    # name -> [N] per-trajectory counts of a multi-turn rollout (``turns``, ``tool_calls``,
    # ``tool_errors``, ``env_reward``: the environment's ``get_reward()``, NaN without one).
    turn_stats: dict[str, torch.Tensor] | None = None

    @property
    def loss_mask(self) -> torch.Tensor:  # [N, T]
        """1 on the tokens the model sampled (``completion_mask`` less ``env_mask``): the
        tokens every loss, KL, π_old, TIS weight and advantage is taken over."""
        if self.env_mask is None:
            return self.completion_mask
        return self.completion_mask * (1 - self.env_mask.to(self.completion_mask.dtype))

    @property
    def num_rows(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def lengths(self) -> torch.Tensor:  # [N]
        return self.completion_mask.sum(-1)

    @property
    def token_temperature(self) -> torch.Tensor:  # [N, T]
        """The temperature each token was drawn at (padding included)."""
        if self.position_temperature is not None:
            return self.position_temperature
        return self.temperature[:, None].expand(self.completion_ids.shape).to(torch.float32)


@dataclass(frozen=True)
class Scored:
    """Rewards of a rollout batch.

    Args:
        rewards: ``[N]`` weighted total reward.
        per_function: name -> ``[N]`` raw reward of each function (NaN where not applicable).
        correct: ``[N]`` bool, whether the accuracy reward counts the row as solved.
        metrics: scalar metrics of scoring (failures, timeouts, ...).
        sampled_correct: ``[N]`` bool, ``correct`` as the policy sampled it: set by
            ``RLVRModule.score`` and carried unchanged through the ``on_after_score`` hooks
            (``dataclasses.replace`` keeps it), so a prompt's outcome never counts a row a hook
            replaced or added. None: the rows are their own snapshot (see ``outcomes.py``).
        sampled_rewards: ``[N]`` ``rewards`` as sampled, the same way.
    """

    rollouts: Rollouts
    rewards: torch.Tensor  # [N]
    per_function: dict[str, torch.Tensor]  # name -> [N]
    correct: torch.Tensor  # [N] bool
    metrics: dict[str, float] = field(default_factory=dict)
    # [N] bool, rows whose rewards form their group's baseline (mean/std); None = the module's
    # ``offpolicy_baseline`` option decides. Set by reward-control callbacks.
    baseline_mask: torch.Tensor | None = None
    advantage_cap: torch.Tensor | None = None  # [N] upper bound on each row's advantage
    sampled_correct: torch.Tensor | None = None  # [N] bool, before any hook
    sampled_rewards: torch.Tensor | None = None  # [N], before any hook
    # [B] bool, groups the update uses (``select_groups``), set by ``training_step`` before the
    # advantages; None = all. GAE whitens over their tokens only.
    trained_groups: torch.Tensor | None = None


@dataclass(frozen=True)
class StepOutput:
    """What one training step leaves behind for the data module and callbacks.

    ``rewards``, ``correct``, ``pass_rate`` and ``group_variance`` describe the ``G`` rows the
    policy sampled for each prompt, as scored before any ``on_after_score`` hook: injected
    (off-policy) members never count. Read it through ``RLVRModule.last_step`` or the
    ``on_step_output`` hook of the data module.

    The per-row fields after ``trained`` (``completions`` to ``advantages``, ``N = B * G``)
    describe the rows *as trained*: an injected member stands in its slot with its own text,
    rewards and advantage, while ``rewards``/``correct`` keep the sampled outcome of that slot.
    They are for inspection (``callbacks.CompletionsTable``); empty when a step built none.
    """

    step: int  # rollout step index, counted from 0
    prompt_ids: list[str]  # [B]
    group_size: int
    rewards: torch.Tensor  # [B, G]
    correct: torch.Tensor  # [B, G] bool
    lengths: torch.Tensor  # [B, G] completion tokens
    pass_rate: torch.Tensor  # [B] fraction of correct rows per group (k / G)
    group_variance: torch.Tensor  # [B] unbiased variance of rewards within each group
    metrics: dict[str, float] = field(default_factory=dict)
    trained: torch.Tensor | None = None  # [B] bool, groups the update used (None: all)
    prompts: list[str] = field(default_factory=list)  # [B] text of each prompt's last turn
    completions: list[str] = field(default_factory=list)  # [N] as trained, injected included
    sources: tuple[str, ...] = ()  # [N] source tag per row (SOURCE_POLICY or the injector's)
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N], NaN: n/a
    row_rewards: torch.Tensor | None = None  # [N] total reward as trained
    row_correct: torch.Tensor | None = None  # [N] bool, correct as trained
    advantages: torch.Tensor | None = None  # [N] per row (token-level: mean over its tokens)
