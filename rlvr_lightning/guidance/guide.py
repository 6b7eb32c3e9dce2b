"""A frozen guide model from a checkpoint or an exported folder of the same policy (NPO)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlvr_lightning import models


def load_guide_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The policy's weights in a Lightning checkpoint of ``RLVRModule``, keyed as the policy's
    own ``state_dict`` (loaded with ``weights_only=True``)."""
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    state = checkpoint.get("state_dict", {})
    weights = {k.removeprefix("policy."): v for k, v in state.items() if k.startswith("policy.")}
    if not weights:
        raise ValueError(
            f"{path} holds no policy weights (no 'state_dict' with 'policy.' keys): give "
            "guide_checkpoint a checkpoint written by rlvr-lightning fit, or an exported model "
            "folder."
        )
    return weights


def load_guide(
    path: str | Path, policy: nn.Module, tokenizer: PreTrainedTokenizerBase, dtype: str
) -> nn.Module:
    """A frozen guide: an exported model folder (its tokenizer must be the policy's), or a
    ``.ckpt`` whose policy weights go into a frozen copy of ``policy``."""
    path = Path(str(path)).expanduser()
    if path.is_dir():
        guide, guide_tokenizer = models.load_policy(str(path), dtype)
        if guide_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(
                f"The guide at {path} has another tokenizer than the policy: NPO's guide is "
                "a checkpoint of the same model. For another model use MixedPolicyGuidance "
                "with source: teacher and teacher_model."
            )
        return guide.eval().requires_grad_(False)
    guide = models.frozen_copy(policy)
    guide.load_state_dict(load_guide_weights(path))
    return guide
