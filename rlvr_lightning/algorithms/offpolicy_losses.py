"""Losses of injected (off-policy) tokens (spec §4.7): LUFFY/ExGRPO policy shaping, RL-PLUS's
multiple importance sampling, or ratio 1, combined with the clipped loss of sampled tokens."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from rlvr_lightning.algorithms.losses import (
    LOG_RATIO_BOUND,
    LossOutput,
    PolicyLossFn,
    valid_inputs,
)
from rlvr_lightning.algorithms.ops import masked_mean

OffPolicyWeighting = Literal["shaping", "mis", "on_policy"]


def policy_shaping(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """LUFFY/ExGRPO shaping ``f(x) = x / (x + gamma)``; ``f'(x) = gamma / (x + gamma)**2``.

    Hand check (``gamma = 0.1``): ``f(0.5) = 0.5 / 0.6 = 0.8333``, ``f'(0.5) = 0.1 / 0.36``.
    """
    if gamma <= 0:
        raise ValueError(f"policy shaping needs gamma > 0 (LUFFY and ExGRPO use 0.1); got {gamma}.")
    return x / (x + gamma)


def offpolicy_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    weighting: OffPolicyWeighting,
    gamma: float = 0.1,
    exploration: float = 0.5,
) -> LossOutput:
    """Per-token loss of tokens that were not sampled from the policy; none is clipped.

    ``weighting``:

    - ``shaping`` (LUFFY, ExGRPO, AMPO): ``-A * f(w)``, ``w = pi / pi_behaviour`` with ``f`` of
      :func:`policy_shaping`. A behaviour log-prob of 0 (unknown teacher, taken as probability
      1) gives LUFFY's ``f(pi)``; stored behaviour log-probs give ExGRPO's ``f(w)``. The
      gradient w.r.t. ``log pi`` is ``-A * w * gamma / (w + gamma)**2``.
    - ``mis`` (RL-PLUS): ``-A * (1 - sg(pi))**exploration * pi / (pi_old/2 + omega/2)`` with
      ``omega = (pi_old + 1) / 2``. ``pi_old`` is ``sg(pi)``, the policy at this update (exact
      when each rollout gets one optimiser step; this project's choice, since the rollout-time
      probability of an injected token is never computed).
    - ``on_policy``: the ratio ``pi / sg(pi)`` (value 1): ``-A * log pi``'s gradient, an SFT
      term weighted by the advantage (ViSurf's first reading, MENTOR).

    Returns ``([N, T]`` loss, 0 where ``mask`` is 0; metrics ``offpolicy_weight_mean`` (mean
    token weight multiplying ``-A``) and ``offpolicy_prob_mean`` (mean ``pi``)).
    """
    valid, logp, behaviour_logp, adv = valid_inputs(logp, behaviour_logp, advantages, mask)
    prob = torch.exp(logp)  # [N, T]
    match weighting:
        case "shaping":
            log_w = (logp - behaviour_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            weight = policy_shaping(torch.exp(log_w), gamma)  # [N, T]
        case "mis":
            old = prob.detach()  # [N, T]
            omega = 0.5 * (old + 1.0)
            explore = (1.0 - old).clamp_min(0.0) ** exploration  # [N, T]
            weight = explore * prob / (0.5 * old + 0.5 * omega)
        case "on_policy":
            weight = torch.exp(logp - logp.detach())  # [N, T], value 1
        case _:
            raise ValueError(
                f"Unknown off-policy weighting {weighting!r}; use one of "
                f"{get_args(OffPolicyWeighting)}."
            )
    loss = torch.where(valid, -adv * weight, 0.0)  # [N, T]
    metrics = {
        "offpolicy_weight_mean": masked_mean(weight, valid).detach(),
        "offpolicy_prob_mean": masked_mean(prob, valid).detach(),
    }
    return loss, metrics


def mixed_policy_loss(
    loss_fn: PolicyLossFn,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    offpolicy_mask: torch.Tensor,
    *,
    weighting: OffPolicyWeighting,
    gamma: float,
    exploration: float,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> LossOutput:
    """``loss_fn`` on the policy's own tokens, :func:`offpolicy_token_loss` on the others.

    ``offpolicy_mask`` is ``[N, T]``, nonzero on tokens not sampled from the policy. The
    on-policy metrics (clip fractions, ratio) are computed over on-policy tokens only.
    """
    off = offpolicy_mask.bool() & mask.bool()  # [N, T]
    on_loss, metrics = loss_fn(
        logp,
        old_logp,
        advantages,
        mask.bool() & ~off,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )
    off_loss, off_metrics = offpolicy_token_loss(
        logp, old_logp, advantages, off, weighting=weighting, gamma=gamma, exploration=exploration
    )
    return torch.where(off, off_loss, on_loss), {**metrics, **off_metrics}
