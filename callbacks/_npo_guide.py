"""The guide of ``NearFuturePolicyGuidance`` (NPO): the model, its sampling, and AutoNPO's score.

The guide is a checkpoint or model folder (``mode: manual``) or a frozen copy of the policy
carrying look-ahead weights; it samples through its own HF engine at the module's sampling
settings. AutoNPO scores each candidate ``Δ`` on mistake-pool prompts by ``S = Q / V``
(``algorithms.npo``), with every rank deciding alike. When to intervene and how the guide's
trajectories join the groups stay in the callback.
"""

from __future__ import annotations

import dataclasses
import random

import lightning.pytorch as pl
import torch
from rlvr_lightning.callbacks._guidance import Groups

from rlvr_lightning import models
from rlvr_lightning.algorithms import npo
from rlvr_lightning.algorithms.offpolicy import Composition, guidance_slots
from rlvr_lightning.device import trainer_forward
from rlvr_lightning.guidance import lookahead
from rlvr_lightning.guidance.guide import load_guide
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.runtime import ranks
from rlvr_lightning.stages.offpolicy import Member, prompt_rows
from rlvr_lightning.types import PromptBatch, Rollouts

SOURCE = "npo"
Weights = dict[str, torch.Tensor]


def look_ahead(
    trainer: pl.Trainer, module: RLVRModule, steps: int, keep_at: list[int], skip: list[pl.Callback]
) -> dict[int, Weights]:
    """The trainable weights after each step count of ``keep_at`` of training ``steps`` steps
    ahead on the data module's next prompts; the training state is restored afterwards
    (``skip``: callbacks left out of the look-ahead, the caller itself)."""
    saved = lookahead.capture(trainer, module, skip=skip)
    try:
        return lookahead.train_ahead(trainer, module, steps, keep_at, skip=skip)
    finally:
        lookahead.restore(trainer, module, saved)


def policy_logp(module: RLVRModule, rollouts: Rollouts) -> torch.Tensor:
    """``[n, T]`` the current policy's log-probs of ``rollouts``' tokens, at the rows'
    temperatures, as the update computes them (0 on padding)."""
    return trainer_forward(
        module.policy,
        rollouts,
        module.options.update.micro_batch_size,
        head_chunk_tokens=module.updater.head_chunk_tokens,
    )[0]


class NearFutureGuide:
    """The guide model and the engine that samples it, built when first needed.

    Args:
        checkpoint: the ``manual`` guide (a ``.ckpt`` or an exported model folder); None for
            a guide built from ``weights``.
        samples: completions sampled per prompt, searched for a verified-correct one.

    ``weights`` (the look-ahead guide's trainable weights) is what a checkpoint of the callback
    keeps; the model and engine are rebuilt from it after a resume.
    """

    def __init__(self, checkpoint: str | None, samples: int) -> None:
        self.checkpoint, self.samples = checkpoint, samples
        self.weights: Weights | None = None
        self._model: torch.nn.Module | None = None
        self._engine: HFEngine | None = None

    def release(self) -> None:
        """Drop the model and engine (rebuilt from ``weights`` or the checkpoint when needed)."""
        self._model = self._engine = None

    def load(self, module: RLVRModule) -> None:
        """Load the ``manual`` guide, once."""
        if self._model is None:
            guide = load_guide(
                self.checkpoint, module.policy, module.tokenizer, module.hparams.dtype
            )
            self._set(guide, module)

    def carry(self, module: RLVRModule, weights: Weights) -> None:
        """Make the guide a frozen copy of the policy carrying ``weights``."""
        self.weights = weights
        self._build(module)

    def _build(self, module: RLVRModule) -> None:
        assert self.weights is not None
        if self._model is None:
            self._model = models.frozen_copy(module.policy)
        params = dict(self._model.named_parameters())
        with torch.no_grad():
            for name, value in self.weights.items():
                params[name].copy_(value)
        self._set(self._model, module)

    def _set(self, guide: torch.nn.Module, module: RLVRModule) -> None:
        self._model = guide.to(module.device)
        self._engine = HFEngine(self._model, module.tokenizer)

    def sample(self, module: RLVRModule, batch: PromptBatch) -> tuple[Rollouts, torch.Tensor]:
        """``samples`` guide completions of each prompt and their ``[n]`` correctness."""
        if self._engine is None:
            if self.weights is None:
                self.load(module)
            else:
                self._build(module)
        assert self._engine is not None
        ids, mask = module.encode_prompts(batch)
        sampling = dataclasses.replace(module.sampling, group_size=self.samples)
        rollouts = self._engine.generate(ids, mask, sampling)
        return rollouts, module.score(batch, rollouts).correct.cpu()


