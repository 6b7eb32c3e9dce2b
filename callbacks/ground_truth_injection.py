"""``GroundTruthInjection``: the dataset's reference solution joins the rollout group (ViSurf).

ViSurf (arXiv 2510.10606, spec §3) injects the ground-truth response into the RLVR group so one
update gets external supervision and internal reinforcement; its three "reward control
strategies" are not public. The three strategies here are this project's reconstruction, each
switchable:

(a) **template alignment**: the reference is rendered in the output format the rewards expect
    (its final answer in ``\\boxed{}``), so format rewards do not punish it;
(b) **gating**: inject only into groups whose on-policy pass rate is at most ``max_pass_rate``
    (default 0: every sample wrong), so solved prompts are not pulled toward imitation;
(c) **reward capping**: the reference stays out of its group's mean/std, and its advantage is
    capped (default: the largest advantage an on-policy member of the group could have).

The reference takes the last slot of its group (``composition: append``, see
``offpolicy.guidance_slots``), so a group keeps ``G`` rows: set ``sampling.group_size`` to
``G + 1`` for ViSurf's "``G`` samples plus the label". Gating reads the prompt's sampled outcome
(``outcomes.py``), which the injection never changes.
Its tokens are weighted by the module's ``offpolicy_weighting`` (``on_policy`` makes it an
advantage-weighted SFT term, ``shaping`` LUFFY's policy shaping).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import lightning.pytorch as pl
import torch
from rlvr_lightning.callbacks._guidance import (
    GuidanceCallback,
    check_columns,
    check_curriculum_judge,
    reference_text,
)
from typing_extensions import override

from rlvr_lightning.algorithms import advantages as adv_lib
from rlvr_lightning.algorithms.offpolicy import Composition, guidance_slots
from rlvr_lightning.algorithms.outcomes import pass_rates
from rlvr_lightning.data.stream import rng_state, set_rng_state
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.stages.offpolicy import Member, inject
from rlvr_lightning.types import PromptBatch, Scored

SOURCE = "reference"


class GroundTruthInjection(GuidanceCallback):
    """Inject the reference solution into groups, with ViSurf-style reward control.

    Args:
        solution_column: prompt column holding a worked reference solution; prompts without it
            fall back to ``answer_column``.
        answer_column: prompt column holding the final answer.
        template_alignment: strategy (a): append ``answer_template`` to a reference that has no
            ``\\boxed{}`` answer.
        answer_template: format string of the final answer, with ``{answer}``.
        max_pass_rate: strategy (b): inject only into groups whose on-policy pass rate is
            ``<= max_pass_rate`` (0: all samples wrong); None injects into every group.
        reward_capping: strategy (c): the reference is left out of its group's baseline and
            its advantage is at most ``advantage_cap``.
        advantage_cap: the cap; None = the largest advantage an on-policy member could have,
            ``advantages.max_member_advantage`` for the group's on-policy count and the gap
            between the reference's reward and the group's lowest.
        composition: which sample the reference displaces (``offpolicy.guidance_slots``):
            ``append`` (the last one, default), ``replace_random`` (a random incorrect one) or
            ``replace_last`` (the last incorrect one).
        seed: seed of ``replace_random``.
    """

    def __init__(
        self,
        solution_column: str = "solution",
        answer_column: str = "answer",
        template_alignment: bool = True,
        answer_template: str = "The answer is \\boxed{{{answer}}}.",
        max_pass_rate: float | None = 0.0,
        reward_capping: bool = True,
        advantage_cap: float | None = None,
        composition: Composition = "append",
        seed: int = 0,
    ) -> None:
        if max_pass_rate is not None and not 0.0 <= max_pass_rate <= 1.0:
            raise ValueError(f"max_pass_rate must be in [0, 1] or None, got {max_pass_rate}.")
        if "{answer}" not in answer_template:
            raise ValueError(f"answer_template must contain {{answer}}, got {answer_template!r}.")
        self.solution_column, self.answer_column = solution_column, answer_column
        self.template_alignment, self.answer_template = template_alignment, answer_template
        self.max_pass_rate, self.reward_capping = max_pass_rate, reward_capping
        self.advantage_cap, self.composition = advantage_cap, composition
        self.rng = random.Random(seed)
        self.injected_total = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        g = self.check_module(pl_module).sampling.group_size
        if self.reward_capping and g < 3:
            raise ValueError(
                f"GroundTruthInjection with reward_capping needs sampling.group_size >= 3 (the "
                f"reference takes one slot, the baseline needs two samples); got {g}. Raise "
                "model.sampling.group_size or set reward_capping: false."
            )
        if self.reward_capping and pl_module.estimator not in ("grpo", "dr_grpo"):
            raise ValueError(
                f"reward_capping needs estimator grpo or dr_grpo, not {pl_module.estimator!r}; "
                "set model.estimator or reward_capping: false."
            )
        check_columns(trainer, [self.solution_column, self.answer_column], "GroundTruthInjection")
        if self.max_pass_rate == 0.0:
            check_curriculum_judge(trainer, "GroundTruthInjection (max_pass_rate: 0)")

    @override
    def on_after_score(self, trainer: pl.Trainer, module: RLVRModule, scored: Scored) -> Scored:
        groups = self.groups(module, scored)
        batch, g = groups.batch, groups.size
        pass_rate = pass_rates(groups.sampled, g)  # [B]
        members = []
        for b in range(len(batch)):
            if self.max_pass_rate is not None and float(pass_rate[b]) > self.max_pass_rate + 1e-9:
                continue
            text = reference_text(
                self._column(batch, self.solution_column, b),
                self._column(batch, self.answer_column, b),
                self.template_alignment,
                self.answer_template,
            )
            slots = guidance_slots(
                groups.correct[b].tolist(),
                groups.on_policy[b].tolist(),
                1,
                self.composition,
                self.rng,
            )
            if text is not None and slots:
                members.append(Member(row=b * g + slots[0], source=SOURCE, text=text))
        scored = inject(module, batch, scored, members)
        self.injected_total += len(members)
        scored.metrics["gt_injection/injected_groups"] = float(len(members))
        if self.reward_capping and members:
            scored = self._control(scored, [m.row for m in members], module.estimator == "grpo")
        return scored

    @staticmethod
    def _column(batch: PromptBatch, name: str, b: int) -> Any:
        values = batch.columns.get(name)
        return None if values is None else values[b]

    def _control(self, scored: Scored, rows: list[int], normalize_std: bool) -> Scored:
        """Strategy (c): leave ``rows`` out of the baseline and cap their advantage."""
        g, n = scored.rollouts.group_size, scored.rollouts.num_rows
        device = scored.rewards.device
        base = (
            torch.ones(n, dtype=torch.bool, device=device)
            if scored.baseline_mask is None
            else scored.baseline_mask.clone()
        )  # [N]
        base[rows] = False
        cap = (
            torch.full((n,), float("inf"), device=device)
            if scored.advantage_cap is None
            else scored.advantage_cap.clone()
        )  # [N]
        rewards = scored.rewards.float().view(-1, g)  # [B, G]
        in_base = base.view(-1, g)  # [B, G]
        for row in rows:
            b = row // g
            if self.advantage_cap is not None:
                cap[row] = self.advantage_cap
                continue
            lowest = rewards[b][in_base[b]].min()
            gap = (rewards[b, row % g] - lowest).reshape(1)
            members = max(int(in_base[b].sum()), 2)  # on-policy members of the baseline
            cap[row] = adv_lib.max_member_advantage(members, gap, normalize_std=normalize_std)[0]
        return dataclasses.replace(scored, baseline_mask=base, advantage_cap=cap)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"injected_total": self.injected_total, "rng": rng_state(self.rng)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.injected_total = int(state_dict["injected_total"])
        if "rng" in state_dict:
            set_rng_state(self.rng, state_dict["rng"])
