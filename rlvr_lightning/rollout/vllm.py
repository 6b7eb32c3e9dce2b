"""Rollouts with a colocated, in-process ``vllm.LLM`` holding its own copy of the weights.

Imported only when ``engine: vllm`` (or ``auto`` with vLLM installed) is chosen: importing
``rlvr_lightning`` never imports vLLM.

Behaviour log-probs follow the HF engine's definition: the log-prob of each sampled token under
the distribution actually sampled from (temperature, then top-k / top-p), which is vLLM's
``logprobs_mode="processed_logprobs"``. With top-k / top-p off this equals
``log_softmax(logits / temperature)``, what ``forward.completion_logprobs`` computes for the
update, so on-policy importance ratios start at 1 up to the engine's numerics.
"""

from __future__ import annotations

import functools
import logging
import os
import random
from contextlib import contextmanager

# In-process engine core: weights are loaded from this process's tensors, never pickled.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# vLLM logs three INFO lines per weight sync (every optimiser step); set the variable to INFO
# to see them again.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar

import numpy as np
import psutil
import torch
import vllm
from transformers.tokenization_utils_base import PreTrainedTokenizerBase
from vllm.platforms import current_platform

from rlvr_lightning.rollout.base import POSITION_TEMPERATURE_REFUSAL, request_seeds
from rlvr_lightning.rollout.hf import completion_mask
from rlvr_lightning.types import Rollouts, Sampling


def _not_rotary_reload(record: logging.LogRecord) -> bool:
    """False for vLLM's "RotaryEmbedding: Failed to load weights" on an in-place reload: the
    rotary cache is derived, never synced, and vLLM keeps its own copy; every step warned."""
    message = record.getMessage()
    return not (message.startswith("RotaryEmbedding") and "Failed to load weights" in message)


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_not_rotary_reload)


