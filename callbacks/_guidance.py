"""What the guidance callbacks share: the base that remembers each rollout's prompts, a scored
step seen group by group, pooled prompts, and the reference text of a prompt.

``GroundTruthInjection``, ``MixedPolicyGuidance`` and ``NearFuturePolicyGuidance`` each put
off-policy members into the step's groups (``offpolicy.inject``); this module is not a callback
of its own and is not exported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from rlvr_lightning.algorithms.offpolicy import on_policy_rows
from rlvr_lightning.algorithms.outcomes import sampled_rows
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.rewards.math import extract_boxed
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.stages.offpolicy import prompt_rows, scored_batch
from rlvr_lightning.types import PromptBatch, Scored

PooledPrompt = dict[str, Any]
"""A prompt kept across steps as plain data: ``{"messages": [...], "columns": {name: value}}``."""


@dataclass(frozen=True)
class Groups:
    """A scored step group by group, on the CPU.

    Args:
        batch: the prompts of the step's ``B`` groups.
        size: ``G``, rows per group.
        correct: ``[B, G]`` bool, each row's verified outcome as it will train.
        on_policy: ``[B, G]`` bool, rows the policy sampled and nothing replaced.
        sampled: ``[B, G]`` bool, the outcome as the policy sampled it (what gating reads;
            no injection changes it).
    """

    batch: PromptBatch
    size: int
    correct: torch.Tensor
    on_policy: torch.Tensor
    sampled: torch.Tensor


class GuidanceCallback(RLVRCallback):
    """Base of the callbacks that inject members: keeps the batch each rollout starts from, so
    ``on_after_score`` can find the prompts of the scored rows (``offpolicy.scored_batch``)."""

    _batch: PromptBatch | None = None

    @override
    def on_before_rollout(
        self, trainer: pl.Trainer, module: RLVRModule, batch: PromptBatch
    ) -> PromptBatch | None:
        self._batch = batch
        return None

    def check_module(self, pl_module: pl.LightningModule) -> RLVRModule:
        """``pl_module``, raising when it is not an ``RLVRModule``."""
        if not isinstance(pl_module, RLVRModule):
            raise TypeError(f"{type(self).__name__} works with RLVRModule (or a subclass).")
        return pl_module

    def groups(self, module: RLVRModule, scored: Scored) -> Groups:
        """``scored`` group by group, with the prompts it was sampled from."""
        g = scored.rollouts.group_size
        return Groups(
            batch=scored_batch(module, self._batch, scored),
            size=g,
            correct=scored.correct.view(-1, g).cpu(),  # [B, G]
            on_policy=on_policy_rows(scored.rollouts).view(-1, g).cpu(),  # [B, G]
            sampled=sampled_rows(scored)[0].view(-1, g).cpu(),  # [B, G]
        )


def pooled_prompt(batch: PromptBatch, b: int) -> PooledPrompt:
    """Prompt ``b`` of ``batch`` as plain data, to keep in a pool across steps."""
    prompt = prompt_rows(batch, [b])
    return {
        "messages": prompt.messages[0],
        "columns": {k: v[0] for k, v in prompt.columns.items()},
    }


def pooled_batch(prompt_ids: Sequence[str], prompts: Sequence[PooledPrompt]) -> PromptBatch:
    """A batch of pooled prompts; a column some of them lack is ``None`` there."""
    names = dict.fromkeys(k for p in prompts for k in p["columns"])
    return PromptBatch(
        prompt_ids=list(prompt_ids),
        messages=[p["messages"] for p in prompts],
        columns={k: [p["columns"].get(k) for p in prompts] for k in names},
    )


def join_batches(head: PromptBatch, tail: PromptBatch) -> PromptBatch:
    """``head``'s prompts then ``tail``'s, with every column of either (``None`` where one
    lacks it); per-prompt temperatures are not carried."""
    names = dict.fromkeys([*head.columns, *tail.columns])
    columns = {
        k: [*head.columns.get(k, [None] * len(head)), *tail.columns.get(k, [None] * len(tail))]
        for k in names
    }
    return PromptBatch(
        prompt_ids=[*head.prompt_ids, *tail.prompt_ids],
        messages=[*head.messages, *tail.messages],
        columns=columns,
    )


def align_reference(solution: str | None, answer: Any, answer_template: str) -> str | None:
    r"""The reference in the rewards' format: a solution that has no ``\boxed{}`` gets the
    rendered ``answer_template`` appended; without a solution, the template alone.

    >>> align_reference("2 + 3 = 5.", 5, r"The answer is \boxed{{{answer}}}.")
    '2 + 3 = 5.\n\nThe answer is \\boxed{5}.'
    >>> align_reference(r"So \boxed{5}.", 5, r"\boxed{{{answer}}}")
    'So \\boxed{5}.'
    """
    solution = (solution or "").strip()
    if solution and extract_boxed(solution) is not None:
        return solution
    if answer is None:
        return solution or None
    rendered = answer_template.format(answer=str(answer).strip())
    return f"{solution}\n\n{rendered}" if solution else rendered


def reference_text(
    solution: str | None, answer: Any, template_alignment: bool, answer_template: str
) -> str | None:
    """The text to inject: aligned (strategy a) or the raw solution, falling back to the answer."""
    if template_alignment:
        return align_reference(solution, answer, answer_template)
    if solution:
        return solution
    return None if answer is None else str(answer)


def check_columns(trainer: pl.Trainer, names: list[str], who: str) -> None:
    """Raise when the data module's training examples have none of the columns ``names``."""
    examples = getattr(getattr(trainer, "datamodule", None), "train_examples", None)
    if not examples:
        return
    columns = set(examples[0].columns)
    if not columns & set(names):
        raise ValueError(
            f"{who} needs a training column among {names}, but the data has {sorted(columns)}. "
            "Map one with data.columns (e.g. {prompt: question, answer: answer, solution: "
            "solution}) or set the callback's column arguments."
        )


def check_curriculum_judge(trainer: pl.Trainer, who: str) -> None:
    """Raise when the data module's curriculum would mask every group ``who`` injects into:
    it judges the sampled rows (``judge: sampled``) while ``who`` injects only into groups
    whose samples all failed, which score 0 there and never reach κ > 0."""
    curriculum = getattr(getattr(trainer, "datamodule", None), "curriculum", None)
    if curriculum is None or getattr(curriculum, "judge", "trained") != "sampled":
        return
    if max(curriculum.kappa_start, curriculum.kappa_end) <= 0:
        return
    raise ValueError(
        f"{who} injects only into groups whose samples all failed, but data.curriculum "
        "(VarianceCurriculum) has judge: sampled, so its κ mask scores those groups 0 and "
        "drops every one it rescues: the injection would never train. Set "
        "data.curriculum.init_args.judge: trained (the group as trained, the default), or "
        "inject into more groups (GroundTruthInjection max_pass_rate > 0 or null; "
        "MixedPolicyGuidance injection: always)."
    )
