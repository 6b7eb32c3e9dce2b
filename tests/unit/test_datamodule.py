from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.prompt_limit import default_prompt_limit
from rlvr_lightning.data.stream import StepTicket
from rlvr_lightning.testing import byte_tokenizer, quiet_trainer
from rlvr_lightning.types import PromptBatch, StepOutput

# addition with digits=1 and val_size=50 leaves 50 training problems: 6 steps of 8 per epoch.
STEPS_PER_EPOCH = 6


def make_dm(**kwargs) -> RLVRDataModule:
    dm = RLVRDataModule(**kwargs)
    dm.setup("fit")
    return dm


def take(dm: RLVRDataModule, n: int) -> list[list[str]]:
    return [b.prompt_ids for b in itertools.islice(iter(dm.train_dataloader()), n)]


def step_output(batch: PromptBatch) -> StepOutput:
    b = len(batch)
    return StepOutput(
        step=0, prompt_ids=batch.prompt_ids, group_size=1, rewards=torch.zeros(b, 1),
        correct=torch.zeros(b, 1, dtype=torch.bool), lengths=torch.ones(b, 1),
        pass_rate=torch.zeros(b), group_variance=torch.zeros(b),
    )  # fmt: skip


def test_messages_hold_system_prompt_question_and_instruction():
    dm = make_dm(system_prompt="Be brief.", prompts_per_step=2)
    batch = next(iter(dm.train_dataloader()))
    system, user = batch.messages[0]
    assert system == {"role": "system", "content": "Be brief."}
    assert user["role"] == "user"
    question, instruction = user["content"].split("\n\n")
    assert question.startswith("What is ") and instruction == "Put the final answer in \\boxed{}."
    assert batch.columns["answer"][0] == str(eval(question.removeprefix("What is ").rstrip("?")))


def test_no_system_prompt_and_no_instruction():
    dm = make_dm(instruction=None, prompts_per_step=2)
    batch = next(iter(dm.train_dataloader()))
    assert [m["role"] for m in batch.messages[0]] == ["user"]
    assert batch.messages[0][0]["content"].endswith("?")


def test_stream_is_endless_and_reshuffles_each_epoch():
    dm = make_dm()
    batches = take(dm, 3 * STEPS_PER_EPOCH + 2)
    assert all(len(ids) == 8 and len(set(ids)) == 8 for ids in batches)
    epochs = [
        list(itertools.chain(*batches[i : i + STEPS_PER_EPOCH])) for i in (0, STEPS_PER_EPOCH)
    ]
    assert all(len(set(e)) == 48 for e in epochs)  # no repeat within an epoch
    assert epochs[0] != epochs[1]


def test_resume_from_state_dict_continues_the_same_sequence():
    uninterrupted = take(make_dm(seed=3), 14)
    first = make_dm(seed=3)
    assert take(first, 9) == uninterrupted[:9]  # crosses an epoch boundary
    state = first.state_dict()
    resumed = make_dm(seed=3)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == uninterrupted[9:]


def test_under_a_trainer_batches_are_composed_when_the_step_starts():
    uninterrupted = take(make_dm(), 6)
    dm = make_dm()
    dm.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    stream = iter(dm.train_dataloader())
    tickets = [next(stream) for _ in range(3)]  # prefetching tickets composes nothing
    assert all(isinstance(t, StepTicket) for t in tickets)
    for ticket in tickets[:2]:
        batch = dm.on_before_batch_transfer(ticket, 0)
        dm.on_step_output(step_output(batch))
    resumed = make_dm()
    resumed.load_state_dict(dm.state_dict())
    assert take(resumed, 4) == uninterrupted[2:]
    assert resumed.steps == 2


