"""``RLVRDataModule``: an endless, resumable stream of training prompts and fixed validation.

Training batches come from ``PromptStream``, an ``IterableDataset`` whose position lives in a
``StreamCursor`` that the data module saves in checkpoints, so a resumed run sees exactly the
prompt sequence an uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from rlvr_lightning.data.sources import (
    Example,
    drop_overlap,
    holdout_split,
    is_path_source,
    load_examples,
)
from rlvr_lightning.data.tasks import is_task_source, task_examples, validate_task
from rlvr_lightning.types import PromptBatch, StepOutput

Messages = list[dict[str, str]]
Position = tuple[int, int]  # (epoch, examples of that epoch's permutation already consumed)

MAX_IN_FLIGHT = 2
"""Batches the stream may run ahead of training: the one being trained plus the one Lightning
prefetches (it always prefetches one batch of an iterable without ``__len__``)."""


def to_messages(prompt: str, system_prompt: str | None, instruction: str | None) -> Messages:
    """Chat messages of a prompt: optional system turn, then the user turn.

    The instruction follows the question after a blank line, so the question reads as written;
    ``None`` or ``""`` adds nothing.
    """
    content = f"{prompt}\n\n{instruction}" if instruction else prompt
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return [*system, {"role": "user", "content": content}]


def collate_examples(
    examples: Sequence[Example], system_prompt: str | None, instruction: str | None
) -> PromptBatch:
    """A ``PromptBatch`` of examples; a column missing from some examples is ``None`` there."""
    names = list(dict.fromkeys(name for e in examples for name in e.columns))
    return PromptBatch(
        prompt_ids=[e.prompt_id for e in examples],
        messages=[to_messages(e.prompt, system_prompt, instruction) for e in examples],
        columns={name: [e.columns.get(name) for e in examples] for name in names},
    )


def epoch_order(num_examples: int, seed: int, epoch: int) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits the examples."""
    generator = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(num_examples, generator=generator)  # [num_examples]


@dataclass
class StreamCursor:
    """Where the training stream stands; shared by ``PromptStream`` and the data module.

    ``index`` counts examples of epoch ``epoch``'s permutation consumed by all ranks together.
    With ``track_in_flight``, ``in_flight`` holds the start of every batch handed out but not yet
    acknowledged by a finished training step, so a checkpoint resumes at the first untrained one.
    """

    epoch: int = 0
    index: int = 0
    track_in_flight: bool = False
    in_flight: deque[Position] = field(default_factory=deque)

    def next_start(self, step: int, num_examples: int) -> Position:
        """Start of the next batch; an epoch that cannot fill a whole step ends early."""
        if self.index + step > num_examples:
            self.epoch, self.index = self.epoch + 1, 0
        return self.epoch, self.index

    def advance(self, step: int) -> None:
        if self.track_in_flight:
            self.in_flight.append((self.epoch, self.index))
            if len(self.in_flight) > MAX_IN_FLIGHT:
                warnings.warn(
                    "RLVRDataModule.on_step_output is not called after training steps, so a "
                    "resumed run may repeat up to two batches; call it from training_step.",
                    stacklevel=2,
                )
                self.in_flight.popleft()
        self.index += step

    def acknowledge(self) -> None:
        """The oldest batch handed out has been trained on."""
        if self.in_flight:
            self.in_flight.popleft()

    @property
    def resume_point(self) -> Position:
        return self.in_flight[0] if self.in_flight else (self.epoch, self.index)

    def rewind(self) -> None:
        """Forget batches handed out but never trained (a new iterator discards them)."""
        self.epoch, self.index = self.resume_point
        self.in_flight.clear()


