"""Asynchronous rollouts' maths: how stale a sample is, which samples may train, and the
behaviour log-probs of a trajectory that several policy versions wrote (cross-stage IS).

A *policy version* counts the weight pushes: version ``v`` is the policy after ``v`` updates.
A sample drawn by version ``v`` and trained when the trainer holds version ``c`` lags
``c - v`` versions (its staleness). Pure maths on ``[N]`` / ``[N, T]`` tensors; the queue and the
schedule are in ``rlvr_lightning.asynchrony``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def staleness(current_version: int, versions: torch.Tensor) -> torch.Tensor:
    """``[N]`` versions each sample lags the trainer's ``current_version`` (``versions``:
    ``[N]``, the version that produced each sample; for a trajectory continued across versions,
    its oldest segment's). Raises on a sample from the future: its version was never pushed."""
    lag = current_version - versions.long()  # [N]
    if bool((lag < 0).any()):
        raise ValueError(
            f"A sample carries policy version {int(versions.max())} but the trainer holds "
            f"version {current_version}: versions must come from the trainer's own pushes."
        )
    return lag


def within_staleness(
    current_version: int, versions: torch.Tensor, max_staleness: int
) -> torch.Tensor:
    """``[N]`` bool: samples that lag at most ``max_staleness`` versions (the others are
    dropped before the loss)."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}.")
    return staleness(current_version, versions) <= max_staleness


def staleness_shares(lags: torch.Tensor, max_staleness: int) -> dict[int, float]:
    """Share of the samples at each lag ``0..max_staleness`` (``lags``: ``[N]``): the
    histogram logged as ``async/staleness_<k>``. Empty input: every share 0."""
    n = max(int(lags.numel()), 1)
    return {k: float((lags == k).sum()) / n for k in range(max_staleness + 1)}


def cross_stage_behaviour_logp(
    segments: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate, row by row, the behaviour log-probs of a trajectory's segments (CoPRIS's
    cross-stage importance sampling): segment ``i`` is what policy version ``i`` wrote when the
    trajectory was continued under it, ``[N, T_i]`` right-padded with its ``[N, T_i]`` mask.

    Returns ``([N, T] log-probs, [N, T] mask)`` with ``T = sum(T_i)``: row ``r`` holds segment 0's
    real tokens, then segment 1's, ..., then padding (0). Each token keeps the log-prob of the
    version that drew it, so ``correction.correction_weights(π_old, this, mask, ...)`` gives
    every token ``π_old / π_{version that drew it}`` (``level="token"``), or the product of those
    ratios over the whole row (``level="sequence"``).
    """
    if len(segments) != len(masks) or not segments:
        raise ValueError("cross_stage_behaviour_logp needs one mask per segment, at least one.")
    n = segments[0].shape[0]
    width = sum(int(s.shape[1]) for s in segments)
    logp = torch.zeros(n, width, dtype=segments[0].dtype)  # [N, T]
    mask = torch.zeros(n, width, dtype=masks[0].dtype)  # [N, T]
    filled = torch.zeros(n, dtype=torch.long)  # [N] tokens written so far in each row
    for seg, m in zip(segments, masks, strict=True):
        real = m.bool()  # [N, T_i]
        # Position of each real token: after the row's earlier segments, in order.
        pos = filled[:, None] + real.long().cumsum(-1) - 1  # [N, T_i]
        rows = torch.arange(n)[:, None].expand_as(pos)  # [N, T_i]
        logp[rows[real], pos[real]] = seg[real]
        mask[rows[real], pos[real]] = m[real]
        filled += real.sum(-1)
    return logp, mask
