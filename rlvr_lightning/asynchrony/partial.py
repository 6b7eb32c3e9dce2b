"""Partial rollouts (CoPRIS): groups that decode across steps, and the pool that holds them.

A group joins the pool when its prompt is served and leaves when all its ``G`` rows have
finished (EOS or ``max_new_tokens``) and a step trains it, oldest first. Each row keeps what it
has written as *segments*: the tokens one policy version drew and their behaviour log-probs,
so a row continued under a newer version is importance-corrected token by token against the
version that drew each token (``algorithms.staleness.cross_stage_behaviour_logp``). A group's
age is its oldest segment's version; beyond ``max_staleness`` it is dropped and counted. Plain
data (``asynchrony.plain``), saved in checkpoints with the rows in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlvr_lightning.asynchrony.plain import from_plain, register, to_plain
from rlvr_lightning.types import PromptBatch


@register
@dataclass
class Segment:
    """Tokens of one row drawn by one policy version, with their behaviour log-probs."""

    version: int
    ids: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)


@register
@dataclass
class InFlight:
    """One prompt's group of ``G`` rows, decoding across steps.

    Args:
        batch: the prompt (a one-prompt ``PromptBatch``, after ``on_before_generate``).
        prompt: its token ids, unpadded.
        temperature: its sampling temperature.
        rows: ``G`` rows of segments (empty: nothing decoded yet).
        done: ``G`` flags: the row ended (EOS, or ``max_new_tokens`` written).
        truncated: ``G`` flags: it ended at ``max_new_tokens`` without EOS.
        served: prompt ids the data module served again for it (``hold_step``).
        step: the rollout step that admitted it.
    """

    batch: PromptBatch
    prompt: list[int]
    temperature: float
    rows: list[list[Segment]]
    done: list[bool]
    truncated: list[bool]
    served: list[str] = field(default_factory=list)
    step: int = 0

    @property
    def finished(self) -> bool:
        return all(self.done)

    def oldest(self) -> int | None:
        """The oldest version that wrote into the group (None: nothing written yet)."""
        versions = [s.version for row in self.rows for s in row]
        return min(versions) if versions else None

    def written(self, row: int) -> list[int]:
        return [t for s in self.rows[row] for t in s.ids]

    def append(self, row: int, version: int, ids: list[int], logp: list[float]) -> None:
        """Add tokens drawn by ``version`` to ``row`` (its last segment when the same)."""
        segments = self.rows[row]
        if not segments or segments[-1].version != version:
            segments.append(Segment(version))
        segments[-1].ids += ids
        segments[-1].logp += logp


class PartialPool:
    """Groups in flight, oldest first; the stale ones dropped and counted."""

    def __init__(self) -> None:
        self.groups: list[InFlight] = []
        self.dropped_groups = 0  # over the run
        self.dropped_rows = 0

    def __len__(self) -> int:
        return len(self.groups)

    def admit(self, group: InFlight) -> None:
        self.groups.append(group)

    def decoding(self, cap: int) -> list[InFlight]:
        """The ``cap`` oldest unfinished groups: those that decode now (CoPRIS's fixed
        concurrency; the others wait, with nothing written, so they age not)."""
        return [g for g in self.groups if not g.finished][:cap]

    def finished_count(self) -> int:
        """Finished groups a step could take: one per prompt (see ``take``)."""
        return len({g.batch.prompt_ids[0] for g in self.groups if g.finished})

    def drop_stale(self, version: int, max_staleness: int) -> int:
        """Remove the groups a row of which a version older than ``max_staleness`` wrote;
        returns how many."""
        stale = [
            g for g in self.groups if (o := g.oldest()) is not None and version - o > max_staleness
        ]
        for g in stale:
            self.groups.remove(g)
            self.dropped_groups += 1
            self.dropped_rows += len(g.rows)
        return len(stale)

    def take(self, k: int) -> list[InFlight]:
        """The ``k`` oldest finished groups (fewer when fewer finished), out of the pool; at
        most one per prompt: a prompt served again (replay) while its earlier group was still
        in flight trains in a later step, so a step's statistics see each prompt once."""
        taken: list[InFlight] = []
        for g in self.groups:
            ids = {t.batch.prompt_ids[0] for t in taken}
            if len(taken) < k and g.finished and g.batch.prompt_ids[0] not in ids:
                taken.append(g)
        self.groups = [g for g in self.groups if all(g is not t for t in taken)]
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [to_plain(g) for g in self.groups],
            "dropped_groups": self.dropped_groups,
            "dropped_rows": self.dropped_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.groups = [from_plain(g) for g in state["groups"]]
        self.dropped_groups = state["dropped_groups"]
        self.dropped_rows = state["dropped_rows"]
