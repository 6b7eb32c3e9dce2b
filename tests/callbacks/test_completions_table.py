"""CompletionsTable: per-row fields of StepOutput, the JSONL file, loggers found by capability."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger
from rlvr_lightning.callbacks import CompletionsTable, GroundTruthInjection
from rlvr_lightning.callbacks.completions_table import TABLE_KEY, completion_rows, markdown_table

from rlvr_lightning import RLVRModule
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.rewards import boxed_accuracy
from rlvr_lightning.stages.summary import summarise_step
from rlvr_lightning.testing import digit_fraction, grouped, quiet_trainer
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored

COLUMNS = [
    "step",
    "prompt_id",
    "prompt",
    "completion",
    "reward/boxed_accuracy",
    "reward/digit_fraction",
    "reward",
    "advantage",
    "source",
    "correct",
    "sampled_reward",
    "sampled_correct",
    "trained",
]


class _Stub(Logger):
    """The abstract part of a Lightning logger; subclasses add one way of showing a table."""

    name, version = "stub", 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class _Writer:
    def __init__(self):
        self.texts = []

    def add_text(self, tag, text, global_step=None):
        self.texts.append((tag, text, global_step))


class TextLogger(_Stub):
    """Like TensorBoardLogger: ``experiment.add_text``."""

    def __init__(self):
        super().__init__()
        self.writer = _Writer()

    @property
    def experiment(self):
        return self.writer


class TableLogger(_Stub):
    """Like WandbLogger: ``log_table``."""

    def __init__(self):
        super().__init__()
        self.tables = []

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None):
        self.tables.append((key, columns, data, step))


def _scored_with_a_reference() -> tuple[PromptBatch, Scored, torch.Tensor]:
    # B=2, G=2, T=3; row 3 is an injected reference in the slot of a wrong sample.
    batch = PromptBatch(
        prompt_ids=["p0", "p1"],
        messages=[[{"role": "user", "content": "1+1?"}], [{"role": "user", "content": "2+2?"}]],
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])  # [N, T]
    rollouts = Rollouts(
        prompt_ids=torch.ones(4, 1, dtype=torch.long),
        prompt_mask=torch.ones(4, 1, dtype=torch.long),
        completion_ids=torch.ones(4, 3, dtype=torch.long),
        completion_mask=mask,
        behaviour_logp=torch.zeros(4, 3),
        temperature=torch.ones(4),
        truncated=torch.zeros(4, dtype=torch.bool),
        completions=["2", "3", "5", "\\boxed{4}"],
        group_size=2,
        sources=("policy", "policy", "policy", "reference"),
        offpolicy_mask=torch.zeros(4, 3),
    )
    scored = Scored(
        rollouts=rollouts,
        rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),  # as trained
        per_function={
            "acc": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            "fmt": torch.tensor([math.nan] * 4),
        },
        correct=torch.tensor([True, False, False, True]),
        sampled_correct=torch.tensor([True, False, False, False]),
        sampled_rewards=torch.tensor([1.0, 0.0, 0.0, 0.25]),
    )
    # Token-level advantages: row means over the mask are 1.5, -1, 0, 2 (padding ignored).
    adv = torch.tensor([[1.0, 2.0, 9.0], [-1.0, 9.0, 9.0], [0.0, 0.0, 0.0], [2.0, 2.0, 9.0]])
    return batch, scored, adv


def test_rows_show_the_group_as_trained_beside_the_sampled_snapshot():
    batch, scored, adv = _scored_with_a_reference()
    out = summarise_step(7, batch, scored, adv, {}, lr=0.1, trained=torch.tensor([True, False]))
    assert out.prompts == ["1+1?", "2+2?"] and out.sources[3] == "reference"
    assert out.advantages.tolist() == [1.5, -1.0, 0.0, 2.0]
    assert out.rewards.tolist() == [[1.0, 0.0], [0.0, 0.25]]  # the snapshot is unchanged
    rows = completion_rows(out, max_rows=10)
    assert len(rows) == 4
    ref = rows[3]
    assert ref["completion"] == "\\boxed{4}" and ref["prompt"] == "2+2?"
    assert (ref["reward"], ref["correct"], ref["source"]) == (1.0, True, "reference")
    assert (ref["sampled_reward"], ref["sampled_correct"]) == (0.25, False)
    assert ref["reward/acc"] == 1.0 and ref["reward/fmt"] is None  # NaN: not applicable
    assert [r["trained"] for r in rows] == [True, True, False, False]
    assert [r["step"] for r in rows] == [7] * 4
    assert len(completion_rows(out, max_rows=3)) == 3


def test_markdown_keeps_one_line_per_row_and_escapes_html():
    md = markdown_table([{"completion": "<think>a|b\nc</think>", "reward": 0.123456}])
    assert md.splitlines() == [
        "| completion | reward |",
        "|---|---|",
        "| &lt;think>a\\|b<br>c&lt;/think> | 0.1235 |",
    ]


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="every_n_steps >= 1"):
        CompletionsTable(every_n_steps=0)
    with pytest.raises(ValueError, match="max_rows >= 1"):
        CompletionsTable(max_rows=0)


def test_fit_writes_every_n_steps_beside_the_metrics_and_to_table_loggers(tmp_path):
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[boxed_accuracy, digit_fraction],
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=2),
            micro_batch_size=8,
        ),
    )
    data = RLVRDataModule("addition", train_size=4, val_size=2, prompts_per_step=2)
    loggers = [CSVLogger(tmp_path), TextLogger(), TableLogger()]
    table = CompletionsTable(every_n_steps=2, max_rows=3)
    # The random model never boxes the right sum: every group gets its reference injected.
    callbacks = [GroundTruthInjection(reward_capping=False), table]
    trainer = quiet_trainer(max_steps=4, callbacks=callbacks, logger=loggers)
    trainer.fit(module, datamodule=data)

    path = tmp_path / "lightning_logs" / "version_0" / "completions.jsonl"  # the CSV's log_dir
    assert table.file == path
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 1, 1, 3, 3, 3]  # steps 1 and 3, max_rows each
    assert all(list(r) == COLUMNS for r in rows)
    assert [r["source"] for r in rows[:3]] == ["policy", "reference", "policy"]
    ref = rows[1]
    assert ref["correct"] is True and ref["sampled_correct"] is False
    # The built-in task's worked solution, e.g. "6 + 5 = 11, so the answer is \boxed{11}.".
    worked = r"\d \+ \d = (\d+), so the answer is \\boxed\{\1\}\."
    assert re.fullmatch(worked, ref["completion"]), ref["completion"]
    assert "+" in ref["prompt"] and ref["prompt_id"] == rows[0]["prompt_id"]

    _, text, step = loggers[1].writer.texts[-1]
    assert len(loggers[1].writer.texts) == 2 and step == trainer.global_step
    assert text.startswith("| " + " | ".join(COLUMNS)) and len(text.splitlines()) == 2 + 3
    key, columns, data_rows, _ = loggers[2].tables[0]
    assert (key, columns, len(data_rows)) == (TABLE_KEY, COLUMNS, 3)
    assert len(loggers[2].tables) == 2
