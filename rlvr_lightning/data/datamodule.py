"""``RLVRDataModule``: an endless, resumable stream of training prompts and fixed validation.

Each training step's prompts are composed when the step starts (``compose_step``): replays
chosen by ``PromptReplay``, refills from the ``VarianceCurriculum`` memory bank, then fresh
prompts in reshuffled epoch order. The per-prompt statistics, the replay heap, the bank and the
stream position are saved in checkpoints, so a resumed run sees exactly the prompt sequence an
uninterrupted run would have seen.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.data.mixture import (
    AnswerFormat,
    SourceSpec,
    apply_answer_format,
    limit_prompts,
    mixture_splits,
    model_prompt_limit,
    source_specs,
    validate_source,
)
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.data.sources import Example, drop_overlap, load_examples
from rlvr_lightning.data.stats import (
    Observation,
    PromptStats,
    gather_observations,
    observations,
)
from rlvr_lightning.data.stream import (
    FreshPrompts,
    PromptStream,
    StepTicket,
    StreamCursor,
    rng_state,
    set_rng_state,
)
from rlvr_lightning.types import PromptBatch, StepOutput

Messages = list[dict[str, str]]


def to_messages(prompt: str, system_prompt: str | None, instruction: str | None) -> Messages:
    """Chat messages of a prompt: optional system turn, then the user turn.

    The instruction follows the question after a blank line, so the question reads as written;
    ``None`` or ``""`` adds nothing.
    """
    content = f"{prompt}\n\n{instruction}" if instruction else prompt
    system = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    return [*system, {"role": "user", "content": content}]


def example_messages(
    example: Example, system_prompt: str | None, instruction: str | None
) -> Messages:
    """Chat messages of an example: ``to_messages`` for a text prompt; a conversation as
    written, with ``system_prompt`` prepended only when it has no system turn of its own and
    ``instruction`` appended to its last (user) turn after a blank line."""
    if example.messages is None:
        return to_messages(example.prompt, system_prompt, instruction)
    messages = [dict(m) for m in example.messages]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if instruction:
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{instruction}"
    return messages


def collate_examples(
    examples: Sequence[Example], system_prompt: str | None, instruction: str | None
) -> PromptBatch:
    """A ``PromptBatch`` of examples; a column missing from some examples is ``None`` there.

    The ``prompts`` column is what reward functions get as ``prompts`` (TRL's meaning): the
    user turn's text for a text prompt, the message list for a conversation, both with the
    system prompt and instruction applied and no chat template.
    """
    names = list(dict.fromkeys(name for e in examples for name in e.columns))
    messages = [example_messages(e, system_prompt, instruction) for e in examples]
    columns = {name: [e.columns.get(name) for e in examples] for name in names}
    columns["prompts"] = [
        m[-1]["content"] if e.messages is None else m
        for e, m in zip(examples, messages, strict=True)
    ]
    return PromptBatch(
        prompt_ids=[e.prompt_id for e in examples], messages=messages, columns=columns
    )


def source_columns(examples: Sequence[Example]) -> dict[str, list[str]]:
    """The columns each source's examples have (any row), the source read from the id."""
    found: dict[str, dict[str, None]] = {}
    for e in examples:
        names = found.setdefault(e.prompt_id.rsplit(":", 1)[0], {})
        names.update(dict.fromkeys(e.columns))
    return {source: list(names) for source, names in found.items()}


def _keep(batch: PromptBatch) -> PromptBatch:
    """Collate function of ``batch_size=None`` loaders: the dataset already yields batches."""
    return batch


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}.")


