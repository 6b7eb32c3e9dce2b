"""``AnnealedTemperature``: a temperature that cools along each completion (EAD, spec §5.2).

EAD (arXiv 2510.05251) samples early tokens hot, where a different start opens a different
solution, and late tokens cool, where a slip ruins a good one. Completion token ``t`` (counted
from 0; prompt tokens are not counted) at rollout step ``s`` is drawn at

    d_s = min(d_0 + α·s, d_max)
    τ_t = 1                                   for t < c   (template / format tokens)
    τ_t = max(1 + τ_max − exp(t / d_s), τ_min) for t >= c

with the paper's formula and its 1.5B defaults ``(τ_max, τ_min, d_0, α, d_max, c) = (1.2, 0.1,
200, 5, 4·10⁴, 10)``, not the released vLLM processor's extra ×20 in the exponent (spec §5.2,
ambiguity 1). Choices where the spec is open: ``s`` counts rollout steps from 0 (verl's global
step is one rollout batch and its updates, not each optimiser step); ``τ_t`` multiplies each
row's own temperature (``sampling.temperature``, or ``AdaptiveTemperature``'s per prompt), so
with the default base 1.0 it is the paper's schedule and rows keep their base for ``t < c``.

The HF engine applies it and records the log-probs of the distribution it sampled from. The
trainer's ``π_old`` is then at the base temperature (``old_logprobs: auto`` recomputes it, as
for any token drawn at another temperature, ``correction.py``), and each token's loss is
weighted by TIS ``min(π_old / π_EAD, C)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from rlvr_lightning.module import RLVRModule
from rlvr_lightning.rollout.factory import require_position_temperatures
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.types import PromptBatch, StepOutput


def annealed_temperature(
    t: int | torch.Tensor,
    step: int,
    tau_max: float = 1.2,
    tau_min: float = 0.1,
    d0: float = 200.0,
    alpha: float = 5.0,
    d_max: float = 40000.0,
    c: int = 10,
) -> float | torch.Tensor:
    """EAD's temperature at completion position ``t`` (from 0, int or tensor) at rollout step
    ``step`` (from 0); a tensor of positions gives a float32 tensor of the same shape.

    Hand checks with the defaults: ``t < c`` gives 1; ``t = 10`` at step 0 gives
    ``2.2 − e^0.05 = 1.148729``; ``t = 200`` gives ``2.2 − e = −0.52``, floored at 0.1; at
    step 40, ``d = 400`` and ``t = 200`` gives ``2.2 − e^0.5 = 0.551279``.

    >>> round(annealed_temperature(10, 0), 6), annealed_temperature(200, 0)
    (1.148729, 0.1)
    >>> annealed_temperature(torch.tensor([0, 9, 200]), 40)
    tensor([1.0000, 1.0000, 0.5513])
    """
    d = min(d0 + alpha * step, d_max)
    if isinstance(t, torch.Tensor):
        pos = t.to(torch.float64)
        tau = (1 + tau_max - torch.exp(pos / d)).clamp(min=tau_min)
        return torch.where(pos < c, torch.ones_like(tau), tau).to(torch.float32)
    return 1.0 if t < c else max(1 + tau_max - math.exp(t / d), tau_min)


class AnnealedTemperature(RLVRCallback):
    """Per-position sampling temperature, annealed along each completion (EAD).

    Args:
        tau_max: temperature at the first annealed position (``τ_max``; 1.2 in the paper).
        tau_min: floor (``τ_min``; 0.1 for 1.5B models, 0.6 for 7B in the paper).
        d0: initial decay length ``d_0`` in tokens; larger = cools more slowly.
        alpha: growth of the decay length per rollout step ``α``.
        d_max: cap on the decay length.
        c: the first ``c`` completion tokens keep the row's base temperature.
    """

    def __init__(
        self,
        tau_max: float = 1.2,
        tau_min: float = 0.1,
        d0: float = 200.0,
        alpha: float = 5.0,
        d_max: float = 40000.0,
        c: int = 10,
    ) -> None:
        if not 0 < tau_min <= tau_max or d0 <= 0 or alpha < 0 or d_max < d0 or c < 0:
            raise ValueError(
                "AnnealedTemperature needs 0 < tau_min <= tau_max, d0 > 0, alpha >= 0, "
                f"d_max >= d0 and c >= 0; got tau_min={tau_min}, tau_max={tau_max}, d0={d0}, "
                f"alpha={alpha}, d_max={d_max}, c={c}."
            )
        self.tau_max, self.tau_min, self.c = tau_max, tau_min, c
        self.d0, self.alpha, self.d_max = d0, alpha, d_max
        self.step = 0  # rollout steps completed: the schedule's ``s``

    def schedule(self, step: int, length: int) -> torch.Tensor:
        """``[length]`` factor for completion positions ``0 .. length - 1`` at ``step``."""
        t = torch.arange(length)
        args = (self.tau_max, self.tau_min, self.d0, self.alpha, self.d_max, self.c)
        return annealed_temperature(t, step, *args)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        h = pl_module.hparams
        if pl_module.sampling.temperature <= 0:
            raise ValueError(
                "AnnealedTemperature needs model.sampling.temperature > 0 (greedy sampling has "
                "no temperature to anneal)."
            )
        if pl_module.options.correction.old_logprobs == "engine":
            raise ValueError(
                "AnnealedTemperature samples tokens at temperatures the trainer does not score, "
                "so the recorded log-probs cannot serve as π_old: set "
                "model.correction.old_logprobs: auto (or trainer) to recompute π_old and weight "
                "tokens by TIS."
            )
        require_position_temperatures(h.engine, h.policy)

    @override
    def on_before_generate(
        self, trainer: pl.Trainer, module: RLVRModule, batch: PromptBatch
    ) -> PromptBatch:
        schedule = self.schedule(self.step, module.sampling.max_new_tokens)  # [T_max]
        return dataclasses.replace(batch, position_temperatures=schedule)

    @override
    def on_step_output(self, trainer: pl.Trainer, module: RLVRModule, output: StepOutput) -> None:
        lengths = output.lengths.reshape(-1).cpu()  # [N]
        width = max(int(lengths.max()), 1) if lengths.numel() else 1
        f = self.schedule(output.step, width)  # [T]
        counts = (lengths[:, None] > torch.arange(width)).sum(0)  # [T] rows reaching position t
        if int(counts.sum()) > 0:
            mean = float((f * counts).sum() / counts.sum())
            module.log("train/temperature/annealed_mean", mean, batch_size=1)
            module.log("train/temperature/annealed_min", float(f[counts > 0].min()), batch_size=1)
        self.step = output.step + 1

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
