"""``NearFuturePolicyGuidance``: the run's own later policy guides the prompts it fails (NPO,
spec §6, arXiv 2604.20733).

A checkpoint a few steps ahead of the current policy is stronger than it, yet close enough that
its trajectories need no importance correction. During an intervention, every group whose
sampled accuracy is below ``accuracy_gate`` (0.6, the paper's gate) gets a verified-correct
trajectory sampled from that guide, in the slot of one of its incorrect samples
(``composition: replace_random``, the spec's "replace one slot"). The guide comes from:

- ``mode: manual``: ``guide_checkpoint``, a Lightning checkpoint (``.ckpt``) of this or an
  earlier run of the same model, or an exported model folder; interventions start at the
  rollout steps ``intervene_at`` and last ``duration`` steps.
- ``mode: lookahead``: at each step of ``intervene_at`` the whole training state is saved, the
  run trains ``lookahead`` steps ahead (``guidance.lookahead``), keeps those weights as the
  guide and restores the saved state exactly, then goes on with the guide.
- ``mode: auto`` (AutoNPO): interventions start when the sampled reward plateaus over
  ``window`` steps or the entropy collapses, at least ``min_gap`` steps apart. The run looks
  ahead ``max(candidates)`` steps, keeping the weights at every candidate ``Δ``; each candidate
  samples the newest prompts of a mistake pool (prompts the policy failed); ``Δ`` with the best
  ``S = Q / V`` is the guide (``rlvr_lightning.algorithms.npo``: ``Q`` the share of pool prompts it
  solves, ``V`` the variance of the token log-ratio of policy and guide on its trajectories:
  this project's estimators, the paper's are not public).

The injected trajectory is trained as an on-policy sample (its ``π_old`` is the current
policy's log-probs; per the paper, no importance correction); ``importance_correction: true``
makes it an ordinary off-policy member instead, with the guide's log-probs as behaviour and the
module's ``offpolicy_weighting``. Gating and the mistake pool read the prompt's sampled outcome
(``outcomes.py``), which the injection never changes. While guiding, the guide's weights are in
this callback's checkpoint state, so a resumed run goes on with the same guide.

Each step logs ``npo/active``, ``npo/guided_groups``, ``npo/guide_solved`` (share of guided
prompts the guide solved), ``npo/injected``; each intervention ``npo/guide_step``,
``npo/delta`` and, in ``auto``, ``npo/Q@Δ``, ``npo/V@Δ``, ``npo/S@Δ`` (under ``train/``).
Trigger thresholds, the ``Δ`` grid, pool size and window are this project's choices.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from rlvr_lightning.callbacks._guidance import (
    GuidanceCallback,
    pooled_batch,
    pooled_prompt,
)
from rlvr_lightning.callbacks._npo_guide import (
    NearFutureGuide,
    Weights,
    guide_members,
    look_ahead,
    score_candidates,
)
from typing_extensions import override

from rlvr_lightning.algorithms import npo
from rlvr_lightning.algorithms.offpolicy import Composition
from rlvr_lightning.data.stream import rng_state, set_rng_state
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.runtime import ranks
from rlvr_lightning.stages.offpolicy import inject
from rlvr_lightning.types import Scored, StepOutput

Mode = Literal["manual", "lookahead", "auto"]


def _check_arguments(
    mode: Mode, guide_checkpoint: str | None, intervene_at: list[int] | None
) -> None:
    if mode not in ("manual", "lookahead", "auto"):
        raise ValueError(f"mode must be 'manual', 'lookahead' or 'auto', got {mode!r}.")
    if mode == "manual" and guide_checkpoint is None:
        raise ValueError("mode manual needs guide_checkpoint (a .ckpt or a model folder).")
    if mode != "auto" and not intervene_at:
        raise ValueError(f"mode {mode} needs intervene_at: the rollout steps to guide from.")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")


class NearFuturePolicyGuidance(GuidanceCallback):
    """Guide failing prompts with verified trajectories of a near-future policy (NPO).

    Args:
        mode: where the guide comes from: ``manual`` (``guide_checkpoint``), ``lookahead``
            (train ``lookahead`` steps ahead at each step of ``intervene_at``) or ``auto``
            (AutoNPO: online triggers, ``Δ`` chosen from ``candidates`` by ``S = Q / V``).
        guide_checkpoint: a ``.ckpt`` of this or an earlier run, or an exported model folder
            with the policy's tokenizer (``manual``).
        intervene_at: rollout steps (counted from 0, as ``StepOutput.step``) at which an
            intervention starts (``manual``, ``lookahead``).
        duration: rollout steps each intervention guides.
        lookahead: ``Δ``, the steps trained ahead (``lookahead``).
        candidates: the ``Δ`` grid of ``auto``.
        accuracy_gate: groups whose sampled accuracy is below it are guided (0.6).
        guide_samples: guide completions per guided prompt, searched for a verified-correct one.
        num_injected: verified trajectories injected per guided group.
        composition: the slots they take (``offpolicy.guidance_slots``).
        importance_correction: weight the injected tokens as off-policy (see above).
        window: steps of each trigger window (``auto``).
        min_reward_gain: a window's mean sampled reward must beat the previous one's by more
            than this, else the reward has plateaued (``auto``).
        entropy_ratio: the entropy has collapsed when a window's mean falls below this share
            of the first window's (``auto``).
        entropy_floor: or below this absolute value (``auto``).
        min_gap: rollout steps from one intervention's start to the next (``auto``).
        pool_size: prompts the mistake pool keeps (``auto``).
        q_prompts: newest mistake-pool prompts each candidate is scored on (``auto``).
        seed: seed of the slot choice.
    """

    def __init__(
        self,
        mode: Mode = "lookahead",
        guide_checkpoint: str | None = None,
        intervene_at: list[int] | None = None,
        duration: int = 5,
        lookahead: int = 4,
        candidates: list[int] | None = None,
        accuracy_gate: float = 0.6,
        guide_samples: int = 4,
        num_injected: int = 1,
        composition: Composition = "replace_random",
        importance_correction: bool = False,
        window: int = 5,
        min_reward_gain: float = 0.01,
        entropy_ratio: float = 0.5,
        entropy_floor: float = 0.0,
        min_gap: int = 10,
        pool_size: int = 64,
        q_prompts: int = 16,
        seed: int = 0,
    ) -> None:
        _check_arguments(mode, guide_checkpoint, intervene_at)
        _check_positive(
            duration=duration,
            lookahead=lookahead,
            guide_samples=guide_samples,
            num_injected=num_injected,
            window=window,
            q_prompts=q_prompts,
        )
        self.candidates = sorted(set(candidates or [2, 4, 8]))
        if self.candidates[0] < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}.")
        self.mode, self.guide_checkpoint = mode, guide_checkpoint
        self.intervene_at = sorted(set(intervene_at or []))
        self.duration, self.lookahead = duration, lookahead
        self.accuracy_gate, self.guide_samples = accuracy_gate, guide_samples
        self.num_injected, self.composition = num_injected, composition
        self.importance_correction = importance_correction
        self.window, self.min_reward_gain = window, min_reward_gain
        self.entropy_ratio, self.entropy_floor = entropy_ratio, entropy_floor
        self.min_gap, self.pool_size, self.q_prompts = min_gap, pool_size, q_prompts
        self.seed = seed
        # state (checkpointed)
        self.slot_rng = random.Random(seed)
        self.pool = npo.MistakePool(pool_size)
        self.rewards: list[float] = []
        self.entropies: list[float] = []
        self.active_until = -1  # first rollout step no longer guided
        self.last_start = -(10**9)
        self.guide_step = -1  # rollout step whose weights the guide holds
        self.delta = 0
        self.guide = NearFutureGuide(guide_checkpoint, guide_samples)  # weights: checkpointed
        self.triggered = False
        self.interventions = 0
        self._pending: dict[str, float] = {}  # intervention metrics for the next step's log

    @property
    def guide_weights(self) -> Weights | None:
        """The trainable weights the guide carries (``lookahead``, ``auto``); None otherwise."""
        return self.guide.weights

    @guide_weights.setter
    def guide_weights(self, weights: Weights | None) -> None:
        self.guide.weights = weights

    # ---- setup and state -------------------------------------------------------------------

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        g = self.check_module(pl_module).sampling.group_size
        if g - self.num_injected < 1:
            raise ValueError(
                f"NearFuturePolicyGuidance injects {self.num_injected} of G={g} rows, leaving no "
                f"sample of the policy; raise model.sampling.group_size above {self.num_injected}."
            )
        if self.mode != "manual" and not hasattr(trainer.datamodule, "compose_step"):
            raise TypeError(
                f"NearFuturePolicyGuidance mode {self.mode} looks ahead on the data module's "
                "next prompts: use rlvr_lightning.RLVRDataModule, or mode manual."
            )
        if self.mode == "manual" and self.guide_checkpoint is not None:
            path = Path(self.guide_checkpoint).expanduser()
            if not path.exists():
                raise FileNotFoundError(
                    f"guide_checkpoint {path} does not exist: give a .ckpt written by "
                    "rlvr-lightning fit or an exported model folder."
                )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "slot_rng": rng_state(self.slot_rng),
            "pool": self.pool.state_dict(),
            "rewards": list(self.rewards),
            "entropies": list(self.entropies),
            "active_until": self.active_until,
            "last_start": self.last_start,
            "guide_step": self.guide_step,
            "delta": self.delta,
            "triggered": self.triggered,
            "interventions": self.interventions,
            "guide_weights": self.guide_weights,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_rng_state(self.slot_rng, state_dict["slot_rng"])
        self.pool.load_state_dict(state_dict["pool"])
        self.rewards = [float(x) for x in state_dict["rewards"]]
        self.entropies = [float(x) for x in state_dict["entropies"]]
        self.active_until = int(state_dict["active_until"])
        self.last_start = int(state_dict["last_start"])
        self.guide_step, self.delta = int(state_dict["guide_step"]), int(state_dict["delta"])
        self.triggered = bool(state_dict["triggered"])
        self.interventions = int(state_dict["interventions"])
        self.guide_weights = state_dict["guide_weights"]
        self.guide.release()  # rebuilt from the weights when next needed

    # ---- when to intervene -----------------------------------------------------------------

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._at_boundary(trainer, pl_module)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        self._at_boundary(trainer, pl_module)

    def _at_boundary(self, trainer: pl.Trainer, module: RLVRModule) -> None:
        """Between rollout steps: end a finished intervention, start a due one."""
        step = module._rollout_step  # the next step to run
        if self.active_until >= 0 and step >= self.active_until:
            self.active_until, self.guide_weights = -1, None
            self.guide.release()
        if self.active_until >= 0 or not self._due(step):
            return
        self.triggered = False
        guide_step, metrics = self._obtain_guide(trainer, module, step)
        self._pending.update(metrics)
        if guide_step is None:
            return
        self.active_until, self.last_start, self.guide_step = step + self.duration, step, guide_step
        self.interventions += 1
        self._pending.update(
            {"npo/guide_step": float(guide_step), "npo/delta": float(guide_step - step)}
        )

    def _due(self, step: int) -> bool:
        if self.mode != "auto":
            return step in self.intervene_at
        return self.triggered and step - self.last_start >= self.min_gap

    def _obtain_guide(
        self, trainer: pl.Trainer, module: RLVRModule, step: int
    ) -> tuple[int | None, dict[str, float]]:
        """Build the guide for an intervention starting at ``step``; returns the step its
        weights belong to (None: no intervention) and metrics."""
        if self.mode == "manual":
            self.guide.load(module)
            self.delta = 0
            return step, {}
        if self.mode == "auto" and not self._any_mistakes(module):
            return None, {"npo/skipped_no_mistakes": 1.0}  # nothing to guide: no look-ahead
        deltas = [self.lookahead] if self.mode == "lookahead" else self.candidates
        kept = look_ahead(trainer, module, max(deltas), deltas, skip=[self])
        if self.mode == "lookahead":
            self.delta = self.lookahead
            self.guide.carry(module, kept[self.lookahead])
            return step + self.lookahead, {}
        return self._choose(module, step, kept)

    def _any_mistakes(self, module: RLVRModule) -> bool:
        """Whether the mistake pool of any rank holds a prompt (the same answer on all)."""
        strategy = module.trainer.strategy
        return ranks.over_ranks(strategy, len(self.pool), "max", module.device) > 0

    def _choose(
        self, module: RLVRModule, step: int, kept: dict[int, Weights]
    ) -> tuple[int | None, dict[str, float]]:
        """AutoNPO: score each candidate guide on the mistake pool, keep the best ``S``."""
        prompts = self.pool.newest(self.q_prompts)
        batch = pooled_batch([pid for pid, _ in prompts], [p for _, p in prompts])
        metrics: dict[str, float] = {"npo/pool_prompts": float(len(prompts))}
        scores, scored = score_candidates(self.guide, module, batch, kept)
        metrics.update(scored)
        self.delta = npo.best_candidate(scores)
        self.guide.carry(module, kept[self.delta])
        return step + self.delta, metrics

    # ---- the step ----------------------------------------------------------------------------

    @override
    def on_after_score(self, trainer: pl.Trainer, module: RLVRModule, scored: Scored) -> Scored:
        groups = self.groups(module, scored)
        batch, sampled = groups.batch, groups.sampled  # [B, G] the policy's outcome
        if self.mode == "auto":
            for b, pid in enumerate(batch.prompt_ids):
                self.pool.observe(pid, int(sampled[b].sum()), pooled_prompt(batch, b))
        metrics = {**self._pending, "npo/active": float(self.active_until >= 0)}
        self._pending = {}
        if self.mode == "auto":
            metrics["npo/pool_prompts"] = float(len(self.pool))
        if self.active_until < 0:
            scored.metrics.update(metrics)
            return scored
        guided = [
            b for b in range(len(batch)) if float(sampled[b].float().mean()) < self.accuracy_gate
        ]
        members, solved = guide_members(
            module,
            self.guide,
            groups,
            guided,
            self.num_injected,
            self.composition,
            self.slot_rng,
            self.importance_correction,
        )
        scored = inject(module, batch, scored, members)
        metrics.update(
            {
                "npo/guided_groups": float(len(guided)),
                "npo/guide_solved": solved / len(guided) if guided else 0.0,
                "npo/injected": float(len(members)),
                "npo/guide_step": float(self.guide_step),
            }
        )
        scored.metrics.update(metrics)
        return scored

    @override
    def on_step_output(self, trainer: pl.Trainer, module: RLVRModule, output: StepOutput) -> None:
        if self.mode != "auto":
            return
        self.rewards.append(float(output.rewards.float().mean()))
        if "entropy" in output.metrics:
            self.entropies.append(float(output.metrics["entropy"]))
        w = self.window
        self.rewards = self.rewards[-2 * w :]
        if len(self.entropies) > 2 * w:  # the first window (the baseline) and the last one
            self.entropies = self.entropies[:w] + self.entropies[-w:]
        if npo.plateaued(self.rewards, self.window, self.min_reward_gain) or npo.entropy_collapsed(
            self.entropies, self.window, self.entropy_ratio, self.entropy_floor
        ):
            self.triggered = True