class RLVRDataModule(pl.LightningDataModule):
    """Prompts for RLVR from built-in tasks, reasoning-gym tasks or dataset files.

    Training is an endless stream of ``PromptBatch``es (the Trainer's ``max_steps`` decides the
    length; validate every N steps with ``val_check_interval: N`` and
    ``check_val_every_n_epoch: null``). The module reports every step through
    ``on_step_output``; that fills ``stats`` (per-prompt history, gathered across ranks), which
    ``replay`` and ``curriculum`` use to compose later steps. All of it is saved in checkpoints.

    Args:
        source: ``addition``, ``multiplication``, ``gym:<name>`` (a reasoning-gym dataset, e.g.
            ``gym:chain_sum``), a path to a ``.jsonl``/``.parquet`` file or a folder written by
            ``datasets.Dataset.save_to_disk``; or a list of ``SourceSpec`` mixed by weight.
        task_config: keyword arguments of the task generator (``addition``/``multiplication``:
            ``digits``; ``gym:<name>``: fields of the reasoning-gym config except size and seed).
        val_source: a validation file or folder; when unset, validation is a held-out split of
            ``source`` that shares no question with training.
        train_size: training problems generated by a procedural task. File sources use every
            row that is not held out.
        val_size: validation prompts held out of ``source`` (ignored with ``val_source``,
            whose rows are all used); ``0`` disables held-out validation.
        columns: ``our name -> file column``, e.g. ``{prompt: question, answer: answer,
            solution: solution}``; default ``{prompt: prompt, answer: answer}``. Other columns
            pass through to reward functions under their own names.
        answer_format: ``plain``, ``gsm8k`` (answer after ``####``) or ``boxed`` (last
            ``\\boxed{}`` of the solution column); see ``SourceSpec``.
        max_prompt_tokens: prompts longer than this (under the module's tokenizer, without
            the chat template) are skipped with a warning that counts them. None (default)
            derives the limit from the RLVRModule in the Trainer: the model's
            ``max_position_embeddings`` minus the larger ``max_new_tokens`` of ``sampling`` and
            ``val_sampling`` minus the chat template's tokens, at most ``PROMPT_TOKEN_CAP``
            (4096); without such a module, None keeps all.
        system_prompt: content of a system message placed before every prompt.
        instruction: text appended to every question after a blank line; ``null`` for none.
        prompts_per_step: prompts per training step on each device.
        val_prompts_per_batch: prompts per validation batch.
        replay: online prompt replay (spec §1); None disables it.
        curriculum: variance-based curriculum (spec §2); None disables it.
        stats_history: recent pass rates and outcomes kept per prompt.
        seed: seed of task generation, the validation split, the shuffle and step composition.
    """

    def __init__(
        self,
        source: str | list[SourceSpec] = "addition",
        task_config: dict[str, Any] | None = None,
        val_source: str | None = None,
        train_size: int = 1000,
        val_size: int = 50,
        columns: dict[str, str] | None = None,
        answer_format: AnswerFormat = "plain",
        max_prompt_tokens: int | None = None,
        system_prompt: str | None = None,
        instruction: str | None = "Put the final answer in \\boxed{}.",
        prompts_per_step: int = 8,
        val_prompts_per_batch: int = 64,
        replay: PromptReplay | None = None,
        curriculum: VarianceCurriculum | None = None,
        stats_history: int = 8,
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
        self.specs = source_specs(source, task_config, columns, answer_format)
        for spec in self.specs:
            validate_source(spec.source, spec.task_config, val_source, spec.columns)
        self.save_hyperparameters(ignore=["source", "replay", "curriculum"])
        # Plain data only, so checkpoints load with weights_only=True and cards can show them.
        self.hparams["source"] = (
            source if isinstance(source, str) else [vars(s) for s in self.specs]
        )
        for name, strategy in (("replay", replay), ("curriculum", curriculum)):
            self.hparams[name] = None if strategy is None else dict(strategy.config)
        self.val_source, self.train_size, self.val_size = val_source, train_size, val_size
        self.max_prompt_tokens = max_prompt_tokens
        self.system_prompt, self.instruction = system_prompt, instruction
        self.prompts_per_step, self.val_prompts_per_batch = prompts_per_step, val_prompts_per_batch
        self.replay, self.curriculum, self.seed = replay, curriculum, seed
        self.stats = PromptStats(stats_history)
        self.train_examples: list[Example] = []
        self.val_examples: list[Example] = []
        self.steps = 0  # training steps reported through on_step_output
        self.last_observed: list[Observation] = []  # the last reported step, all ranks
        self._cursor = StreamCursor()
        self._rng = random.Random(seed)
        self._served: set[str] = set()  # prompts of the current step served as replays
        self._pending: dict[str, Any] | None = None  # state before the untrained current step
        self._restored_num_train: int | None = None
        self.skipped_long_prompts: dict[str, int] = {}  # per split, set at setup
        self._checked_rewards: object = None  # the reward combiner the columns were checked for

    # --- data ----------------------------------------------------------------------------

    @override
    def setup(self, stage: str) -> None:
        # Every stage needs both splits: validation is defined as what training does not see.
        if not self.train_examples:
            self.train_examples, self.val_examples = self._build_splits()
            self._by_id = {e.prompt_id: e for e in self.train_examples}
            self._fresh = FreshPrompts(self.train_examples, self.seed, self._cursor)
        self._check_reward_columns()

    def _check_reward_columns(self) -> None:
        """Every column a reward of the Trainer's module requires exists in every source, so a
        missing one stops the run here, before the first rollout, naming reward and column."""
        rewards = getattr(getattr(self.trainer, "lightning_module", None), "rewards", None)
        if not hasattr(rewards, "check_available") or rewards is self._checked_rewards:
            return
        for where, examples in (("training", self.train_examples), ("val", self.val_examples)):
            for source, columns in source_columns(examples).items():
                rewards.check_available(columns, f"{where} source {source!r}")
        self._checked_rewards = rewards

    def _build_splits(self) -> tuple[list[Example], list[Example]]:
        held_out = 0 if self.val_source is not None else self.val_size
        train, val = mixture_splits(self.specs, self.train_size, held_out, self.seed)
        if self.val_source is not None:
            first = self.specs[0]
            loaded = load_examples(self.val_source, first.columns)
            loaded = apply_answer_format(loaded, first.answer_format, self.val_source)
            val = drop_overlap(loaded, train, "validation")
        limit = self._prompt_limit()
        if limit is None:
            return train, val
        train, val, self.skipped_long_prompts = limit_prompts(
            train, val, self._token_counter(), *limit
        )
        return train, val

    def _prompt_limit(self) -> tuple[int, str] | None:
        """The prompt token limit and the reason the warning gives; None: no limit."""
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens, f"max_prompt_tokens={self.max_prompt_tokens}"
        module = None if self.trainer is None else self.trainer.lightning_module
        return model_prompt_limit(module, self._template_tokens)

    def _template_tokens(self, tokenizer: Any) -> int:
        """Tokens the chat template, system prompt and instruction add around a question."""
        messages = to_messages("", self.system_prompt, self.instruction)
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except ValueError:  # no chat template: encoding the prompts fails with its own error
            return 0
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    def _token_counter(self) -> Any:
        tokenizer = getattr(getattr(self.trainer, "lightning_module", None), "tokenizer", None)
        tokenizer = getattr(self, "tokenizer", None) or tokenizer
        if tokenizer is None:
            raise ValueError(
                "max_prompt_tokens needs a tokenizer: use the data module with an RLVRModule in "
                "a Trainer, or set `datamodule.tokenizer` before setup."
            )
        return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)

    def _rank_and_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def _collate(self, examples: Sequence[Example]) -> PromptBatch:
        return collate_examples(examples, self.system_prompt, self.instruction)

    # --- step composition ----------------------------------------------------------------

    def compose_step(self) -> PromptBatch:
        """This rank's prompts for the next step: replays, bank refills, then fresh prompts.

        Every rank composes the same global step of ``prompts_per_step * world_size`` prompts
        (their statistics are identical) in a seeded order, and keeps its own slice.
        """
        rank, world = self._rank_and_world()
        total = self.prompts_per_step * world
        replays, banked = [], []
        if self.replay is not None:
            replays = self.replay.select(self.steps, self.replay.budget(total), ())
        if self.curriculum is not None:
            banked = self.curriculum.fill(total, set(replays))
        served = replays + banked
        fresh = self._fresh.take(total - len(served), set(served))
        picked = [self._by_id[pid] for pid in served] + fresh
        self._rng.shuffle(picked)  # replays spread over ranks
        self._served = set(served)
        mine = picked[rank * self.prompts_per_step : (rank + 1) * self.prompts_per_step]
        return self._collate(mine)

    def draw_prompts(self, n: int, exclude: Sequence[str] = ()) -> PromptBatch:
        """``n`` more fresh prompts for this rank within the current step (dynamic sampling).

        Every rank must call it with the same ``n``: the draw is global, like ``compose_step``.
        """
        rank, world = self._rank_and_world()
        fresh = self._fresh.take(n * world, set(exclude) | self._served)
        return self._collate(fresh[rank * n : (rank + 1) * n])

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        # Lightning calls this when the step starts, after it has prefetched the next ticket.
        if not isinstance(batch, StepTicket):
            return batch
        # Until on_step_output reports this step, a checkpoint (e.g. on an exception) saves
        # the state before it, so a resumed run trains this step's prompts again.
        self._pending = self._composition_state()
        return self.compose_step()

    @override
    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        self._check_resume()
        _, world_size = self._rank_and_world()
        if len(self.train_examples) < self.prompts_per_step * world_size:
            raise ValueError(
                f"{len(self.train_examples)} training examples cannot fill one step of "
                f"prompts_per_step={self.prompts_per_step} x {world_size} devices; lower "
                "prompts_per_step or add training data (train_size for tasks)."
            )
        stream = PromptStream(self.compose_step, lazy=isinstance(self.trainer, pl.Trainer))
        # An IterableDataset, not a map-style one: under DDP Lightning would replace a map-style
        # dataset's sampler with a DistributedSampler and silently re-split the groups. The
        # stream shards by rank itself, and being endless it lets max_steps decide the length.
        return DataLoader(stream, batch_size=None, collate_fn=_keep, generator=self._loader_rng())

    @override
    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        size = self.val_prompts_per_batch
        batches = [
            self._collate(self.val_examples[i : i + size])
            for i in range(0, len(self.val_examples), size)
        ]
        # A list is a map-style dataset: under DDP Lightning shards it across ranks.
        return DataLoader(
            batches, batch_size=None, shuffle=False, collate_fn=_keep, generator=self._loader_rng()
        )

    def _loader_rng(self) -> torch.Generator:
        # Creating a DataLoader iterator draws a seed; from its own generator it leaves the
        # global RNG (which sampling uses) alone, so resumes and validation don't shift it.
        return torch.Generator().manual_seed(self.seed)

    @override
    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    @override
    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    # --- what the module reports -----------------------------------------------------------

    def train_group_mask(self, correct: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor | None:
        """``[B]`` bool: groups of ``[B, G]`` results allowed to train (None: all)."""
        if self.curriculum is None:
            return None
        return self.curriculum.group_mask(self.steps, correct.cpu(), rewards.cpu())

    def on_step_output(self, output: StepOutput) -> None:
        """Hook the module calls after every training step with that step's ``StepOutput``.

        Records the step in ``stats`` (gathered across ranks) and feeds replay and curriculum.
        The step's observations stay in ``last_observed`` until the next step (``replayed``
        marks the prompts served again, as replays or bank refills).
        """
        observed = gather_observations(observations(output, self._served))
        self.last_observed = observed
        self.stats.record(self.steps, observed)
        if self.replay is not None:
            self.replay.observe(self.steps, observed)
        if self.curriculum is not None:
            scores = [self.curriculum.observation_score(o) for o in observed]
            trained = [o.trained for o in observed]
            self.curriculum.observe(self.steps, [o.prompt_id for o in observed], scores, trained)
        self.steps += 1
        self._pending, self._served = None, set()

    # --- checkpoints ---------------------------------------------------------------------

    def _composition_state(self) -> dict[str, Any]:
        """What composing a step changes; restored when a step was composed but not trained."""
        return copy.deepcopy(
            {
                "epoch": self._cursor.epoch,
                "index": self._cursor.index,
                "rng": rng_state(self._rng),
                "replay": None if self.replay is None else self.replay.state_dict(),
                "curriculum": None if self.curriculum is None else self.curriculum.state_dict(),
            }
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **(self._pending or self._composition_state()),
            "seed": self.seed,
            "steps": self.steps,
            "stats": self.stats.state_dict(),
            "num_train_examples": len(self.train_examples) if self.train_examples else None,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["seed"] != self.seed:
            raise ValueError(
                f"The checkpoint's prompt stream used seed={state_dict['seed']}, this run has "
                f"seed={self.seed}; set seed: {state_dict['seed']} to resume, or start a new run."
            )
        for name in ("replay", "curriculum"):
            if (state_dict.get(name) is None) != (getattr(self, name) is None):
                raise ValueError(
                    f"The checkpoint was written {'with' if state_dict.get(name) else 'without'} "
                    f"data.{name}; configure it the same way to resume exactly."
                )
        self._cursor.epoch, self._cursor.index = state_dict["epoch"], state_dict["index"]
        set_rng_state(self._rng, state_dict["rng"])
        if self.replay is not None:
            self.replay.load_state_dict(state_dict["replay"])
        if self.curriculum is not None:
            self.curriculum.load_state_dict(state_dict["curriculum"])
        self.stats.load_state_dict(state_dict["stats"])
        self.steps, self._pending = state_dict["steps"], None
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
