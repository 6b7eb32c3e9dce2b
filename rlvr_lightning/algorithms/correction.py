"""Rollout correction: when the sampler's numbers are not the trainer's.

An engine that holds its own weights (vLLM) computes the behaviour log-probs with other kernels,
often in another dtype; a temperature schedule samples from a distribution the trainer does not
score. Using those log-probs as ``π_old`` makes the importance ratio start away from 1 and the
clipping act on numerical noise (the vLLM quickstart in bf16 went 0.06 -> 0.02 that way). So,
where they may differ, ``π_old`` is recomputed by the trainer (:func:`trainer_forward`, one
no-grad forward in the update's precision) and the behaviour log-probs serve only to weight
each token by truncated importance sampling, ``ρ = min(π_old / π_behaviour, C)`` (spec §5.2,
verl's TIS), or to mask tokens whose ratio leaves ``[1/C, C]``.

Pure maths on ``[N, T]`` tensors; the trainer's no-grad pass is ``device.trainer_pass``, its use
in a step ``stages.old_logprobs``.
"""

from __future__ import annotations

from typing import Literal

import torch

from rlvr_lightning.types import Rollouts

CorrectionMode = Literal["tis", "mask", "none"]
CorrectionLevel = Literal["token", "sequence"]


def log_ratio(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, level: CorrectionLevel, mask: torch.Tensor
) -> torch.Tensor:
    """``[N, T]`` log of ``π_old / π_behaviour`` per token, or per sequence (the sum over its
    tokens, broadcast to every token of the row); 0 on padding."""
    tokens = (old_logp - behaviour_logp) * mask  # [N, T]
    if level == "sequence":
        return tokens.sum(-1, keepdim=True).expand_as(tokens) * mask
    if level != "token":
        raise ValueError(f"correction level must be 'token' or 'sequence', got {level!r}.")
    return tokens


def correction_weights(
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: CorrectionMode,
    cap: float,
    level: CorrectionLevel = "token",
) -> torch.Tensor:
    """``[N, T]`` detached per-token weights of the policy loss.

    ``tis``: ``min(exp(log_ratio), cap)``; ``mask``: 1 where ``1/cap <= ratio <= cap``, else 0
    (the token leaves the loss but keeps its place in the normaliser, as a weight of 0 would);
    ``none``: 1. Padding gets 0.
    """
    if cap <= 1:
        raise ValueError(f"rollout_correction_cap must be > 1, got {cap}.")
    lr = log_ratio(old_logp.detach(), behaviour_logp.detach(), level, mask)  # [N, T]
    if mode == "tis":
        return torch.exp(lr).clamp(max=cap) * mask
    if mode == "mask":
        bound = torch.log(torch.tensor(cap, dtype=lr.dtype))
        return (lr.abs() <= bound).to(mask.dtype) * mask
    if mode == "none":
        return mask.clone()
    raise ValueError(f"rollout_correction must be 'tis', 'mask' or 'none', got {mode!r}.")


def mismatch_metrics(
    old_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> dict[str, float]:
    """How far the sampler is from the trainer, over the tokens of ``mask``.

    ``kl``: the k3 estimate of ``KL(π_behaviour || π_old)`` (tokens were drawn from the
    behaviour policy: ``r - 1 - log r`` with ``r = π_old / π_behaviour``, always >= 0);
    ``ratio_min`` / ``ratio_max``: token ratio extremes; ``capped_frac``: share of tokens whose
    ratio exceeds ``cap``.
    """
    m = mask.bool()
    if not bool(m.any()):
        return {}
    lr = (old_logp - behaviour_logp).double()[m]  # [n_tokens]
    r = lr.exp()
    return {
        "kl": float((r - 1 - lr).mean()),
        "ratio_min": float(r.min()),
        "ratio_max": float(r.max()),
        "capped_frac": float((r > cap).double().mean()),
    }


def needs_trainer_logprobs(
    choice: str,
    engine_shares_policy: bool,
    rollouts: Rollouts,
    base_temperature: float,
    truncated_sampler: bool = False,
) -> bool:
    """Whether ``π_old`` must come from the trainer: ``choice`` is ``trainer``, or ``auto``
    and the sampler differs from the trainer: an engine with its own weights; a sampler that
    truncates the distribution (``truncated_sampler``: ``top_p < 1`` or ``top_k > 0``, whose
    log-probs are those of the renormalised nucleus while the loss's ``π_θ`` is the full
    softmax, so the first ratio would sit below 1 before any update); or sampled tokens of
    on-policy rows drawn at a temperature other than ``base_temperature`` (a per-row
    temperature, or a per-position schedule such as EAD's). The sampler's log-probs then
    enter only through the correction weights (TIS)."""
    if choice in ("trainer", "engine"):
        return choice == "trainer"
    if choice != "auto":
        raise ValueError(f"old_logprobs must be 'auto', 'engine' or 'trainer', got {choice!r}.")
    if not engine_shares_policy or truncated_sampler:
        return True
    on = rows_without_injected_tokens(rollouts)  # [N]
    sampled = rollouts.loss_mask.bool() & on[:, None]  # [N, T]
    return bool((rollouts.token_temperature[sampled] != base_temperature).any())


def rows_without_injected_tokens(rollouts: Rollouts) -> torch.Tensor:
    """``[N]`` bool: rows with no injected (off-policy) token."""
    if rollouts.offpolicy_mask is None:
        return torch.ones(rollouts.num_rows, dtype=torch.bool, device=rollouts.temperature.device)
    return ~rollouts.offpolicy_mask.bool().any(-1)