def test_a_composed_but_untrained_step_is_not_saved_as_consumed():
    uninterrupted = take(make_dm(), 3)
    dm = make_dm()
    dm.on_step_output(step_output(dm.on_before_batch_transfer(StepTicket(), 0)))
    dm.on_before_batch_transfer(StepTicket(), 0)  # composed, then the step crashed
    resumed = make_dm()
    resumed.load_state_dict(dm.state_dict())
    assert take(resumed, 2) == uninterrupted[1:]


def test_resume_rejects_another_seed_or_other_data():
    state = make_dm(seed=1).state_dict()
    with pytest.raises(ValueError, match="set seed: 1 to resume"):
        make_dm(seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="written with 50 training examples but this run has 70"):
        make_dm(seed=1, val_size=30).load_state_dict(state)


def test_ranks_get_disjoint_slices_of_each_step():
    single = take(make_dm(prompts_per_step=8), 2)
    shards = []
    for rank in (0, 1):
        dm = make_dm(prompts_per_step=4)
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        shards.append(take(dm, 2))
    assert [shards[0][i] + shards[1][i] for i in range(2)] == single


def test_val_batches_are_fixed_ordered_and_sized():
    dm = make_dm(val_prompts_per_batch=16)
    val, paraphrased = dm.val_dataloader()  # addition: val, then val asked in other words
    batches = list(val)
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    assert [len(b) for b in paraphrased] == [16, 16, 16, 2]
    flat = list(itertools.chain.from_iterable(b.prompt_ids for b in batches))
    assert flat == [e.prompt_id for e in dm.val_examples]
    assert [b.prompt_ids for b in dm.predict_dataloader()] == [b.prompt_ids for b in batches]
    with pytest.raises(ValueError, match=r"data\.test_source"):
        dm.test_dataloader()  # a procedural task has no test split: `test` says so
    assert not {e.prompt for e in dm.val_examples} & {e.prompt for e in dm.train_examples}


def test_ids_are_stable_across_constructions():
    assert make_dm().train_examples == make_dm().train_examples


def test_file_source_with_held_out_split_and_separate_val_source(tmp_path):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(30)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "val.jsonl").write_text(json.dumps({"question": "v", "answer": "0"}) + "\n")
    columns = {"prompt": "question", "answer": "answer"}
    held = make_dm(source=str(tmp_path / "train.jsonl"), columns=columns, val_size=5)
    assert (len(held.train_examples), len(held.val_examples)) == (25, 5)
    separate = make_dm(
        source=str(tmp_path / "train.jsonl"), val_source=str(tmp_path / "val.jsonl"),
        columns=columns,
    )  # fmt: skip
    assert len(separate.train_examples) == 30
    assert [e.prompt for e in separate.val_examples] == ["v"]


def test_signature_is_the_cli_config():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(RLVRDataModule, "data")
    args = ["--data.source=gym:chain_sum", "--data.task_config={min_terms: 2}", "--data.seed=3"]
    config = parser.parse_args(args).data
    assert (config.source, config.task_config, config.seed) == (
        "gym:chain_sum",
        {"min_terms": 2},
        3,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "additon"}, r"Unknown task 'additon'.*addition, multiplication, 'gym:<name>'"),
        ({"prompts_per_step": 0}, "prompts_per_step must be >= 1"),
        ({"val_size": -1}, "val_size must be >= 0"),
        ({"source": "d.jsonl", "task_config": {"digits": 2}}, "task_config applies to"),
        ({"val_source": "addition"}, "val_source must be"),
        ({"columns": {"prompt": "q"}}, "remove columns"),
    ],
)
def test_constructor_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RLVRDataModule(**kwargs)


def test_too_few_examples_for_a_step():
    dm = make_dm(prompts_per_step=64)
    with pytest.raises(ValueError, match="cannot fill one step of prompts_per_step=64"):
        dm.train_dataloader()


def test_default_prompt_limit_leaves_room_for_the_completion_and_is_capped():
    assert default_prompt_limit(512, 12, 54) == 446  # 512 - 12 - 54
    assert default_prompt_limit(131_072, 64, 30) == 4096  # a long context: the cap
    assert default_prompt_limit(None, 64, 30) == 4096  # unknown context: the cap
    with pytest.raises(ValueError, match=r"leave no room for prompts.*lower sampling"):
        default_prompt_limit(100, 90, 19)


