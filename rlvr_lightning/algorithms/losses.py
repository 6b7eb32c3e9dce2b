"""Per-token policy losses, KL estimators, the value loss and the one reducer (off-policy
tokens: ``algorithms.offpolicy_losses``), :func:`agg_loss`.

Every policy loss has the signature of :class:`PolicyLossFn` and returns a ``[N, T]`` loss matrix
that is 0 on padding, plus detached scalar metrics. Reduction to a scalar is a separate choice
(:data:`AggMode`), so any loss combines with any aggregation. Formulas and defaults follow
``verl/trainer/ppo/core_algos.py`` (see ``specs/mechanisms.md`` §0 and §8).

Padded positions of ``logp`` and ``old_logp`` may hold anything (``-inf`` included): they are
replaced by 0 with ``torch.where`` before any arithmetic, so neither values nor gradients there
can turn into NaN.
"""

from __future__ import annotations

from typing import Literal, Protocol, get_args

import torch

from rlvr_lightning.algorithms.ops import masked_mean, masked_sum

AggMode = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]
KLKind = Literal["k1", "k2", "k3"]
LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]

# Bounds on log-ratios before exp: a stale or corrupted token must not overflow to inf.
LOG_RATIO_BOUND = 20.0
_GSPO_LOG_RATIO_MAX = 10.0


