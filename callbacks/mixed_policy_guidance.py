"""``MixedPolicyGuidance``: off-policy trajectories replace samples in the group (spec §4).

One callback for three published recipes, which differ in where the guidance comes from and
when it is injected:

- LUFFY (arXiv 2504.14945): ``source: reference`` (the dataset's solution), ``injection:
  always``, ``num_replaced: 1``, module ``offpolicy_weighting: shaping`` (``f(pi)=pi/(pi+0.1)``).
- AMPO (arXiv 2510.02227): ``source: teacher`` (a column holding one or several teacher
  responses per prompt), ``injection: on_all_fail``, ``num_replaced: 2``, ``teacher_selection:
  comprehension`` (the teacher reasoning under which the policy most expects the ground-truth
  answer), ``reward: 1.0`` (a floor on the accuracy reward: the teacher counts as correct).
- ExGRPO (arXiv 2510.02245): ``source: experience`` (the run's own correct trajectories with
  their behaviour log-probs, :class:`~rlvr_lightning.guidance.experience
  .ExperiencePool`), ``injection:
  delayed`` (off until the batch solve rate exceeds ``start_solve_rate``), a share
  ``experience_ratio`` of each batch's prompts replaced by pooled questions drawn by bucket,
  the lowest-entropy stored trajectory of each, module ``offpolicy_weighting: shaping``.

Group composition follows the papers (``composition: auto``): LUFFY and ExGRPO train on
``G - k`` samples plus ``k`` appended members (``append``), AMPO replaces random incorrect
samples (``replace_random``, seeded); ``offpolicy.guidance_slots`` has the rules. Every group
keeps ``G`` rows, and gating (``on_all_fail``, ``delayed``) and the experience pool read the
prompt's sampled outcome (``outcomes.py``), which no injection changes.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from rlvr_lightning.callbacks._guidance import (
    GuidanceCallback,
    check_columns,
    check_curriculum_judge,
    join_batches,
    pooled_batch,
    pooled_prompt,
    reference_text,
)
from rlvr_lightning.callbacks._policy_scores import comprehension, lowest_entropy
from typing_extensions import override

from rlvr_lightning.algorithms.correction import needs_trainer_logprobs
from rlvr_lightning.algorithms.offpolicy import Composition, guidance_slots
from rlvr_lightning.data.stream import rng_state, set_rng_state
from rlvr_lightning.guidance.experience import ExperiencePool, Trajectory
from rlvr_lightning.guidance.teacher import TeacherModel
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.stages.offpolicy import Member, inject, prompt_rows, select_rows
from rlvr_lightning.stages.old_logprobs import with_trainer_logprobs
from rlvr_lightning.types import PromptBatch, Rollouts, Scored, StepOutput

Source = Literal["reference", "teacher", "experience"]
Injection = Literal["always", "on_all_fail", "delayed"]


class MixedPolicyGuidance(GuidanceCallback):
    """Replace samples with off-policy guidance: a reference, teacher responses or experience.

    Args:
        source: ``reference`` (``solution_column``, else ``answer_column``), ``teacher``
            (``teacher_column``: a response or a list of responses per prompt) or
            ``experience`` (the run's own stored correct trajectories).
        injection: ``always``; ``on_all_fail`` (only groups whose samples are all wrong); or
            ``delayed`` (nothing until the fraction of correct samples in a batch exceeds
            ``start_solve_rate``, then always, for the rest of the run).
        num_replaced: samples per group replaced by guidance (LUFFY 1, AMPO 2).
        start_solve_rate: batch solve rate that switches ``delayed`` on (ExGRPO 0.35).
        solution_column: column of reference solutions (``source: reference``).
        answer_column: column of final answers (fallback reference; comprehension scoring).
        template_alignment: render references with a ``\\boxed{}`` answer (as
            ``GroundTruthInjection``).
        teacher_column: column of teacher responses (``source: teacher``).
        teacher_model: a second model (local folder, Hub id, ``tiny:<seed>``) that writes the
            teacher responses through the HF engine at the module's sampling settings, instead
            of ``teacher_column``; loaded in ``setup``, frozen, never checkpointed.
        teacher_candidates: teacher-model responses per guided group (None: ``num_replaced``);
            more than ``num_replaced`` lets ``comprehension`` choose.
        teacher_selection: with several teacher responses, ``order`` takes the first ones,
            ``comprehension`` the ones under which the policy gives the ground-truth answer the
            highest mean token probability (AMPO's ``mean_exp_log_softmax``).
        reward: floor on injected members' accuracy reward (AMPO: 1.0), on that reward's
            scale: ``max(verifier's value, reward)``; the total reward moves by the accuracy
            weight times the change and the member's ``correct`` flag follows, so a teacher
            the verifier scored higher keeps its score and one it rejected still rescues its
            group under ``informative: accuracy`` (``offpolicy.floor_accuracy``). None = the
            verifier's.
        experience_ratio: share of each batch's prompts replaced by pooled questions.
        pool_questions: questions the experience pool keeps.
        pool_trajectories: trajectories kept per pooled question.
        bucket_sigma: width (in correct counts) of the bucket weights around ``G/2``.
        composition: which samples the members displace (``offpolicy.guidance_slots``):
            ``auto`` (``replace_random`` for ``source: teacher`` as AMPO, else ``append`` as
            LUFFY and ExGRPO), ``append``, ``replace_random`` or ``replace_last``.
        seed: seed of experience sampling and of ``replace_random``.
        retire_solved: ``source: experience``: a question whose ``G`` samples all solved it
            leaves the pool and joins the data module's skip set (``retire_prompts``), so
            it is never served again, fresh, replayed or banked (ExGRPO's ``skip_uid_set``).
    """

    def __init__(
        self,
        source: Source = "reference",
        injection: Injection = "always",
        num_replaced: int = 1,
        start_solve_rate: float = 0.35,
        solution_column: str = "solution",
        answer_column: str = "answer",
        template_alignment: bool = True,
        teacher_column: str = "teacher_responses",
        teacher_selection: Literal["order", "comprehension"] = "order",
        teacher_model: str | None = None,
        teacher_candidates: int | None = None,
        reward: float | None = None,
        experience_ratio: float = 0.5,
        pool_questions: int = 512,
        pool_trajectories: int = 4,
        bucket_sigma: float = 1.0,
        composition: Literal["auto"] | Composition = "auto",
        seed: int = 0,
        retire_solved: bool = True,
    ) -> None:
        if num_replaced < 1:
            raise ValueError(f"num_replaced must be >= 1, got {num_replaced}.")
        if not 0.0 < experience_ratio <= 1.0:
            raise ValueError(f"experience_ratio must be in (0, 1], got {experience_ratio}.")
        self.source, self.injection, self.num_replaced = source, injection, num_replaced
        self.start_solve_rate = start_solve_rate
        self.solution_column, self.answer_column = solution_column, answer_column
        self.template_alignment = template_alignment
        self.teacher_column, self.teacher_selection = teacher_column, teacher_selection
        self.teacher_model, self.teacher_candidates = teacher_model, teacher_candidates
        self.teacher: TeacherModel | None = None
        self.reward, self.experience_ratio, self.seed = reward, experience_ratio, seed
        self.retire_solved = retire_solved
        auto = "replace_random" if source == "teacher" else "append"
        self.composition: Composition = auto if composition == "auto" else composition
        self.slot_rng = random.Random(seed)
        self.pool_args = (pool_questions, pool_trajectories, bucket_sigma)
        self.pool: ExperiencePool | None = None
        self.active = injection != "delayed"
        self.steps = 0
        self._replayed: list[int] = []  # batch rows holding pooled questions this step

    # ---- setup and state -------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        g = self.check_module(pl_module).sampling.group_size
        if g - self.num_replaced < 2:
            raise ValueError(
                f"MixedPolicyGuidance replaces {self.num_replaced} of G={g} samples, leaving "
                f"fewer than 2 on-policy ones; raise model.sampling.group_size to at least "
                f"{self.num_replaced + 2} or lower num_replaced."
            )
        if self.injection == "on_all_fail":
            check_curriculum_judge(trainer, "MixedPolicyGuidance (injection: on_all_fail)")
        if self.source == "reference":
            check_columns(trainer, [self.solution_column, self.answer_column], "source reference")
        elif self.source == "teacher":
            if self.teacher_model is None:
                check_columns(trainer, [self.teacher_column], "source teacher")
            elif self.teacher is None:
                self.teacher = TeacherModel(self.teacher_model, pl_module.hparams.dtype)
            if self.teacher_selection == "comprehension":
                check_columns(trainer, [self.answer_column], "teacher_selection comprehension")
        if self.pool is None and self.source == "experience":
            self.pool = ExperiencePool(*self.pool_args[:2], group_size=g, sigma=self.pool_args[2])

    @override
    def state_dict(self) -> dict[str, Any]:
        pool = None if self.pool is None else self.pool.state_dict()
        return {
            "active": self.active,
            "steps": self.steps,
            "pool": pool,
            "slot_rng": rng_state(self.slot_rng),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.active, self.steps = bool(state_dict["active"]), int(state_dict["steps"])
        if "slot_rng" in state_dict:
            set_rng_state(self.slot_rng, state_dict["slot_rng"])
        if state_dict["pool"] is not None:
            if self.pool is None:
                g = int(state_dict["pool"]["group_size"])
                self.pool = ExperiencePool(
                    *self.pool_args[:2], group_size=g, sigma=self.pool_args[2]
                )
            self.pool.load_state_dict(state_dict["pool"])

    # ---- hooks -----------------------------------------------------------------------------

    @override
    def on_before_rollout(
        self, trainer: pl.Trainer, module: RLVRModule, batch: PromptBatch
    ) -> PromptBatch | None:
        self._replayed = []
        if self.source == "experience" and self.active and self.pool is not None:
            batch = self._mix_in_experience(batch)
        self._batch = batch
        self.steps += 1
        return batch

    def _mix_in_experience(self, batch: PromptBatch) -> PromptBatch:
        """Replace the last ``experience_ratio`` share of the prompts by pooled questions."""
        assert self.pool is not None
        want = min(len(self.pool), int(len(batch) * self.experience_ratio))
        rng = random.Random(self.seed * 1_000_003 + self.steps)
        picked = self.pool.sample(want, rng, exclude=batch.prompt_ids)
        if not picked:
            return batch
        keep = len(batch) - len(picked)
        self._replayed = list(range(keep, len(batch)))
        prompts = [self.pool.prompt(pid) for pid in picked]
        return join_batches(prompt_rows(batch, range(keep)), pooled_batch(picked, prompts))

    @override
    def on_after_score(self, trainer: pl.Trainer, module: RLVRModule, scored: Scored) -> Scored:
        groups = self.groups(module, scored)
        batch, g, correct, on = groups.batch, groups.size, groups.correct, groups.on_policy
        sampled = groups.sampled  # [B, G] the policy's outcome
        solved = sampled.sum(1)  # [B]
        rollouts = scored.rollouts
        solve_rate = float(sampled.float().mean())
        if self.injection == "delayed" and solve_rate > self.start_solve_rate:
            self.active = True
        members: list[Member] = []
        # Pooled questions sit in the first round's rows; dynamic sampling's extra rounds
        # (which call this hook again) hold fresh prompts only.
        groups = self._replayed if self.source == "experience" else range(len(batch))
        self._replayed = []
        guided = [
            b
            for b in (groups if self.active else [])
            if not (self.injection == "on_all_fail" and int(solved[b]) > 0)
        ]
        generated = self._generate(module, batch, guided)
        for b in guided:
            slots = guidance_slots(
                correct[b].tolist(), on[b].tolist(), self.num_replaced, self.composition,
                self.slot_rng,
            )  # fmt: skip
            rows = [b * g + s for s in slots]
            members += self._members(module, batch, scored.rollouts, b, rows, generated.get(b))
        scored = inject(module, batch, scored, members)
        if self.pool is not None:  # after choosing: a group never replays its own samples
            self._record(batch, rollouts, correct & on, solved, module)
        scored.metrics.update(
            {
                "guidance/injected": float(len(members)),
                "guidance/active": float(self.active),
                "guidance/batch_solve_rate": solve_rate,
            }
        )
        if self.pool is not None:
            scored.metrics["guidance/pool_questions"] = float(len(self.pool))
        return scored

    @override
    def on_step_output(self, trainer: pl.Trainer, module: RLVRModule, output: StepOutput) -> None:
        """ExGRPO's retirement in the data: the step's questions solved ``K/K`` (all ranks'
        observations, so every rank's data module retires the same) join the skip set."""
        datamodule = getattr(trainer, "datamodule", None)
        if self.pool is None or not self.retire_solved or datamodule is None:
            return
        if hasattr(datamodule, "retire_prompts"):
            solved = [o.prompt_id for o in datamodule.last_observed if o.pass_rate >= 1.0]
            datamodule.retire_prompts(solved)

    # ---- members of one group ----------------------------------------------------------------

    def _generate(
        self, module: RLVRModule, batch: PromptBatch, groups: list[int]
    ) -> dict[int, list[str]]:
        """Teacher-model completions of the guided groups' prompts (none without a model)."""
        if self.teacher is None:
            return {}
        n = self.teacher_candidates or self.num_replaced
        sampling = dataclasses.replace(module.sampling, group_size=n)
        texts = self.teacher.complete([batch.messages[b] for b in groups], sampling, module.device)
        return dict(zip(groups, texts, strict=True))

    def _members(
        self,
        module: RLVRModule,
        batch: PromptBatch,
        rollouts: Rollouts,
        b: int,
        rows: list[int],
        generated: list[str] | None = None,
    ) -> list[Member]:
        if self.source == "experience":
            assert self.pool is not None
            trajs = self.pool.trajectories(batch.prompt_ids[b])
            if not trajs:
                return []
            best = trajs[lowest_entropy(module, rollouts, rows[0], trajs)]
            return [
                Member(
                    row=rows[0],
                    source="experience",
                    token_ids=best.token_ids,
                    behaviour_logp=best.behaviour_logp,
                    temperature=best.temperature,
                    reward=self.reward,
                )
            ]
        texts = self._texts(module, batch, rollouts, b, rows[0], generated)
        return [
            Member(row=row, source=self.source, text=text, reward=self.reward)
            for row, text in zip(rows, texts, strict=False)
        ]

    def _texts(
        self,
        module: RLVRModule,
        batch: PromptBatch,
        rollouts: Rollouts,
        b: int,
        row: int,
        generated: list[str] | None,
    ) -> list[str]:
        answer = batch.columns.get(self.answer_column, [None] * len(batch))[b]
        if self.source == "reference":
            solution = batch.columns.get(self.solution_column, [None] * len(batch))[b]
            text = reference_text(solution, answer, self.template_alignment, "\\boxed{{{answer}}}")
            return [] if text is None else [text]
        responses = (
            generated
            if generated is not None
            else batch.columns.get(self.teacher_column, [None] * len(batch))[b]
        )
        responses = [responses] if isinstance(responses, str) else list(responses or [])
        if self.teacher_selection == "comprehension" and len(responses) > 1 and answer is not None:
            scores = comprehension(module, rollouts, row, responses, str(answer))
            responses = [responses[i] for i in torch.argsort(scores, descending=True).tolist()]
        return responses[: self.num_replaced]

    # ---- experience collection -------------------------------------------------------------

    def _record(
        self, batch: PromptBatch, rollouts: Rollouts, keep: torch.Tensor, solved: torch.Tensor,
        module: RLVRModule,
    ) -> None:  # fmt: skip
        """ExGRPO's collection step: each question goes to the bucket of its sampled correct
        count ``solved`` ``[B]``; the rows ``keep`` ``[B, G]`` (correct samples still in the
        batch) are stored as its trajectories, with ``π_old``'s log-probs as the trainer
        scores them (``_stored_logprobs``)."""
        assert self.pool is not None
        g = rollouts.group_size
        rows = keep.reshape(-1).nonzero().view(-1).tolist()  # kept rows, in order
        logp, temps = _stored_logprobs(module, rollouts, rows)  # [n, T], [n]
        lengths = rollouts.completion_mask.sum(-1).tolist()  # [N]
        stored: dict[int, list[Trajectory]] = {}
        for i, row in enumerate(rows):
            n = int(lengths[row])
            stored.setdefault(row // g, []).append(
                Trajectory(
                    token_ids=rollouts.completion_ids[row, :n].tolist(),
                    behaviour_logp=logp[i, :n].tolist(),
                    temperature=float(temps[i]),
                    text=rollouts.completions[row],
                )
            )
        for b, pid in enumerate(batch.prompt_ids):
            self.pool.record(pid, pooled_prompt(batch, b), int(solved[b]), g, stored.get(b, []))


def _stored_logprobs(
    module: RLVRModule, rollouts: Rollouts, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([n, T] log-probs, [n] temperatures)`` to store for ``rows``: ExGRPO's ``π_θpast``
    is the actor's ``π_old`` at collection time. Where the module would recompute ``π_old``
    with the trainer (``correction.needs_trainer_logprobs``: an EAD schedule, a per-prompt
    temperature, top-p/top-k, an engine with its own weights), the stored log-probs are that
    no-grad trainer pass at the base temperature, which the replayed row is scored at; else
    the sampler's own."""
    sub = select_rows(rollouts, rows)
    s, choice = module.sampling, module.options.correction.old_logprobs
    truncated = s.top_p < 1.0 or s.top_k > 0
    shares = module.engine.shares_policy
    if not rows or not needs_trainer_logprobs(choice, shares, sub, s.temperature, truncated):
        return sub.behaviour_logp, sub.temperature
    mb, cap = module.options.update.micro_batch_size, module.options.correction.cap
    with torch.no_grad():
        r, _ = with_trainer_logprobs(
            module.policy, sub, mb, s.temperature, cap, None, module.updater.head_chunk_tokens
        )
    return r.old_logp, r.temperature
