"""Off-policy maths: which slots guidance members take, advantages of groups with injected
members, and each source's share of the loss (spec §3, §4). Rows are tagged by source
(``Rollouts.sources``); the row surgery that puts members in place is ``stages.offpolicy``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

import torch

from rlvr_lightning.algorithms import advantages as adv_lib
from rlvr_lightning.algorithms.losses import AggMode, agg_loss
from rlvr_lightning.types import SOURCE_POLICY, Rollouts, Scored

BaselineMode = Literal["mixed", "on_policy"]
Composition = Literal["append", "replace_random", "replace_last"]


def sources_of(rollouts: Rollouts) -> tuple[str, ...]:
    """``[N]`` source tag of every row (all ``policy`` when the rollouts carry none)."""
    return rollouts.sources or (SOURCE_POLICY,) * rollouts.num_rows


def on_policy_rows(rollouts: Rollouts) -> torch.Tensor:
    """``[N]`` bool, rows sampled from the policy."""
    tags = sources_of(rollouts)
    return torch.tensor([s == SOURCE_POLICY for s in tags], device=rollouts.completion_ids.device)


def guidance_slots(
    correct: Sequence[bool],
    on_policy: Sequence[bool],
    k: int,
    composition: Composition,
    rng: random.Random | None = None,
) -> list[int]:
    """Positions in one group that ``k`` off-policy members take.

    - ``append`` (LUFFY, ExGRPO: sample ``G - k``, append ``k``): the last ``k`` on-policy
      positions, whatever their outcome. Samples of a group are exchangeable, so the group
      trains on ``G - k`` samples plus the members exactly as if only ``G - k`` had been
      drawn; the ``k`` samples it drops still count in the prompt's outcome
      (``outcomes.sampled_rows``).
    - ``replace_random`` (AMPO): ``min(k, #incorrect)`` incorrect on-policy positions drawn
      with ``rng``.
    - ``replace_last``: incorrect on-policy positions from the end, then correct ones (this
      project's earlier rule; it removes failures from the trained group).
    """
    on = [i for i in range(len(correct)) if on_policy[i]]
    wrong = [i for i in on if not correct[i]]
    if composition == "append":
        return on[len(on) - min(k, len(on)) :]
    if composition == "replace_random":
        if rng is None:
            raise ValueError("composition replace_random needs a random generator.")
        return sorted(rng.sample(wrong, min(k, len(wrong))))
    if composition == "replace_last":
        right = [i for i in on if correct[i]]
        return (wrong[::-1] + right[::-1])[:k]
    raise ValueError(
        f"composition must be 'append', 'replace_random' or 'replace_last', got {composition!r}."
    )


def floor_accuracy(
    total: torch.Tensor,
    accuracy: torch.Tensor,
    floor: torch.Tensor | float,
    weight: float,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AMPO's forced teacher reward on the accuracy reward's own scale (spec §4.3: "if its
    score was below 1, the reward is set to 1"): each row's accuracy value becomes
    ``max(accuracy, floor)`` (``floor``: a number or ``[n]``) and its total reward moves by
    ``weight`` times the change, so a
    teacher the verifier scored higher keeps its score and the other rewards (format, ...)
    keep theirs. Returns ``[n]`` ``(total, accuracy, correct)``, ``correct`` by ``threshold``.

    Hand check (accuracy and format rewards, weights 1 and 1, floor 1, threshold 1): a wrong
    but boxed teacher ``(total 1, acc 0)`` becomes ``(2, 1, True)``; a correct one ``(2, 1)``
    stays ``(2, 1, True)``; a not-applicable accuracy (NaN) counts as 0.
    """
    old = accuracy.float().nan_to_num(0.0)  # [n]
    new = torch.maximum(old, torch.as_tensor(floor, dtype=old.dtype, device=old.device))  # [n]
    raised = total.float() + weight * (new - old)  # [n]
    return raised.to(total.dtype), new, new >= threshold


def mixed_advantages(
    scored: Scored, estimator: str, baseline: BaselineMode, **estimator_kwargs: Any
) -> torch.Tensor:
    """Advantages ``[N]`` (``[N, T]`` for ``gae``) of a group that may hold off-policy members.

    The baseline rows are ``scored.baseline_mask`` when a callback set it, else all rows
    (``mixed``, LUFFY's script) or the on-policy rows (``on_policy``, LUFFY's ``grpo_split``).
    A mixed baseline is the module's estimator as usual; a restricted one supports ``grpo`` and
    ``dr_grpo``. ``scored.advantage_cap`` then bounds each row's advantage from above.
    ``estimator_kwargs`` go to ``advantages.compute_advantages`` (``gae``'s values and mask).
    """
    rollouts = scored.rollouts
    mask = scored.baseline_mask
    if mask is None and baseline == "on_policy" and rollouts.offpolicy_mask is not None:
        mask = on_policy_rows(rollouts)
    if mask is None or bool(mask.all()):
        adv = adv_lib.compute_advantages(
            scored.rewards, rollouts.group_size, estimator, **estimator_kwargs
        )
    elif estimator in ("grpo", "dr_grpo"):
        adv = adv_lib.masked_group_advantages(
            scored.rewards, rollouts.group_size, mask, normalize_std=estimator == "grpo"
        )
    else:
        raise ValueError(
            f"A baseline from part of the group needs estimator grpo or dr_grpo, not "
            f"{estimator!r}; set model.estimator, or offpolicy_baseline: mixed."
        )
    if scored.advantage_cap is not None:
        cap = scored.advantage_cap.to(adv)  # [N]
        adv = torch.minimum(adv, cap if adv.dim() == 1 else cap[:, None])
    return adv


# --- per-source update metrics --------------------------------------------------------------


def source_loss_terms(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    sources: Sequence[str],
    agg_mode: AggMode,
    norm_len: int,
) -> dict[str, torch.Tensor]:
    """Each source's share of ``agg_loss(|loss|)`` in a micro-batch, as additive terms.

    ``agg_loss`` is linear in the loss matrix for a fixed mask, so these terms, weighted like
    the micro-batch loss, sum to the mini-batch's; :func:`finish_source_metrics` divides.
    """
    absolute = loss_mat.detach().abs()  # [m, T]
    terms = {"source/_abs_loss": agg_loss(absolute, mask, agg_mode, norm_len=norm_len)}
    for tag in sorted(set(sources)):
        rows = torch.tensor([s == tag for s in sources], device=mask.device)[:, None]  # [m, 1]
        part = torch.where(rows, absolute, 0.0)  # [m, T]
        terms[f"source/{tag}/_abs_loss"] = agg_loss(part, mask, agg_mode, norm_len=norm_len)
    return terms


_OFFPOLICY_MEANS = ("offpolicy_weight_mean", "offpolicy_prob_mean")


def offpolicy_metric_terms(
    metrics: dict[str, torch.Tensor], offpolicy_mask: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Scale a micro-batch's means over injected tokens by their share of its tokens, so that
    accumulating them like the loss and dividing by the accumulated share
    (:func:`finish_source_metrics`) gives the mean over all injected tokens (exact for
    token-mean aggregation) instead of one diluted by micro-batches without such tokens."""
    valid = mask.bool()
    share = (offpolicy_mask.bool() & valid).sum() / valid.sum().clamp_min(1)
    out = dict(metrics)
    for key in _OFFPOLICY_MEANS:
        if key in out:
            out[key] = out[key] * share
    out["_offpolicy_share"] = share
    return out


def finish_source_metrics(
    sums: dict[str, float], rollouts: Rollouts, advantages: torch.Tensor, rows: torch.Tensor
) -> dict[str, float]:
    """Turn the accumulated ``_abs_loss`` terms into ``source/<tag>/loss_share``, finish the
    off-policy token means and add ``source/<tag>/advantage`` (mean over ``rows``)."""
    share = sums.pop("_offpolicy_share", None)
    for key in _OFFPOLICY_MEANS:
        if key in sums:
            sums[key] = sums[key] / share if share else 0.0
    total = sums.pop("source/_abs_loss", None)
    for key in [k for k in sums if k.endswith("/_abs_loss")]:
        value = sums.pop(key)
        if total:
            sums[key.replace("/_abs_loss", "/loss_share")] = value / total
    if rollouts.offpolicy_mask is None:
        return sums
    tags = sources_of(rollouts)
    adv = advantages.detach().float()
    adv = adv if adv.dim() == 1 else adv.mean(-1)  # [N]
    picked = rows.tolist()
    for tag in sorted({tags[i] for i in picked}):
        chosen = [i for i in picked if tags[i] == tag]
        sums[f"source/{tag}/advantage"] = float(adv[chosen].mean())
    return sums
