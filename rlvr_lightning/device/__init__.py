"""The model's forward on the device it runs on, and the CPU fast paths behind ONE seam.

``prepare_model(model, device_type)`` is the only way a fast path reaches a model: on the CPU
it installs grouped-query attention as two matmuls (``attention``), the lean RMSNorm/SwiGLU
(``lean_layers``) and fp32 products through oneDNN (``cpu_linear``); the attention and product
routes run where they were measured faster on this machine and the model's shapes
(``fast_paths``: :func:`fast_path_choices`, ``RLVR_FAST_PATHS=reference`` turns them off). On
any other device it leaves (or puts back) the model as transformers built it. Everything
outside this package imports from this face only, never a kernel module: the forward for log-probs
(``completion_forward``: chunked LM head, shared prompt passes), the trainer's no-grad pass,
weight casting under autocast and heap trimming.

May import: ``rlvr_lightning.types`` and ``rlvr_lightning.algorithms``.
"""

from __future__ import annotations

from torch import nn

from rlvr_lightning.device import (
    attention,
    cpu_linear,
    fast_paths,
    lean_layers,
    precision_choice,
)
from rlvr_lightning.device.chunked_head import DEFAULT_CHUNK_TOKENS, head_logprobs
from rlvr_lightning.device.decode_head import fp32_head_by_blocks, head_by_blocks
from rlvr_lightning.device.forward import (
    CompletionForward,
    completion_forward,
    completion_logprobs,
    fused_head,
    group_microbatches,
    lm_head_inputs,
)
from rlvr_lightning.device.heap import release_free_pages
from rlvr_lightning.device.precision import weights_cast_once
from rlvr_lightning.device.shared_prompts import cache_kwarg, prompt_pass
from rlvr_lightning.device.trainer_pass import Probe, TrainerPass, trainer_forward

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "CompletionForward",
    "Probe",
    "TrainerPass",
    "cache_kwarg",
    "completion_forward",
    "completion_logprobs",
    "fast_path_choices",
    "fast_path_summary",
    "fp32_head_by_blocks",
    "fused_head",
    "group_microbatches",
    "head_by_blocks",
    "head_logprobs",
    "lm_head_inputs",
    "measured_precision",
    "prepare_model",
    "prompt_pass",
    "release_free_pages",
    "trainer_forward",
    "weights_cast_once",
]

_PREPARED = "_rlvr_prepared_for"


def prepare_model(model: nn.Module, device_type: str = "cpu") -> nn.Module:
    """Make ``model`` fast on ``device_type`` (in place; returns it). Idempotent.

    CPU: lean decoder layers (each checks its own values against the original and falls back
    where it cannot apply), and the routes to grouped attention and oneDNN fp32 products,
    which take them where ``fast_paths`` measured them faster on this model's shapes (at the
    first call in each dtype; with ``RLVR_FAST_PATHS=reference`` no route is installed). Any
    other device: the model as transformers built it (what a CPU preparation installed is
    removed: the instance forwards and the attention implementation).
    """
    if getattr(model, _PREPARED, None) == device_type:
        return model
    if device_type == "cpu":
        lean_layers.install(model)  # the update keeps less for the backward
        if fast_paths.mode() == "measure":
            fast_paths.use_shapes(fast_paths.ModelShapes.of(model))
            attention.prefer_grouped(model)  # the matmuls where faster than SDPA (measured)
            cpu_linear.install(model)  # fp32 products through oneDNN where faster (measured)
    else:
        _unprepare(model)
    object.__setattr__(model, _PREPARED, device_type)
    return model


def measured_precision(model: nn.Module) -> str:
    """``"bf16-mixed"`` or ``"32-true"``: the precision whose update products ran faster on
    ``model``'s shapes on this machine, values checked (``precision_choice``; cached)."""
    return precision_choice.choose(model)


def fast_path_choices() -> dict[str, str]:
    """The fast paths chosen so far in this process, ``{"linear/float32": "onednn", ...}``."""
    return {key: made.choice for key, made in fast_paths.chosen().items()}


def fast_path_summary() -> str:
    """The choices in one line (logs, model cards), with how each was made."""
    return fast_paths.summary()


def _unprepare(model: nn.Module) -> None:
    for module in model.modules():
        forward = vars(module).get("forward")
        func = getattr(forward, "func", forward)
        if forward is not None and getattr(func, "__module__", "").startswith(__name__):
            del module.forward
    attention.restore_sdpa(model)
