"""Prompts for RLVR: procedural tasks, user datasets and the data module that streams them."""

from rlvr_lightning.data.datamodule import RLVRDataModule
from rlvr_lightning.data.sources import (
    Example,
    examples_from_rows,
    holdout_split,
    load_examples,
    make_prompt_id,
    read_jsonl,
    read_parquet,
    read_rows,
    read_saved_dataset,
)
from rlvr_lightning.data.tasks import (
    addition_examples,
    extract_final_answer,
    gym_examples,
    gym_verifier,
    task_examples,
)

__all__ = [
    "Example",
    "RLVRDataModule",
    "addition_examples",
    "examples_from_rows",
    "extract_final_answer",
    "gym_examples",
    "gym_verifier",
    "holdout_split",
    "load_examples",
    "make_prompt_id",
    "read_jsonl",
    "read_parquet",
    "read_rows",
    "read_saved_dataset",
    "task_examples",
]
