"""Partial rollouts in a step (CoPRIS): admit the step's prompts to the pool, decode the groups
in flight chunk by chunk until enough have finished, and make the finished ones a round.

Helpers on data (the pool, an engine, a tokenizer); ``stages.asynchronous`` calls them from the
module's step. Order within a step, this project's choice where CoPRIS is silent: the new
prompts join behind the groups already in flight; the ``concurrent_rollouts`` oldest unfinished
groups decode; decoding stops at the first chunk boundary with as many finished groups as the
step has prompts (early termination), or when nothing is left to decode; the oldest finished
groups train, and any finished beyond that wait for the next step.
"""

from __future__ import annotations

import dataclasses
from functools import reduce

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.algorithms.staleness import staleness_shares
from rlvr_lightning.asynchrony.partial import InFlight, PartialPool
from rlvr_lightning.rollout.base import RolloutEngine
from rlvr_lightning.rollout.partial import assemble, continue_rows
from rlvr_lightning.stages.dynamic import concat_prompt_batches
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling


def one_prompt(batch: PromptBatch, i: int) -> PromptBatch:
    """Prompt ``i`` of ``batch`` as a batch of one (its columns and temperature with it)."""
    return PromptBatch(
        [batch.prompt_ids[i]],
        [batch.messages[i]],
        columns={k: [v[i]] for k, v in batch.columns.items()},
        temperatures=None if batch.temperatures is None else [batch.temperatures[i]],
    )


def admit(
    pool: PartialPool,
    batch: PromptBatch,
    prompts: tuple[torch.Tensor, torch.Tensor],
    sampling: Sampling,
    served: list[str],
    step: int,
) -> None:
    """``batch``'s prompts (``[B, P]`` left-padded ids and mask) join ``pool`` as groups of
    ``sampling.group_size`` rows with nothing written."""
    g = sampling.group_size
    for i, (ids, mask) in enumerate(zip(*prompts, strict=True)):
        own = batch.temperatures[i] if batch.temperatures is not None else None
        pid = batch.prompt_ids[i]
        pool.admit(
            InFlight(
                batch=one_prompt(batch, i),
                prompt=ids[mask.bool()].tolist(),
                temperature=sampling.temperature if own is None else float(own),
                rows=[[] for _ in range(g)],
                done=[False] * g,
                truncated=[False] * g,
                served=[s for s in served if s == pid],
                step=step,
            )
        )


def decode_until(
    engine: RolloutEngine,
    pad_id: int,
    pool: PartialPool,
    sampling: Sampling,
    limits: tuple[int, int, int],
    version: int,
) -> int:
    """Decode ``pool``'s groups in flight, ``limits = (concurrent groups, chunk tokens,
    finished groups wanted)``, under policy ``version``; returns the chunks decoded."""
    cap, chunk, wanted = limits
    chunks = 0
    while pool.finished_count() < wanted:
        rows = [(g, r) for g in pool.decoding(cap) for r in range(len(g.rows)) if not g.done[r]]
        if not rows:
            break
        room = [sampling.max_new_tokens - len(g.written(r)) for g, r in rows]
        temps = None
        if sampling.temperature > 0:
            temps = torch.tensor([g.temperature for g, _ in rows])  # [N]
        contexts = [g.prompt + g.written(r) for g, r in rows]
        steps = [min(chunk, space) for space in room]
        added = continue_rows(engine, pad_id, contexts, steps, sampling, temps)
        for (g, r), new, space in zip(rows, added, room, strict=True):
            g.append(r, version, new.ids, new.logp)
            full = len(new.ids) >= space
            g.done[r] = new.eos or full
            g.truncated[r] = full and not new.eos
        chunks += 1
    return chunks


def round_of(
    tokenizer: PreTrainedTokenizerBase, groups: list[InFlight], device: torch.device
) -> tuple[PromptBatch, Rollouts]:
    """Finished ``groups`` as one round: their prompts and their rows."""
    g = len(groups[0].rows)
    batch = reduce(concat_prompt_batches, [x.batch for x in groups])
    rows = [(x, r) for x in groups for r in range(g)]
    rollouts = assemble(
        tokenizer,
        [x.prompt for x, _ in rows],
        [[(s.ids, s.logp) for s in x.rows[r]] for x, r in rows],
        [x.truncated[r] for x, r in rows],
        [x.temperature for x, _ in rows],
        g,
    )
    moved = {
        f.name: getattr(rollouts, f.name).to(device)
        for f in dataclasses.fields(rollouts)
        if torch.is_tensor(getattr(rollouts, f.name))
    }
    return batch, dataclasses.replace(rollouts, **moved)


def partial_metrics(
    pool: PartialPool, groups: list[InFlight], version: int, max_staleness: int, chunks: int
) -> dict[str, float]:
    """``async/*`` metrics of a partial-rollout step: the trained rows' staleness (their
    oldest segment's), rows continued across versions, what stays in flight, drops."""
    lags = torch.tensor(
        [version - (x.oldest() or version) for x in groups for _ in x.rows], dtype=torch.long
    )  # [N]
    crossed = [len({s.version for s in row}) > 1 for x in groups for row in x.rows]
    out = {f"async/staleness_{k}": v for k, v in staleness_shares(lags, max_staleness).items()}
    out.update(
        {
            "async/partial_cross_stage_rows": float(sum(crossed)),
            "async/partial_in_flight": float(len(pool)),
            "async/partial_chunks": float(chunks),
            "async/queue_depth": float(len(pool)),
            "async/policy_version": float(version),
            "async/dropped_rounds": float(pool.dropped_groups),
            "async/dropped_rows": float(pool.dropped_rows),
        }
    )
    return out