class PromptStream(IterableDataset):
    """Endless training batches, reshuffled every epoch, continuing from a ``StreamCursor``.

    Epoch ``e`` visits the examples in ``epoch_order(n, seed, e)``. Each step takes the next
    ``prompts_per_step * world_size`` examples of it and rank ``r`` keeps slice ``r``, so ranks
    see disjoint prompts; a step never straddles two epochs, so a batch never repeats a prompt.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        make_batch: Callable[[list[Example]], PromptBatch],
        prompts_per_step: int,
        seed: int,
        cursor: StreamCursor,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.examples, self.make_batch, self.cursor = examples, make_batch, cursor
        self.prompts_per_step, self.seed = prompts_per_step, seed
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[PromptBatch]:
        self.cursor.rewind()
        step = self.prompts_per_step * self.world_size
        order, order_epoch = torch.empty(0, dtype=torch.long), -1  # [n] once filled
        while True:
            epoch, index = self.cursor.next_start(step, len(self.examples))
            if epoch != order_epoch:
                order, order_epoch = epoch_order(len(self.examples), self.seed, epoch), epoch
            start = index + self.rank * self.prompts_per_step
            ids = order[start : start + self.prompts_per_step].tolist()
            picked = [self.examples[i] for i in ids]
            # Count the batch before yielding it: the consumer owns it from here on, and the
            # generator may never be resumed.
            self.cursor.advance(step)
            yield self.make_batch(picked)


def _keep(batch: PromptBatch) -> PromptBatch:
    """Collate function of ``batch_size=None`` loaders: the dataset already yields batches."""
    return batch


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")


def _validate_args(
    source: str,
    task_config: Mapping[str, Any] | None,
    val_source: str | None,
    columns: Mapping[str, str] | None,
) -> None:
    """Raise a ValueError that says how to fix an inconsistent choice of data."""
    if is_task_source(source) or not is_path_source(source):
        validate_task(source, task_config)  # also rejects unknown task names
    elif task_config:
        raise ValueError(
            f"task_config applies to procedural tasks, but source {source!r} is a file; remove "
            "task_config or set source to a task (e.g. addition, gym:chain_sum)."
        )
    if val_source is not None and not is_path_source(val_source):
        raise ValueError(
            f"val_source must be a .jsonl/.parquet file or a saved datasets folder, got "
            f"{val_source!r}; leave it unset to hold out val_size examples of source."
        )
    if columns is not None and is_task_source(source) and val_source is None:
        raise ValueError(
            "columns maps the columns of data files, but source is a procedural task and there "
            "is no val_source; remove columns."
        )


class RLVRDataModule(pl.LightningDataModule):
    """Prompts for RLVR from built-in tasks, reasoning-gym tasks or dataset files.

    Training is an endless stream of ``PromptBatch``es (the Trainer's ``max_steps`` decides the
    length; validate every N steps with ``val_check_interval: N`` and
    ``check_val_every_n_epoch: null``). Its position is saved in checkpoints, so a resumed run
    continues with the same prompt sequence. The user message is the question, then a blank
    line, then ``instruction``.

    Args:
        source: ``addition``, ``gym:<name>`` (a reasoning-gym dataset, e.g. ``gym:chain_sum``),
            or a path to a ``.jsonl``/``.parquet`` file or a folder written by
            ``datasets.Dataset.save_to_disk``.
        task_config: keyword arguments of the task generator (``addition``: ``digits``;
            ``gym:<name>``: fields of the reasoning-gym config, except ``size`` and ``seed``).
        val_source: a validation file or folder; when unset, validation is a held-out split of
            ``source`` that shares no question with training.
        train_size: training problems generated by a procedural task. File sources use every
            row that is not held out.
        val_size: validation prompts held out of ``source`` (ignored with ``val_source``,
            whose rows are all used); ``0`` disables held-out validation.
        columns: ``our name -> file column``, e.g. ``{prompt: question, answer: answer,
            solution: solution}``; default ``{prompt: prompt, answer: answer}``. Other columns
            pass through to reward functions under their own names.
        system_prompt: content of a system message placed before every prompt.
        instruction: text appended to every question after a blank line; ``null`` for none.
        prompts_per_step: prompts per training step on each device.
        val_prompts_per_batch: prompts per validation batch.
        seed: seed of task generation, the validation split and the per-epoch shuffle.
    """

    def __init__(
        self,
        source: str = "addition",
        task_config: dict[str, Any] | None = None,
        val_source: str | None = None,
        train_size: int = 1000,
        val_size: int = 50,
        columns: dict[str, str] | None = None,
        system_prompt: str | None = None,
        instruction: str | None = "Put the final answer in \\boxed{}.",
        prompts_per_step: int = 8,
        val_prompts_per_batch: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        _check_positive(
            train_size=train_size,
            prompts_per_step=prompts_per_step,
            val_prompts_per_batch=val_prompts_per_batch,
        )
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}.")
        _validate_args(source, task_config, val_source, columns)
        self.save_hyperparameters()
        self.source, self.task_config, self.val_source = source, task_config, val_source
        self.train_size, self.val_size, self.columns = train_size, val_size, columns
        self.system_prompt, self.instruction = system_prompt, instruction
        self.prompts_per_step, self.val_prompts_per_batch = prompts_per_step, val_prompts_per_batch
        self.seed = seed
        self.train_examples: list[Example] = []
        self.val_examples: list[Example] = []
        self.steps = 0  # training steps reported through on_step_output
        self._cursor = StreamCursor()
        self._restored_num_train: int | None = None

    # --- data ----------------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        # Every stage needs both splits: validation is defined as what training does not see.
        if not self.train_examples:
            self.train_examples, self.val_examples = self._build_splits()

    def _build_splits(self) -> tuple[list[Example], list[Example]]:
        held_out = 0 if self.val_source is not None else self.val_size
        if is_task_source(self.source):
            train, val = task_examples(
                self.source, self.task_config, self.train_size, held_out, self.seed
            )
        else:
            train, val = load_examples(self.source, self.columns), []
            if held_out:
                train, val = holdout_split(train, held_out, self.seed)
        if self.val_source is not None:
            val = drop_overlap(load_examples(self.val_source, self.columns), train, "validation")
        return train, val

    def _make_batch(self) -> Callable[[list[Example]], PromptBatch]:
        return functools.partial(
            collate_examples, system_prompt=self.system_prompt, instruction=self.instruction
        )

    def _rank_and_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        self._check_resume()
        rank, world_size = self._rank_and_world()
        if len(self.train_examples) < self.prompts_per_step * world_size:
            raise ValueError(
                f"{len(self.train_examples)} training examples cannot fill one step of "
                f"prompts_per_step={self.prompts_per_step} x {world_size} devices; lower "
                "prompts_per_step or add training data (train_size for tasks)."
            )
        # Under a Trainer, Lightning prefetches one batch, so the resume point is tracked by
        # acknowledgements (on_step_output) instead of by what the stream has handed out.
        self._cursor.track_in_flight = self.trainer is not None
        stream = PromptStream(
            self.train_examples,
            self._make_batch(),
            self.prompts_per_step,
            self.seed,
            self._cursor,
            rank=rank,
            world_size=world_size,
        )
        # An IterableDataset, not a map-style one: under DDP Lightning would replace a map-style
        # dataset's sampler with a DistributedSampler and silently re-split the prompts. The
        # stream shards by rank itself, and being endless it lets max_steps decide the length.
        return DataLoader(stream, batch_size=None, num_workers=0, collate_fn=_keep)

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        make_batch, size = self._make_batch(), self.val_prompts_per_batch
        batches = [
            make_batch(self.val_examples[i : i + size])
            for i in range(0, len(self.val_examples), size)
        ]
        # A list is a map-style dataset: under DDP Lightning shards it across ranks.
        return DataLoader(batches, batch_size=None, shuffle=False, collate_fn=_keep)

    @override
    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    @override
    def on_step_output(self, output: StepOutput) -> None:
        """Hook the module calls after every training step with that step's ``StepOutput``.

        It marks the step's batch as trained, which is what a checkpoint resumes after. Later
        work fills per-prompt statistics (pass rates, group variance) from ``output`` here.
        """
        self.steps += 1
        self._cursor.acknowledge()

    @override
    def state_dict(self) -> dict[str, Any]:
        epoch, index = self._cursor.resume_point
        return {
            "seed": self.seed,
            "epoch": epoch,
            "index": index,
            "steps": self.steps,
            "num_train_examples": len(self.train_examples) if self.train_examples else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"The checkpoint's prompt stream used seed={state_dict['seed']}, this run has "
                f"seed={self.seed}; set seed: {state_dict['seed']} to resume, or start a new run."
            )
        self._cursor.epoch, self._cursor.index = state_dict["epoch"], state_dict["index"]
        self._cursor.in_flight.clear()
        self.steps = state_dict["steps"]
        self._restored_num_train = state_dict["num_train_examples"]
        if self.train_examples:
            self._check_resume()

    def _check_resume(self) -> None:
        restored = self._restored_num_train
        if restored is not None and restored != len(self.train_examples):
            raise ValueError(
                f"The checkpoint was written with {restored} training examples but this run "
                f"has {len(self.train_examples)}: source or its settings changed. Restore them "
                "to resume the same prompt sequence, or start a new run."
            )
