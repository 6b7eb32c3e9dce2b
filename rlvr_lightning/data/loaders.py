"""The ``DataLoader``s of ``RLVRDataModule``: an endless training stream and batched eval lists.

Both yield ready ``PromptBatch``es (``batch_size=None``, an identity collate) and draw their
iterator seed from a generator of their own, never from the global RNG.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from rlvr_lightning.data.stream import PromptStream
from rlvr_lightning.types import PromptBatch


def _keep(batch: PromptBatch) -> PromptBatch:
    """Collate function of ``batch_size=None`` loaders: the dataset already yields batches."""
    return batch


def _loader_rng(seed: int) -> torch.Generator:
    # Creating a DataLoader iterator draws a seed; from its own generator it leaves the
    # global RNG (which sampling uses) alone, so resumes and validation don't shift it.
    return torch.Generator().manual_seed(seed)


def train_loader(stream: PromptStream, seed: int) -> DataLoader:
    """The loader of the endless training stream."""
    # An IterableDataset, not a map-style one: under DDP Lightning would replace a map-style
    # dataset's sampler with a DistributedSampler and silently re-split the groups. The
    # stream shards by rank itself, and being endless it lets max_steps decide the length.
    return DataLoader(stream, batch_size=None, collate_fn=_keep, generator=_loader_rng(seed))


def eval_loader(batches: list[PromptBatch], seed: int) -> DataLoader:
    """The loader of a fixed list of evaluation batches, in order."""
    # A list is a map-style dataset: under DDP Lightning shards it across ranks.
    return DataLoader(
        batches, batch_size=None, shuffle=False, collate_fn=_keep, generator=_loader_rng(seed)
    )
