"""``AdaptiveTemperature``: sample mastered prompts hotter (ERPO, spec §5.1).

An all-correct group has zero advantage and teaches nothing. ERPO (arXiv 2511.04800) keeps a
history per prompt and raises the sampling temperature of prompts whose last group was all
correct, so that diverse (and some wrong) completions bring the signal back. Its update rule and
bounds are not public; this is the spec's skeleton with every constant configurable (defaults
``T_0 = 1.0, Δ = 0.1, T_max = 1.5`` are this project's choice):

    all correct:         T_q <- min(T_q + Δ, T_max)
    mixed (or all wrong): T_q <- T_0 (``on_mixed: reset``)  or  T_0 + ρ·(T_q − T_0) (``decay``)

The outcome is the sampled one (``StepOutput.pass_rate``), never counting injected members.
Rows sampled hotter than ``sampling.temperature`` are off-policy for the trained policy; with
the module's ``old_logprobs: auto`` the trainer recomputes ``π_old`` at
``sampling.temperature`` and weights tokens by truncated importance sampling
(``correction.py``), so the loss sees the policy that is optimised.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import lightning.pytorch as pl
from typing_extensions import override

from rlvr_lightning.module import RLVRModule
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.types import PromptBatch, StepOutput


def next_temperature(
    current: float,
    pass_rate: float,
    t0: float,
    delta: float,
    t_max: float,
    on_mixed: Literal["reset", "decay"],
    decay: float,
) -> float:
    """One prompt's temperature after a group with ``pass_rate`` (k / G).

    >>> next_temperature(1.0, 1.0, 1.0, 0.1, 1.5, "reset", 0.5)
    1.1
    >>> next_temperature(1.45, 1.0, 1.0, 0.1, 1.5, "reset", 0.5)
    1.5
    >>> next_temperature(1.4, 0.5, 1.0, 0.1, 1.5, "decay", 0.5)
    1.2
    """
    if pass_rate >= 1.0:
        return round(min(current + delta, t_max), 6)
    if on_mixed == "reset":
        return t0
    return round(t0 + decay * (current - t0), 6)


class AdaptiveTemperature(RLVRCallback):
    """Per-prompt sampling temperature from each prompt's last sampled outcome (ERPO).

    Args:
        t0: base temperature; None = the module's ``sampling.temperature`` (1.0 by default),
            so prompts without history sample exactly as without the callback.
        delta: increase after an all-correct group.
        t_max: upper bound.
        on_mixed: after a group that is not all correct: ``reset`` to ``t0`` or ``decay``
            toward it by ``decay``.
        decay: ``ρ`` of ``decay`` (0 = reset, 1 = keep).
    """

    def __init__(
        self,
        t0: float | None = None,
        delta: float = 0.1,
        t_max: float = 1.5,
        on_mixed: Literal["reset", "decay"] = "reset",
        decay: float = 0.5,
    ) -> None:
        if delta < 0 or not 0 <= decay <= 1:
            raise ValueError("AdaptiveTemperature needs delta >= 0 and 0 <= decay <= 1.")
        if on_mixed not in ("reset", "decay"):
            raise ValueError(f"on_mixed must be 'reset' or 'decay', got {on_mixed!r}.")
        self.t0, self.delta, self.t_max = t0, delta, t_max
        self.on_mixed, self.decay = on_mixed, decay
        self.temperatures: dict[str, float] = {}  # prompt id -> current temperature

    def _base(self, module: RLVRModule) -> float:
        return module.sampling.temperature if self.t0 is None else self.t0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        base = self._base(pl_module)
        if base <= 0 or self.t_max < base:
            raise ValueError(
                f"AdaptiveTemperature needs a sampling temperature > 0 and t_max >= t0; got "
                f"t0={base}, t_max={self.t_max}. Set model.sampling.temperature > 0 (greedy "
                "sampling has no temperature to adapt) or raise t_max."
            )

    def on_before_generate(
        self, trainer: pl.Trainer, module: RLVRModule, batch: PromptBatch
    ) -> PromptBatch:
        base = self._base(module)
        temps = [self.temperatures.get(pid, base) for pid in batch.prompt_ids]
        return dataclasses.replace(batch, temperatures=temps)

    def on_step_output(self, trainer: pl.Trainer, module: RLVRModule, output: StepOutput) -> None:
        base = self._base(module)
        for pid, rate in zip(output.prompt_ids, output.pass_rate.tolist(), strict=True):
            t = next_temperature(
                self.temperatures.get(pid, base),
                rate,
                base,
                self.delta,
                self.t_max,
                self.on_mixed,
                self.decay,
            )
            if t == base:
                self.temperatures.pop(pid, None)
            else:
                self.temperatures[pid] = t
        raised = list(self.temperatures.values())
        module.log("train/temperature/raised_prompts", float(len(raised)), batch_size=1)
        if raised:
            module.log("train/temperature/max", max(raised), batch_size=1)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"temperatures": dict(self.temperatures)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.temperatures = {str(k): float(v) for k, v in state_dict["temperatures"].items()}
