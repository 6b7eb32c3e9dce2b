"""The training prompt stream: a resumable walk over reshuffled epochs, and the step tickets.

Under a Trainer the ``PromptStream`` yields ``StepTicket``s, and the data module turns each
into a ``PromptBatch`` in ``on_before_batch_transfer``, which Lightning calls when the step
starts (after it has prefetched the next ticket). So a batch is composed after the previous
step's statistics are in, and the position saved in a checkpoint is exactly what has been
trained on, with nothing prefetched in between.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import IterableDataset

from rlvr_lightning.data.sources import Example
from rlvr_lightning.types import PromptBatch


def rng_state(rng: random.Random) -> list[Any]:
    """A ``random.Random`` state as plain lists, which ``weights_only`` checkpoints can hold."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: list[Any]) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def epoch_order(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits the examples."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_examples, generator=generator)  # [num_examples]


@dataclass
class StreamCursor:
    """Position in the fresh-prompt walk: epoch ``epoch``, ``index`` examples of its order used."""

    epoch: int = 0
    index: int = 0


class FreshPrompts:
    """Fresh prompts in epoch order, continuing from a ``StreamCursor``.

    Epoch ``e`` visits the examples in ``epoch_order(n, seed, e)``. A request that does not fit
    in what is left of the epoch starts the next one (so one request never repeats a prompt);
    prompts in ``exclude`` (replays served in the same step) are skipped.
    """

    def __init__(self, examples: Sequence[Example], seed: int, cursor: StreamCursor) -> None:
        self.examples, self.seed, self.cursor = examples, seed, cursor
        self._order, self._order_epoch = torch.empty(0, dtype=torch.long), -1  # [n] once filled

    def _position(self) -> int:
        if self._order_epoch != self.cursor.epoch:
            self._order = epoch_order(len(self.examples), self.seed, self.cursor.epoch)
            self._order_epoch = self.cursor.epoch
        return int(self._order[self.cursor.index])

    def _next_epoch(self) -> None:
        self.cursor.epoch, self.cursor.index = self.cursor.epoch + 1, 0

    def take(self, n: int, exclude: Container[str] = frozenset()) -> list[Example]:
        if n > len(self.examples):
            raise ValueError(f"Cannot take {n} distinct prompts from {len(self.examples)}.")
        if self.cursor.index + n > len(self.examples):
            self._next_epoch()
        picked: list[Example] = []
        seen: set[str] = set()
        scanned = 0
        while len(picked) < n:
            if self.cursor.index >= len(self.examples):
                self._next_epoch()
            example = self.examples[self._position()]
            self.cursor.index += 1
            scanned += 1
            if example.prompt_id in exclude or example.prompt_id in seen:
                if scanned > 2 * len(self.examples):
                    raise ValueError(
                        f"Only {len(picked)} of {n} fresh prompts are not already in this step "
                        "or retired (MixedPolicyGuidance retire_solved); add training data, "
                        "lower the replay/bank share or set retire_solved: false."
                    )
                continue
            picked.append(example)
            seen.add(example.prompt_id)
        return picked


class StepTicket:
    """Placeholder for a training batch that the data module composes when the step starts."""

    def __repr__(self) -> str:
        return "StepTicket()"


class PromptStream(IterableDataset):
    """Endless training batches: composed at once, or as tickets composed at step time.

    Args:
        compose: returns the next step's ``PromptBatch`` for this rank.
        lazy: yield ``StepTicket``s (under a Trainer; the data module composes them in
            ``on_before_batch_transfer``) instead of composing when iterated.
    """

    def __init__(self, compose: Callable[[], PromptBatch], lazy: bool) -> None:
        self.compose, self.lazy = compose, lazy

    def __iter__(self) -> Iterator[PromptBatch | StepTicket]:
        while True:
            yield StepTicket() if self.lazy else self.compose()