def _attach_model(dm: RLVRDataModule, context: int | None) -> RLVRDataModule:
    """What the data module reads of an RLVRModule in a Trainer, read-only."""
    module = SimpleNamespace(
        policy=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)),
        sampling=SimpleNamespace(max_new_tokens=30),
        val_sampling=SimpleNamespace(max_new_tokens=10),
        tokenizer=byte_tokenizer(),
    )
    dm.trainer = SimpleNamespace(lightning_module=module)
    return dm


def _sized_prompts(tmp_path, sizes):
    rows = [{"prompt": chr(97 + i) * n, "answer": str(i)} for i, n in enumerate(sizes)]
    path = tmp_path / "sized.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_default_limit_comes_from_the_model_and_skips_with_a_count(tmp_path):
    dm = RLVRDataModule(_sized_prompts(tmp_path, [40, 51, 52, 80]), val_size=0, instruction=None)
    _attach_model(dm, context=100)
    # Byte tokenizer: one token per byte. The ChatML template around an empty question is
    # <|im_start|> "user\n" <|im_end|> "\n" <|im_start|> "assistant\n" = 1+5+1+1+1+10 = 19;
    # the larger max_new_tokens is 30, so 100 - 30 - 19 = 51 prompt tokens fit.
    expected = "min(4096, context 100 - max_new_tokens 30 - chat template 19)"
    with pytest.warns(UserWarning, match="Skipped 2 of 4 training prompts longer than 51") as got:
        dm.setup("fit")
    assert any(expected in str(w.message) for w in got)
    assert sorted(len(e.prompt) for e in dm.train_examples) == [40, 51]
    assert dm.skipped_long_prompts == {"training": 2, "validation": 0}


def test_explicit_max_prompt_tokens_wins_over_the_default(tmp_path):
    source = _sized_prompts(tmp_path, [40, 51, 52, 80])
    dm = _attach_model(RLVRDataModule(source, val_size=0, max_prompt_tokens=60), context=200)
    with pytest.warns(UserWarning, match=r"Skipped 1 of 4 training prompts longer than max_prompt"):
        dm.setup("fit")
    assert sorted(len(e.prompt) for e in dm.train_examples) == [40, 51, 52]


def test_no_context_in_the_config_still_caps_and_all_too_long_is_an_error(tmp_path):
    dm = _attach_model(RLVRDataModule(_sized_prompts(tmp_path, [4097, 5000]), val_size=0), None)
    with (
        pytest.warns(UserWarning, match="Skipped 2 of 2"),
        pytest.raises(ValueError, match=r"All 2 training prompts are longer than 4096 tokens"),
    ):
        dm.setup("fit")


class _RecordingModule(pl.LightningModule):
    """Trains nothing; records the prompt ids of each step and reports each step to the data."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[str]] = []

    def training_step(self, batch: PromptBatch, batch_idx: int) -> None:
        self.seen.append(batch.prompt_ids)
        optimizer = self.optimizers()
        self.manual_backward(self.weight.sum())
        optimizer.step()
        self.trainer.datamodule.on_step_output(step_output(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(max_steps: int, ckpt_path=None) -> tuple[pl.Trainer, _RecordingModule]:
    trainer = quiet_trainer(max_steps=max_steps)
    module = _RecordingModule()
    trainer.fit(module, datamodule=RLVRDataModule(prompts_per_step=4), ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_resume_replays_nothing_and_skips_nothing(tmp_path):
    _, full = _fit(5)
    trainer, first = _fit(2)
    trainer.save_checkpoint(tmp_path / "ckpt")
    _, resumed = _fit(5, ckpt_path=tmp_path / "ckpt")
    assert first.seen + resumed.seen == full.seen
