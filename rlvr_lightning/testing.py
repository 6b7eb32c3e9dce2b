"""Builders for tests and smoke runs: a toy reward, the tiny module and trainer, a PPO update.

The top layer: runtime code never imports it. The tiny model itself is ``models.tiny``
(re-exported here for tests).
"""

from __future__ import annotations

import json

import lightning.pytorch as pl

from rlvr_lightning.models.tiny import CHAT_TEMPLATE, byte_tokenizer, tiny_policy
from rlvr_lightning.rewards.trl_contract import Completion, completion_text

__all__ = ["CHAT_TEMPLATE", "byte_tokenizer", "tiny_policy"]


def digit_fraction(completions: list[Completion], **_: object) -> list[float]:
    """A dense toy reward: the fraction of characters that are digits.

    Random tiny models almost never earn a verifiable reward, so their groups would have zero
    variance and nothing to learn; this reward varies between samples and makes updates happen.
    """
    texts = [completion_text(c) for c in completions]  # message lists on chat prompts
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in texts]


def tool_call(name: str, **arguments: object) -> str:
    """A model turn calling tool ``name`` in the fallback format (``environments.parse``)."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: The first summand.
        b: The second summand.
    """
    return a + b


def tiny_module(**overrides: object):
    """An ``RLVRModule`` on ``tiny:0`` with the ``digit_fraction`` reward, 8 new tokens at
    temperature 1 in groups of 4, micro-batches of 8 and lr 1e-3. ``overrides`` are module
    arguments; an option group's fields may also be given by their field name alone
    (``lr=1e-2`` for ``update.lr``, see :func:`grouped`)."""
    from rlvr_lightning import RLVRModule
    from rlvr_lightning.types import Sampling

    kwargs: dict[str, object] = {
        "functions": [digit_fraction],
        "sampling": Sampling(max_new_tokens=8, temperature=1.0, group_size=4),
        "micro_batch_size": 8,
        "lr": 1e-3,
    }
    return RLVRModule("tiny:0", **grouped(**{**kwargs, **overrides}))


def grouped(**kwargs: object) -> dict[str, object]:
    """Module arguments with option fields given by name (``lr``, ``kl_coef``, the pre-group
    names such as ``reward_fns``, or a group's own field name such as ``functions``) gathered
    into their groups (``update=Update(lr=...)``); a group given whole is updated by them."""
    import dataclasses

    from rlvr_lightning.options import GROUPS, MOVED

    fields = {f.name: f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    fields = {k: v for k, v in fields.items() if k not in ("fn", "mode", "cap", "level", "rank")}
    out: dict[str, object] = {}
    parts: dict[str, dict[str, object]] = {}
    for key, value in kwargs.items():
        place = MOVED.get(key) or fields.get(key)
        if key in GROUPS or place is None:
            out[key] = value
            continue
        group, field = place.split(".")
        parts.setdefault(group, {})[field] = value
    for group, values in parts.items():
        base = out.get(group) or GROUPS[group]()
        out[group] = dataclasses.replace(base, **values)
    return out


def quiet_trainer(**overrides: object) -> pl.Trainer:
    """A CPU ``Trainer`` for tests and benchmarks: no logger, checkpoints, progress bar, model
    summary or validation unless ``overrides`` turn them on."""
    kwargs: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**kwargs, **overrides})


def checkpointing_args(root: object) -> list[str]:
    """CLI arguments that save ``last.ckpt`` under ``<root>/ckpt`` and log under ``root``."""
    return [
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root}/ckpt",
        "--trainer.callbacks.save_last=true",
        f"--trainer.default_root_dir={root}",
    ]


def ppo_update(**overrides):
    """A ``PolicyUpdate`` with PPO clip loss, clip 0.2, seq-mean-token-mean over 8 tokens, no KL
    and no entropy bonus, micro-batches of 4; ``overrides`` replace any field."""
    from rlvr_lightning.algorithms.losses import ppo_clip_loss
    from rlvr_lightning.stages.update import PolicyUpdate

    fields = dict(
        loss_fn=ppo_clip_loss,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode="seq-mean-token-mean",
        norm_len=8,
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        micro_batch_size=4,
    )
    return PolicyUpdate(**{**fields, **overrides})