class PolicyLossFn(Protocol):
    """``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip)``.

    Args:
        logp: ``[N, T]`` log-probabilities of the sampled tokens under the current policy.
        old_logp: ``[N, T]`` the same under the policy that sampled them.
        advantages: ``[N]`` (broadcast over tokens) or ``[N, T]``; treated as constants.
        mask: ``[N, T]`` nonzero on completion tokens.
        clip_low: lower clip ``eps_low`` of the ratio, bound ``1 - clip_low``.
        clip_high: upper clip ``eps_high`` of the ratio, bound ``1 + clip_high``.
        dual_clip: ``c > 1`` caps the loss of negative-advantage tokens at ``-c * A``; None
            disables it.

    Returns:
        ``([N, T]`` loss, 0 on padding; ``{name: detached scalar}`` metrics).
    """

    def __call__(
        self,
        logp: torch.Tensor,
        old_logp: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        clip_low: float,
        clip_high: float,
        dual_clip: float | None = None,
    ) -> LossOutput: ...


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` on tokens sampled from ``pi`` (Schulman 2020).

    With ``x = logp - ref_logp``: ``k1 = x``; ``k2 = x**2 / 2``;
    ``k3 = exp(-x) + x - 1 = pi_ref/pi - log(pi_ref/pi) - 1`` (verl's ``low_var_kl``).
    """
    x = logp - ref_logp  # [N, T]
    match kind:
        case "k1":
            return x
        case "k2":
            return 0.5 * x**2
        case "k3":
            # As verl's low_var_kl: clamp x to [-20, 20] so exp stays finite, then k3 to
            # [-10, 10] so a few far-off tokens cannot dominate the KL term.
            x = x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
            return (torch.exp(-x) + x - 1).clamp(-10.0, 10.0)
    raise ValueError(f"Unknown KL estimator {kind!r}; use 'k1', 'k2' or 'k3'.")


def agg_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: AggMode, norm_len: int | None = None
) -> torch.Tensor:
    """Reduce a ``[N, T]`` per-token loss to a scalar; the only loss reducer of the package.

    Modes (verl's names): ``token-mean`` = sum over valid tokens / their count;
    ``seq-mean-token-mean`` = per-row token mean, then mean over rows with at least one valid
    token; ``seq-mean-token-sum`` = per-row token sum, then mean over all ``N`` rows;
    ``seq-mean-token-sum-norm`` = total sum / ``(N * norm_len)`` (Dr. GRPO). The last divides
    by ``N`` too, unlike current verl's ``sum / norm_len``, so its scale does not grow with the
    batch size.
    """
    rows = max(loss_mat.shape[0], 1)
    match mode:
        case "token-mean":
            return masked_mean(loss_mat, mask)
        case "seq-mean-token-mean":
            seq_loss = masked_mean(loss_mat, mask, dim=-1)  # [N]
            return masked_mean(seq_loss, mask.bool().any(-1))
        case "seq-mean-token-sum":
            return masked_sum(loss_mat, mask) / rows
        case "seq-mean-token-sum-norm":
            if norm_len is None or norm_len <= 0:
                raise ValueError(
                    "agg_loss mode 'seq-mean-token-sum-norm' needs norm_len > 0, the constant "
                    f"length to divide by (e.g. max_new_tokens); got norm_len={norm_len}."
                )
            return masked_sum(loss_mat, mask) / (rows * norm_len)
    raise ValueError(f"Unknown loss aggregation mode {mode!r}; use one of {get_args(AggMode)}.")


def agg_units(mask: torch.Tensor, mode: AggMode) -> int:
    """How many units ``agg_loss(mode)`` averages over: valid tokens, or rows for ``seq-*``.

    ``seq-mean-token-mean`` counts only rows with at least one valid token, as it averages over
    those. Weighting each micro-batch loss by ``agg_units(micro) / agg_units(full)`` makes the
    sum over micro-batches equal ``agg_loss`` of the whole mini-batch.
    """
    match mode:
        case "token-mean":
            return int(mask.bool().sum())
        case "seq-mean-token-mean":
            return int(mask.bool().any(-1).sum())
        case "seq-mean-token-sum" | "seq-mean-token-sum-norm":
            return int(mask.shape[0])
    raise ValueError(f"Unknown loss aggregation mode {mode!r}; use one of {get_args(AggMode)}.")


def agg_weight(mask_micro: torch.Tensor, mode: AggMode, total_units: int) -> float:
    """Gradient-accumulation weight of a micro-batch: ``agg_units(micro) / total_units``.

    ``total_units`` is ``agg_units`` of the whole mini-batch; when it is 0 nothing is averaged
    and the weight is 0, so an all-padding mini-batch contributes no gradient instead of NaN.
    """
    if total_units <= 0:
        return 0.0
    return agg_units(mask_micro, mode) / total_units


def valid_inputs(
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(valid, logp, old_logp, adv)``, all ``[N, T]``, padding zeroed, advantages detached."""
    valid = mask.bool()  # [N, T]
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [N, 1]
    elif advantages.shape != logp.shape:
        raise ValueError(
            f"advantages must be [N] or [N, T] = {tuple(logp.shape)}; "
            f"got {tuple(advantages.shape)}."
        )
    # Advantages are constants of the policy gradient; a graph attached to them is a bug.
    adv = torch.where(valid, advantages.detach(), 0.0)  # [N, T]
    return valid, torch.where(valid, logp, 0.0), torch.where(valid, old_logp, 0.0), adv


def _frac(condition: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Detached fraction of valid tokens where ``condition`` holds."""
    return masked_mean(condition.float(), valid).detach()


def _clipped_surrogate(
    ratio: torch.Tensor,
    adv: torch.Tensor,
    valid: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> LossOutput:
    """PPO's ``max(-w*A, -clip(w)*A)``, optional dual clip, and the clip fractions.

    The fractions count exactly the tokens whose gradient the clip removes: a low ratio only
    matters for ``A < 0`` and a high one only for ``A > 0``.
    """
    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(lower, upper))  # [N, T]
    metrics = {
        "clip_frac_low": _frac((adv < 0) & (ratio < lower), valid),
        "clip_frac_high": _frac((adv > 0) & (ratio > upper), valid),
        "ratio_mean": masked_mean(ratio, valid).detach(),
    }
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c, 3.0); got {dual_clip}.")
        cap = -dual_clip * adv  # [N, T]
        capped = (adv < 0) & (loss > cap)  # [N, T]
        loss = torch.where(capped, cap, loss)
        metrics["clip_frac_dual"] = _frac(capped, valid)
    return torch.where(valid, loss, 0.0), metrics


def _old_kl(logp: torch.Tensor, old_logp: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Masked mean of k3 for ``KL(pi_old || pi)``: tokens come from ``pi_old``, hence the order."""
    return masked_mean(kl_estimate(old_logp, logp, "k3"), valid).detach()


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> LossOutput:
    """Token-level PPO/GRPO/DAPO loss ``-min(w*A, clip(w, 1-clip_low, 1+clip_high)*A)``.

    ``w = exp(logp - old_logp)`` with the log-ratio clamped to [-20, 20]. With ``dual_clip=c``
    the loss of ``A < 0`` tokens is capped at ``-c*A`` (verl's ``clip_ratio_c``). Metrics:
    ``clip_frac_low``, ``clip_frac_high``, ``clip_frac_dual`` (only with dual clip),
    ``approx_kl_old`` (k3 estimate of ``KL(pi_old || pi)``), ``ratio_mean``.
    """
    valid, logp, old_logp, adv = valid_inputs(logp, old_logp, advantages, mask)
    log_ratio = (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # [N, T]
    loss_mat, metrics = _clipped_surrogate(
        torch.exp(log_ratio), adv, valid, clip_low, clip_high, dual_clip
    )
    metrics["approx_kl_old"] = _old_kl(logp, old_logp, valid)
    return loss_mat, metrics


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    dual_clip: float | None = None,
) -> LossOutput:
    """GSPO-token: PPO's clipped surrogate on ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]``.

    ``s_i = exp(mean_t log w_{i,t})`` over the row's valid tokens; ``log s_{i,t}`` is clamped at
    10 as in verl. Its value is ``s_i`` and its gradient that of GSPO's sequence-level ratio, so
    with one advantage per row and ``seq-mean-token-mean`` it is exactly GSPO, while per-token
    advantages remain possible. ``dual_clip`` is applied as in PPO (verl's GSPO has none); the
    clip fractions and ``ratio_mean`` are over tokens, each carrying its row's ``s_i``.
    """
    valid, logp, old_logp, adv = valid_inputs(logp, old_logp, advantages, mask)
    seq_log_ratio = masked_mean(logp - old_logp, valid, dim=-1)  # [N]
    log_s = seq_log_ratio.detach()[:, None] + logp - logp.detach()  # [N, T]
    seq_ratio = torch.exp(log_s.clamp(max=_GSPO_LOG_RATIO_MAX))  # [N, T]
    loss_mat, metrics = _clipped_surrogate(seq_ratio, adv, valid, clip_low, clip_high, dual_clip)
    metrics["approx_kl_old"] = _old_kl(logp, old_logp, valid)
    return loss_mat, metrics


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 10.0,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> LossOutput:
    """CISPO (MiniMax-M1): ``-sg(clip(w, 1-clip_low, 1+clip_high)) * A * logp`` per token.

    The clipped weight carries no gradient, so every token keeps a REINFORCE gradient
    ``-clip(w) * A`` instead of being dropped by PPO's ``min``. Defaults are verl's example
    (``clip_low=10`` leaves no lower bound). ``dual_clip`` is accepted and ignored: the weight
    is already bounded above. Clip fractions count clipped weights whatever the sign of ``A``.
    """
    del dual_clip
    valid, logp, old_logp, adv = valid_inputs(logp, old_logp, advantages, mask)
    ratio = torch.exp((logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # [N, T]
    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    weight = ratio.clamp(lower, upper).detach()  # [N, T]
    loss_mat = torch.where(valid, -weight * adv * logp, 0.0)  # [N, T]
    metrics = {
        "clip_frac_low": _frac(ratio < lower, valid),
        "clip_frac_high": _frac(ratio > upper, valid),
        "approx_kl_old": _old_kl(logp, old_logp, valid),
        "ratio_mean": masked_mean(ratio, valid).detach(),
    }
    return loss_mat, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.5,
) -> LossOutput:
    """PPO's clipped value loss ``½ · mean_t max((V - R)², (clip(V, V_old ± ε_v) - R)²)``.

    The mean is over the valid tokens (token-mean); ``clip_range`` is ``ε_v`` (verl's
    ``cliprange_value``, 0.5), None for the plain ``½ (V - R)²``. Where the clipped term wins,
    the gradient is 0: the value cannot move more than ``ε_v`` from where it was at rollout.

    Args:
        values: ``[N, T]`` current values ``V_θ``.
        old_values: ``[N, T]`` values at rollout time ``V_old`` (constants).
        returns: ``[N, T]`` targets ``R`` (constants).
        mask: ``[N, T]`` nonzero on completion tokens.
        clip_range: ``ε_v``, or None.

    Returns:
        (scalar loss; detached metrics ``value_clip_frac`` (share of tokens where the clipped
        term is the larger) and ``value_mean``).
    """
    valid = mask.bool()  # [N, T]
    v = torch.where(valid, values, 0.0)  # [N, T]
    ret = torch.where(valid, returns.detach(), 0.0)  # [N, T]
    unclipped = (v - ret) ** 2  # [N, T]
    loss_mat, clipped_wins = unclipped, torch.zeros_like(valid)
    if clip_range is not None:
        old = torch.where(valid, old_values.detach(), 0.0)  # [N, T]
        clipped = (old + (v - old).clamp(-clip_range, clip_range) - ret) ** 2  # [N, T]
        loss_mat = torch.maximum(unclipped, clipped)
        clipped_wins = clipped > unclipped
    metrics = {
        "value_clip_frac": _frac(clipped_wins, valid),
        "value_mean": masked_mean(v.detach(), valid),
    }
    return 0.5 * masked_mean(loss_mat, valid), metrics
