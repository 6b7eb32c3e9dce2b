"""Off-policy group members: completions that were supplied rather than sampled (spec §3, §4).

A callback builds :class:`Member`\\ s (a reference solution, a teacher response, a stored
trajectory) and :func:`inject` puts each in the slot of one sampled row of its group
(:func:`guidance_slots` chooses which), so the batch keeps ``G`` consecutive rows per prompt
and everything downstream (advantages, the update) works unchanged; the prompt's outcome is
read from the snapshot taken before any hook (``outcomes.py``). The injected rows carry a
source tag, a token-level ``offpolicy_mask`` and, optionally, stored behaviour log-probs; the
update weights their tokens with ``losses.offpolicy_token_loss`` and the module's
``offpolicy_weighting`` option.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlvr_lightning import advantages as adv_lib
from rlvr_lightning.losses import AggMode, agg_loss
from rlvr_lightning.types import SOURCE_POLICY, PromptBatch, Rollouts, Scored

if TYPE_CHECKING:
    from rlvr_lightning.module import RLVRModule

BaselineMode = Literal["mixed", "on_policy"]
Composition = Literal["append", "replace_random", "replace_last"]


@dataclasses.dataclass(frozen=True)
class Member:
    """One off-policy completion for the group of batch row ``row // G``.

    Args:
        row: the rollout row ``[0, N)`` whose slot the member takes.
        source: its tag (``reference``, ``teacher``, ``experience``, ...); not ``policy``.
        text: the completion as text; EOS is appended after tokenising.
        token_ids: the completion as token ids (used as given, EOS included if wanted);
            exactly one of ``text`` and ``token_ids`` is set.
        behaviour_logp: ``[len(token_ids)]`` log-probs of the tokens under the policy that
            produced them (ExGRPO's stored trajectories); None = unknown, stored as 0
            (probability 1, LUFFY's convention for a teacher).
        temperature: temperature at which the policy scores the tokens (that of
            ``behaviour_logp`` when given).
        reward: total reward forced on the member (AMPO forces 1.0); None = verifier's.
        as_on_policy: the loss treats its tokens as the policy's own samples (the clipped
            policy loss, no ``offpolicy_weighting``; NPO's near-future guide, spec §6);
            ``behaviour_logp`` must then hold the current policy's log-probs. The row keeps
            its source tag, so it never counts in the prompt's outcome.
    """

    row: int
    source: str
    text: str | None = None
    token_ids: Sequence[int] | None = None
    behaviour_logp: Sequence[float] | None = None
    temperature: float = 1.0
    reward: float | None = None
    as_on_policy: bool = False

    def __post_init__(self) -> None:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("A Member needs exactly one of text and token_ids.")
        if self.source == SOURCE_POLICY:
            raise ValueError(f"An off-policy member cannot have the source tag {SOURCE_POLICY!r}.")
        if self.behaviour_logp is not None and (
            self.token_ids is None or len(self.behaviour_logp) != len(self.token_ids)
        ):
            raise ValueError("behaviour_logp needs token_ids of the same length.")
        if self.as_on_policy and self.behaviour_logp is None:
            raise ValueError("An as_on_policy member needs the policy's behaviour_logp.")


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


def _pad_right(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def replace_rows(
    rollouts: Rollouts,
    rows: Sequence[int],
    token_ids: Sequence[Sequence[int]],
    behaviour_logp: Sequence[Sequence[float] | None],
    sources: Sequence[str],
    temperatures: Sequence[float],
    texts: Sequence[str],
    pad_id: int,
    as_on_policy: Sequence[bool] | None = None,
) -> Rollouts:
    """New rollouts with rows ``rows`` replaced by the given completions, marked off-policy
    in ``offpolicy_mask`` unless ``as_on_policy`` says so for the row.

    The completion width grows when a member is longer than ``T``; prompts are kept.
    """
    old_t = rollouts.completion_ids.shape[1]
    width = max([old_t, *(len(t) for t in token_ids)])
    ids = _pad_right(rollouts.completion_ids, width, pad_id).clone()  # [N, T']
    mask = _pad_right(rollouts.completion_mask, width, 0).clone()  # [N, T']
    logp = _pad_right(rollouts.behaviour_logp, width, 0.0).clone()  # [N, T']
    off = (
        torch.zeros_like(mask)
        if rollouts.offpolicy_mask is None
        else _pad_right(rollouts.offpolicy_mask, width, 0).clone()
    )  # [N, T']
    temperature, truncated = rollouts.temperature.clone(), rollouts.truncated.clone()  # [N]
    position = rollouts.position_temperature
    position = None if position is None else _pad_right(position, width, 1.0).clone()  # [N, T']
    tags, completions = list(sources_of(rollouts)), list(rollouts.completions)
    own = [False] * len(rows) if as_on_policy is None else list(as_on_policy)
    for row, tok, lp, src, temp, text, mine in zip(
        rows, token_ids, behaviour_logp, sources, temperatures, texts, own, strict=True
    ):
        n = len(tok)
        ids[row], mask[row], logp[row], off[row] = pad_id, 0, 0.0, 0
        ids[row, :n] = torch.as_tensor(list(tok), dtype=ids.dtype)
        mask[row, :n], off[row, :n] = 1, 0 if mine else 1
        if lp is not None:
            logp[row, :n] = torch.as_tensor(list(lp), dtype=logp.dtype)
        temperature[row], truncated[row] = temp, False
        if position is not None:
            position[row] = temp
        tags[row], completions[row] = src, text
    return dataclasses.replace(
        rollouts,
        completion_ids=ids,
        completion_mask=mask,
        behaviour_logp=logp,
        temperature=temperature,
        truncated=truncated,
        completions=completions,
        sources=tuple(tags),
        offpolicy_mask=off,
        position_temperature=position,
    )


def select_rows(rollouts: Rollouts, rows: Sequence[int], group_size: int = 1) -> Rollouts:
    """The rollouts of ``rows`` only, regrouped with ``group_size``."""
    idx = torch.as_tensor(list(rows), dtype=torch.long, device=rollouts.completion_ids.device)
    tags = sources_of(rollouts)
    return dataclasses.replace(
        rollouts,
        prompt_ids=rollouts.prompt_ids[idx],
        prompt_mask=rollouts.prompt_mask[idx],
        completion_ids=rollouts.completion_ids[idx],
        completion_mask=rollouts.completion_mask[idx],
        behaviour_logp=rollouts.behaviour_logp[idx],
        temperature=rollouts.temperature[idx],
        truncated=rollouts.truncated[idx],
        completions=[rollouts.completions[i] for i in rows],
        group_size=group_size,
        sources=tuple(tags[i] for i in rows),
        offpolicy_mask=None if rollouts.offpolicy_mask is None else rollouts.offpolicy_mask[idx],
        position_temperature=None
        if rollouts.position_temperature is None
        else rollouts.position_temperature[idx],
    )


def prompt_rows(batch: PromptBatch, groups: Sequence[int]) -> PromptBatch:
    """The prompts of batch rows ``groups`` (repeats allowed), as a new batch."""
    return PromptBatch(
        prompt_ids=[batch.prompt_ids[g] for g in groups],
        messages=[batch.messages[g] for g in groups],
        columns={k: [v[g] for g in groups] for k, v in batch.columns.items()},
        temperatures=None
        if batch.temperatures is None
        else [batch.temperatures[g] for g in groups],
        position_temperatures=batch.position_temperatures,
    )


def scored_batch(module: RLVRModule, seen: PromptBatch | None, scored: Scored) -> PromptBatch:
    """The prompts of ``scored``'s rows: the module's ``step_batch`` (set by ``training_step``,
    which may have added prompts, e.g. dynamic sampling), else ``seen``, the batch a callback
    saw in ``on_before_rollout``."""
    rows, g = scored.rollouts.num_rows, scored.rollouts.group_size
    for batch in (getattr(module, "step_batch", None), seen):
        if batch is not None and len(batch) * g == rows:
            return batch
    raise RuntimeError(
        f"No prompt batch matches the {rows} scored rows (G={g}); a callback that changes the "
        "batch must come before the injecting callback."
    )


def encode(tokenizer, text: str, eos_id: int) -> list[int]:
    """Token ids of a completion text, without special tokens, then EOS."""
    return [*tokenizer(text, add_special_tokens=False).input_ids, eos_id]


def inject(
    module: RLVRModule, batch: PromptBatch, scored: Scored, members: Sequence[Member]
) -> Scored:
    """``scored`` with ``members`` in their rows: tokenised, scored by the module's rewards
    (the prompt's columns, the same verifier as the samples), rewards overridden where asked.

    Adds ``source/<tag>/count``, ``/reward`` and ``/accuracy`` to the scored metrics.
    """
    if not members:
        return _with_source_metrics(scored)
    g = scored.rollouts.group_size
    if len(batch) * g != scored.rollouts.num_rows:
        raise ValueError(
            f"{scored.rollouts.num_rows} scored rows do not match {len(batch)} prompts x G={g}: "
            "a callback that changes the batch must come before the injecting callback."
        )
    eos = module.engine.eos_ids[0] if hasattr(module.engine, "eos_ids") else None
    eos = module.tokenizer.eos_token_id if eos is None else eos
    tokens = [
        list(m.token_ids) if m.token_ids is not None else encode(module.tokenizer, m.text, eos)
        for m in members
    ]
    texts = [
        m.text if m.text is not None else module.tokenizer.decode(t, skip_special_tokens=True)
        for m, t in zip(members, tokens, strict=True)
    ]
    rows = [m.row for m in members]
    rollouts = replace_rows(
        scored.rollouts,
        rows,
        tokens,
        [m.behaviour_logp for m in members],
        [m.source for m in members],
        [m.temperature for m in members],
        texts,
        module.tokenizer.pad_token_id,
        [m.as_on_policy for m in members],
    )
    sub = module.score(prompt_rows(batch, [r // g for r in rows]), select_rows(rollouts, rows))
    idx = torch.as_tensor(rows, device=scored.rewards.device)
    rewards, correct = scored.rewards.clone(), scored.correct.clone()  # [N]
    rewards[idx] = sub.rewards.to(rewards)
    override = [(i, m.reward) for i, m in enumerate(members) if m.reward is not None]
    for i, value in override:
        rewards[rows[i]] = value
    correct[idx] = sub.correct.to(correct.device)
    per_function = {}
    for name, values in scored.per_function.items():
        values = values.clone()
        values[idx.to(values.device)] = sub.per_function[name].to(values)
        per_function[name] = values
    new = dataclasses.replace(
        scored, rollouts=rollouts, rewards=rewards, per_function=per_function, correct=correct
    )
    return _with_source_metrics(new)


def _with_source_metrics(scored: Scored) -> Scored:
    tags = sources_of(scored.rollouts)
    metrics = dict(scored.metrics)
    rewards = scored.rewards.detach().float().cpu()  # [N]
    for tag in sorted(set(tags)):
        rows = torch.tensor([t == tag for t in tags])  # [N]
        metrics[f"source/{tag}/count"] = float(rows.sum())
        metrics[f"source/{tag}/reward"] = float(rewards[rows].mean())
        metrics[f"source/{tag}/accuracy"] = float(scored.correct.cpu()[rows].float().mean())
    return dataclasses.replace(scored, metrics=metrics)


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