def unpad_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded ``[B, P]`` prompts as token lists without padding."""
    return [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]


def pad_right(rows: list[list[float]], width: int, value: float) -> torch.Tensor:
    """``[N, width]`` tensor of ragged rows padded on the right with ``value``."""
    out = torch.full((len(rows), width), value, dtype=torch.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out


CPU_KV_CACHE_GB = 1.0
"""KV cache of a vLLM engine on CPU when ``kv_cache_gb`` is unset (this project's choice).

1 GiB holds ~45k tokens of SmolLM2-135M in bf16 (23 KiB a token) and ~37k of a 1.5B Qwen2
model: several times a rollout batch of 64 x 1k tokens at the sizes a CPU trains. vLLM's own
CPU default (``gpu_memory_utilization`` of all RAM) took 7 GiB and starved the trainer.
"""


def _kv_cache_bytes(kv_cache_gb: float | None, on_cpu: bool) -> int | None:
    """vLLM's ``kv_cache_memory_bytes``: the given size, ``CPU_KV_CACHE_GB`` on CPU, else
    None (vLLM sizes it from ``gpu_memory_utilization``)."""
    size = CPU_KV_CACHE_GB if kv_cache_gb is None and on_cpu else kv_cache_gb
    if size is None:
        return None
    free = psutil.virtual_memory().available / 1024**3
    if on_cpu and size > free:
        raise ValueError(
            f"The vLLM engine's KV cache of {size:g} GiB does not fit in the {free:.1f} GiB of "
            "free memory; lower model.init_args.engine_kwargs.kv_cache_gb (on CPU the default "
            f"is {CPU_KV_CACHE_GB:g})."
        )
    return int(size * 1024**3)


@contextmanager
def _caller_rng_kept() -> Iterator[None]:
    """Restore Python's, NumPy's and torch's global RNG states after the block: an in-process
    ``vllm.LLM`` seeds them all with its own ``seed`` when it starts, which would undo the
    run's ``seed_everything`` (every seed sampled the same rollouts) and a resumed run's RNG,
    and its ``generate`` draws from torch's RNG even for seeded requests, so the run's stream
    would depend on vLLM's internals and differ from an engine in its own process."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


_R = TypeVar("_R")


def _named_weights_of(fn: Callable[[Iterable[tuple[str, torch.Tensor]]], _R], model: Any) -> _R:
    return fn(model.named_parameters())


class VLLMEngine:
    """Generation with ``vllm.LLM`` in this process; weights synced from the policy in place.

    Args:
        model_path: folder (or Hub id) vLLM loads the initial weights and tokenizer config from;
            it must hold the same weights as the policy at start.
        tokenizer: the policy's tokenizer (EOS and pad ids, decoding).
        dtype: vLLM's parameter dtype (``auto``, ``float32``, ``bfloat16``, ``float16``).
        gpu_memory_utilization: share of GPU memory vLLM may take (weights + KV cache).
        kv_cache_gb: KV cache size in GiB. None: vLLM decides on a GPU (from
            ``gpu_memory_utilization``); on CPU ``CPU_KV_CACHE_GB``, since vLLM's CPU backend
            would otherwise reserve ``gpu_memory_utilization`` of the machine's RAM (7 GiB of
            24 at 0.3) for a KV cache the trainer's rollouts never fill.
        max_model_len: longest prompt + completion; None = the model's own limit.
        enable_sleep: release vLLM's memory (weights offloaded, KV cache dropped) between
            rollouts, where the platform supports sleep mode (CUDA/ROCm/XPU); a no-op on CPU.
        enforce_eager: no CUDA graphs; None = eager on CPU only.
        seed: seed of the engine; each request gets a seed drawn from ``torch``'s RNG, so
            ``torch.manual_seed`` makes rollouts reproducible.
    """

    def __init__(
        self,
        model_path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto",
        gpu_memory_utilization: float = 0.3,
        kv_cache_gb: float | None = None,
        max_model_len: int | None = None,
        enable_sleep: bool = True,
        enforce_eager: bool | None = None,
        seed: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.sleep_enabled = enable_sleep and current_platform.is_sleep_mode_available()
        on_cpu = current_platform.is_cpu()
        with _caller_rng_kept():  # in-process vLLM reseeds the global RNGs with its seed
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=_kv_cache_bytes(kv_cache_gb, on_cpu),
                max_model_len=max_model_len,
                enable_sleep_mode=self.sleep_enabled,
                enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
                logprobs_mode="processed_logprobs",
                seed=seed,
                # On CPU a prompt prefilled in chunks crashes a seeded request ("CPU Generator
                # does not use offset": vLLM rewinds its generator for the discarded token).
                enable_chunked_prefill=not on_cpu,
            )
        eos = self.llm.llm_engine.model_config.hf_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = sorted({i for i in [*eos_ids, tokenizer.eos_token_id] if i is not None})
        self.asleep = False

    @property
    def shares_policy(self) -> bool:
        return False

    # ---- memory ---------------------------------------------------------------------------

    def sleep(self) -> None:
        """Offload weights and drop the KV cache while the policy trains (GPU only)."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    # ---- weights --------------------------------------------------------------------------

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the policy's weights (Hugging Face names) into the engine's model in place.

        Tensors are cast to the engine's dtype, and the copy runs under ``torch.inference_mode``:
        an engine first built during validation (Lightning runs it in inference mode, e.g. with
        ``evaluate_before_after``) holds inference tensors, which refuse in-place copies outside
        it."""
        self.wake_up()
        dtype = self.llm.llm_engine.model_config.dtype
        with torch.inference_mode():
            self.llm.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": ((n, t.detach().to(dtype)) for n, t in named_tensors)},
            )
        self.llm.reset_prefix_cache()

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in."""
        return self.llm.llm_engine.model_config.dtype

    def read_weights(self, fn: Callable[[Iterable[tuple[str, torch.Tensor]]], _R]) -> _R:
        """``fn`` of the weights the engine holds (its own names, layout and dtype: fused
        ``qkv_proj``, ...), read in its worker (``LLM.apply_model``); e.g. the weight-sync
        check's module sums (``asynchrony.fingerprint.module_sums``)."""
        self.wake_up()
        return self.llm.apply_model(functools.partial(_named_weights_of, fn))[0]

    # ---- generation -----------------------------------------------------------------------

    def _params(
        self, sampling: Sampling, temperatures: torch.Tensor | None, n: int, seeds: list[int] | None
    ):
        greedy = sampling.temperature <= 0 and temperatures is None
        temps = (
            torch.full((n,), 0.0 if greedy else sampling.temperature)
            if temperatures is None
            else temperatures.float().cpu()
        )  # [N]
        if not greedy and bool((temps <= 0).any()):
            raise ValueError("Per-row temperatures must be > 0; use temperature=0 for greedy.")
        seeds = request_seeds(n) if seeds is None else seeds
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=float(t),
                top_p=1.0 if greedy else sampling.top_p,
                top_k=0 if greedy else sampling.top_k,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=self.eos_ids,
                logprobs=0,
                seed=None if greedy else s,
                detokenize=False,
            )
            for t, s in zip(temps.tolist(), seeds, strict=True)
        ]
        return params, torch.where(temps > 0, temps, torch.ones_like(temps))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        temperatures: torch.Tensor | None = None,
        position_temperatures: torch.Tensor | None = None,
        seeds: list[int] | None = None,
    ) -> Rollouts:
        """``seeds``: one per row, drawn by the caller (``rollout.process``); None draws them
        here (``rollout.base.request_seeds``)."""
        if position_temperatures is not None:
            raise ValueError(POSITION_TEMPERATURE_REFUSAL)
        g = sampling.group_size
        ids = prompt_ids.repeat_interleave(g, dim=0)  # [N, P]
        mask = prompt_mask.repeat_interleave(g, dim=0)  # [N, P]
        params, temps = self._params(sampling, temperatures, ids.shape[0], seeds)
        prompts = [{"prompt_token_ids": p} for p in unpad_prompts(ids, mask)]
        self.wake_up()
        with _caller_rng_kept():  # vLLM's scheduler draws from torch's RNG even when seeded
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
        self.sleep()
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logps = [
            [step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, toks, strict=True)]
            for o, toks in zip(outputs, tokens, strict=True)
        ]
        width = max(1, *(len(t) for t in tokens))
        pad = self.tokenizer.pad_token_id
        completion_ids = pad_right(tokens, width, pad).long().to(ids.device)  # [N, T]
        cmask = completion_mask(completion_ids, self.eos_ids)  # [N, T]
        lengths = torch.tensor([len(t) for t in tokens], device=ids.device)  # [N]
        cmask = cmask * (torch.arange(width, device=ids.device) < lengths[:, None])
        logp = pad_right(logps, width, 0.0).float().to(ids.device)  # [N, T]
        truncated = torch.tensor([o.outputs[0].finish_reason == "length" for o in outputs])
        texts = self.tokenizer.batch_decode(
            completion_ids * cmask + pad * (1 - cmask), skip_special_tokens=True
        )
        return Rollouts(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=completion_ids,
            completion_mask=cmask,
            behaviour_logp=logp * cmask,
            temperature=temps.to(ids.device),
            truncated=truncated.to(ids.device),
            completions=texts,
            group_size=g,
        )

    @torch.no_grad()
    def score(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        """Log-probs ``[T]`` of a fixed completion under the engine's weights (temperature 1),
        from vLLM's prompt log-probs; used to check weight sync."""
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        self.wake_up()
        with _caller_rng_kept():
            out = self.llm.generate(
                [{"prompt_token_ids": prompt_ids + completion_ids}], params, use_tqdm=False
            )[0]
        steps = out.prompt_logprobs[len(prompt_ids) :]
        return torch.tensor(
            [s[t].logprob for s, t in zip(steps, completion_ids, strict=True)]
        )  # [T]
