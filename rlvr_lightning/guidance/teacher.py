"""A second model that writes guidance completions (AMPO's teachers, spec §4.3), through the HF
engine. It is frozen, never a submodule of the policy, so it enters no checkpoint or optimiser;
its own tokenizer and chat template encode the prompts, and its completions travel as text."""

from __future__ import annotations

import torch

from rlvr_lightning import models
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.types import Sampling

Messages = list[dict[str, str]]


class TeacherModel:
    """Samples completions from a frozen model.

    Args:
        name: a model name as for ``RLVRModule.policy`` (local folder, Hub id, embedded default,
            ``tiny:<seed>``).
        dtype: its parameter dtype.
    """

    def __init__(self, name: str, dtype: str = "float32") -> None:
        model, tokenizer = models.load_policy(name, dtype)
        tokenizer.padding_side = "left"
        model.eval().requires_grad_(False)
        self.model, self.tokenizer = model, tokenizer
        self.engine = HFEngine(model, tokenizer)

    def complete(
        self, messages: list[Messages], sampling: Sampling, device: torch.device
    ) -> list[list[str]]:
        """``sampling.group_size`` completions of each conversation, as text."""
        if not messages:
            return []
        self.model.to(device)
        texts = [
            self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            for m in messages
        ]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = self.engine.generate(
            enc.input_ids.to(device), enc.attention_mask.to(device), sampling
        )
        g = sampling.group_size
        return [out.completions[i * g : (i + 1) * g] for i in range(len(messages))]
