"""Prompts for RLVR: procedural tasks, user datasets and the data module that streams them."""

from rlvr_lightning.data.curriculum import MemoryBank, VarianceCurriculum, normalized_variance
from rlvr_lightning.data.datamodule import RLVRDataModule
from rlvr_lightning.data.errors import DataError
from rlvr_lightning.data.mixture import SourceSpec
from rlvr_lightning.data.readers import read_jsonl, read_parquet, read_rows, read_saved_dataset
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.data.sources import (
    Example,
    examples_from_rows,
    holdout_split,
    load_examples,
    make_prompt_id,
)
from rlvr_lightning.data.stats import Observation, PromptRecord, PromptStats
from rlvr_lightning.data.tasks import (
    addition_examples,
    extract_final_answer,
    gym_examples,
    gym_verifier,
    multiplication_examples,
    task_examples,
)

__all__ = [
    "DataError",
    "Example",
    "MemoryBank",
    "Observation",
    "PromptRecord",
    "PromptReplay",
    "PromptStats",
    "RLVRDataModule",
    "SourceSpec",
    "VarianceCurriculum",
    "addition_examples",
    "examples_from_rows",
    "extract_final_answer",
    "gym_examples",
    "gym_verifier",
    "holdout_split",
    "load_examples",
    "make_prompt_id",
    "multiplication_examples",
    "normalized_variance",
    "read_jsonl",
    "read_parquet",
    "read_rows",
    "read_saved_dataset",
    "task_examples",
]
