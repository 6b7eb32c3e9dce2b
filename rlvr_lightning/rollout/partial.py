"""Rows continued across policy versions (partial rollouts, CoPRIS): one chunk of decoding for
rows that already hold tokens, and the finished rows assembled as ``Rollouts``.

Any engine continues them (``RolloutEngine.generate`` on prompt + tokens so far, one sample
each), as multi-turn trajectories are continued. The pool that keeps rows between steps is
``asynchrony.partial``; ``stages.partial`` runs the two in a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.algorithms.staleness import cross_stage_behaviour_logp
from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.multiturn import left_pad
from rlvr_lightning.types import Rollouts, Sampling


@dataclasses.dataclass(frozen=True)
class Continued:
    """What one chunk added to a row: tokens, their behaviour log-probs, whether it ended."""

    ids: list[int]
    logp: list[float]
    eos: bool


def continue_rows(
    engine: RolloutEngine,
    pad_id: int,
    contexts: Sequence[list[int]],
    room: Sequence[int],
    sampling: Sampling,
    temperatures: torch.Tensor | None,
) -> list[Continued]:
    """Continue each of ``contexts`` (prompt + tokens so far) by up to ``sampling
    .max_new_tokens`` tokens, and no more than its ``room``; ``temperatures``: ``[N]``."""
    ids, mask = left_pad(list(contexts), pad_id)
    chunk = dataclasses.replace(sampling, group_size=1, max_new_tokens=max(room))
    out = engine.generate(ids, mask, chunk, temperatures)
    added = []
    for j, space in enumerate(room):
        keep = out.completion_mask[j].bool()
        new, logp = out.completion_ids[j][keep].tolist(), out.behaviour_logp[j][keep].tolist()
        eos = not bool(out.truncated[j]) and len(new) <= space
        added.append(Continued(new[:space], logp[:space], eos))
    return added


def assemble(
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    segments: Sequence[Sequence[tuple[list[int], list[float]]]],
    truncated: Sequence[bool],
    temperatures: Sequence[float],
    group_size: int,
) -> Rollouts:
    """``N`` finished rows as ``Rollouts``: ``prompts[i]`` (unpadded ids), then row ``i``'s
    segments ``(ids, behaviour log-probs)`` in the order they were drawn, each log-prob the
    drawing version's (``cross_stage_behaviour_logp``)."""
    pad = tokenizer.pad_token_id
    p_ids, p_mask = left_pad(list(prompts), pad)
    tokens = [[t for ids, _ in row for t in ids] for row in segments]
    c_ids, c_mask = _right_pad(tokens, pad)
    logp, mask = cross_stage_behaviour_logp(*_segment_tensors(segments))
    # The join is as wide as the segments' widths summed; rows whose long segments differ
    # (one long first, another long later) leave only padding past the longest row.
    width = c_mask.shape[1]
    if bool(mask[:, width:].any()) or not torch.equal(mask[:, :width].long(), c_mask):
        raise ValueError("partial rows: segment tokens and log-probs differ in length.")
    logp = logp[:, :width]
    texts = tokenizer.batch_decode(c_ids * c_mask + pad * (1 - c_mask), skip_special_tokens=True)
    return Rollouts(
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        completion_ids=c_ids,
        completion_mask=c_mask,
        behaviour_logp=logp * c_mask,
        temperature=torch.tensor(list(temperatures), dtype=torch.float32),
        truncated=torch.tensor(list(truncated)),
        completions=texts,
        group_size=group_size,
    )


def _right_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask


def _segment_tensors(
    segments: Sequence[Sequence[tuple[list[int], list[float]]]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Segment ``i`` of every row as ``[N, T_i]`` log-probs and mask (empty where a row has
    fewer segments)."""
    count = max(len(row) for row in segments)
    logps, masks = [], []
    for i in range(count):
        part = [row[i][1] if i < len(row) else [] for row in segments]
        width = max(1, max(len(x) for x in part))
        lp = torch.zeros(len(part), width)
        m = torch.zeros(len(part), width, dtype=torch.long)
        for r, values in enumerate(part):
            lp[r, : len(values)] = torch.tensor(values, dtype=torch.float32)
            m[r, : len(values)] = 1
        logps.append(lp)
        masks.append(m)
    return logps, masks