def score_candidates(
    guide: NearFutureGuide,
    module: RLVRModule,
    batch: PromptBatch,
    kept: dict[int, Weights],
) -> tuple[dict[int, float], dict[str, float]]:
    """AutoNPO: ``S = Q / V`` of each candidate guide (``Δ -> weights``) on ``batch`` (the
    mistake pool's newest prompts; may be empty on this rank), and the metrics ``npo/Q@Δ``,
    ``npo/V@Δ``, ``npo/S@Δ``. The guide ends up carrying the last candidate's weights."""
    strategy = module.trainer.strategy
    scores: dict[int, float] = {}
    metrics: dict[str, float] = {}
    # Every rank decides alike (under DDP each has its own pool, and some rank held a
    # mistake): Δ by Q and V averaged over the ranks.
    for delta, weights in kept.items():
        guide.carry(module, weights)
        q = v = 0.0
        if len(batch):
            rollouts, correct = guide.sample(module, batch)  # correct: [B * samples]
            q = npo.signal_quality(correct.view(len(batch), -1).any(1).tolist())
            v = npo.logratio_variance(
                policy_logp(module, rollouts), rollouts.behaviour_logp, rollouts.completion_mask
            )
        q = ranks.over_ranks(strategy, q, "mean", module.device)
        v = ranks.over_ranks(strategy, v, "mean", module.device)
        scores[delta] = npo.effective_signal(q, v)
        metrics.update({f"npo/Q@{delta}": q, f"npo/V@{delta}": v, f"npo/S@{delta}": scores[delta]})
    return scores, metrics


def guide_members(
    module: RLVRModule,
    guide: NearFutureGuide,
    groups: Groups,
    guided: list[int],
    num_injected: int,
    composition: Composition,
    rng: random.Random,
    importance_correction: bool,
) -> tuple[list[Member], int]:
    """Members for the ``guided`` groups (up to ``num_injected`` verified-correct guide samples
    each, in slots chosen by ``composition``) and how many of those groups the guide solved."""
    if not guided:
        return [], 0
    n, g = guide.samples, groups.size  # rows i * n .. i * n + n - 1: guided group i's samples
    rollouts, correct = guide.sample(module, prompt_rows(groups.batch, guided))  # [len(guided)*n]
    rollouts, logp = _behaviour(module, rollouts, importance_correction)  # [len(guided) * n, T]
    members, solved = [], 0
    lengths = rollouts.completion_mask.sum(-1).tolist()  # [len(guided) * n]
    for i, b in enumerate(guided):
        rows = [i * n + j for j in range(n) if bool(correct[i * n + j])][:num_injected]
        if not rows:
            continue
        solved += 1
        now_correct, on = groups.correct[b].tolist(), groups.on_policy[b].tolist()
        slots = guidance_slots(now_correct, on, len(rows), composition, rng)
        for slot, r in zip(slots, rows, strict=False):
            k = int(lengths[r])
            members.append(
                Member(
                    row=b * g + slot,
                    source=SOURCE,
                    token_ids=rollouts.completion_ids[r, :k].tolist(),
                    behaviour_logp=logp[r, :k].tolist(),
                    temperature=float(rollouts.temperature[r]),
                    as_on_policy=not importance_correction,
                )
            )
    return members, solved


def _behaviour(
    module: RLVRModule, rollouts: Rollouts, importance_correction: bool
) -> tuple[Rollouts, torch.Tensor]:
    """The guide's rows as they train and their ``[n, T]`` behaviour log-probs: the guide's
    own with ``importance_correction``, else (an on-policy-treated member's ``π_old``) the
    current policy's at its base temperature."""
    if importance_correction:
        return rollouts, rollouts.behaviour_logp
    rollouts = dataclasses.replace(
        rollouts,
        temperature=torch.full_like(rollouts.temperature, module.sampling.temperature),
    )
    return rollouts, policy_logp(module, rollouts)
