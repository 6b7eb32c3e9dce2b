"""Algorithm presets: the loss, clipping, aggregation and advantage estimator of each method.

A preset only fills defaults; every field can be overridden by the module's own arguments.
Values follow ``shared/specs/mechanisms.md`` §8.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from rlvr_lightning.algorithms import losses
from rlvr_lightning.algorithms.losses import AggMode, PolicyLossFn

AlgorithmName = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
EstimatorName = Literal["grpo", "dr_grpo", "rloo", "gae", "probe"]


@dataclass(frozen=True)
class Preset:
    """Defaults of one algorithm.

    Args:
        loss_fn: per-token policy loss (see ``losses.PolicyLossFn``).
        clip_low: lower clip range ``ε_low``.
        clip_high: upper clip range ``ε_high``.
        agg_mode: how token losses are reduced (``losses.agg_loss``).
        estimator: advantage estimator (``advantages.compute_advantages``).
        filter_zero_variance: drop uninformative groups (see ``informative``) from the update:
            the filtering half of DAPO's dynamic sampling (the module's ``dynamic_sampling``
            adds the refilling half).
        informative: what must vary within a group for it to be informative: ``accuracy``
            (some but not all correct, DAPO's test, spec §8.2) or the total ``reward``.
        overlong_shaping: add DAPO's soft overlong penalty to the reward.
    """

    loss_fn: PolicyLossFn
    clip_low: float
    clip_high: float
    agg_mode: AggMode
    estimator: EstimatorName
    filter_zero_variance: bool = False
    overlong_shaping: bool = False
    informative: Literal["accuracy", "reward"] = "accuracy"


PRESETS: MappingProxyType[str, Preset] = MappingProxyType(
    {
        "grpo": Preset(losses.ppo_clip_loss, 0.2, 0.2, "seq-mean-token-mean", "grpo"),
        "dapo": Preset(
            losses.ppo_clip_loss,
            0.2,
            0.28,
            "token-mean",
            "grpo",
            filter_zero_variance=True,
            overlong_shaping=True,
            informative="accuracy",
        ),
        "dr_grpo": Preset(losses.ppo_clip_loss, 0.2, 0.2, "seq-mean-token-sum-norm", "dr_grpo"),
        "gspo": Preset(losses.gspo_loss, 3e-4, 4e-4, "seq-mean-token-mean", "grpo"),
        "cispo": Preset(losses.cispo_loss, 10.0, 0.2, "token-mean", "grpo"),
    }
)


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"Unknown algorithm {name!r}; choose one of {sorted(PRESETS)}.")
    return PRESETS[name]
