"""The HF engine on its own copy of the policy: what ``engine: hf`` runs in a worker process
(``engine_kwargs.process: true``, ``rollout.process.ProcessEngine``).

In this process the HF engine generates with the policy module itself; in a worker it cannot
(the update changes the weights while the worker decodes), so the worker loads the policy once
from its folder and takes the trained weights in ``load_weights``, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.models.loading import load_policy, resolve_dtype
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.types import Rollouts


class HFCopyEngine:
    """``HFEngine`` on a copy of the policy loaded from ``folder`` in ``dtype``.

    Sampling draws from this process's torch RNG, seeded per request from the first of the
    ``seeds`` the caller drew (``rollout.base.request_seeds``), so a run is a function of its
    seed wherever the worker runs (this project's choice: the HF sampler has no per-row seeds).
    """

    def __init__(
        self,
        folder: str,
        tokenizer: PreTrainedTokenizerBase,
        dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        self.model, _ = load_policy(folder, dtype)
        self.model.eval()
        self.inner = HFEngine(self.model, tokenizer, **kwargs)
        self.tokenizer, self.eos_ids = tokenizer, self.inner.eos_ids
        self.weights_dtype = resolve_dtype(dtype)
        self._params = dict(self.model.named_parameters(remove_duplicate=False))

    @property
    def shares_policy(self) -> bool:
        return False

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the policy's weights (Hugging Face names) into the copy; a name the copy
        lacks is an error (the copy was built from another model)."""
        for name, tensor in named_tensors:
            if name not in self._params:
                raise KeyError(f"The worker's policy copy has no weight {name!r}.")
            self._params[name].copy_(tensor)

    def read_weights(self, fn: Callable[[Iterable[tuple[str, torch.Tensor]]], Any]) -> Any:
        return fn(self.model.named_parameters())

    def generate(self, *args: Any, seeds: list[int] | None = None, **kwargs: Any) -> Rollouts:
        if seeds:
            torch.manual_seed(seeds[0])
        return self.inner.generate(*args, **kwargs)

    def sleep(self) -> None:
        """Nothing to release on a CPU copy."""

    def wake_up(self) -> None:
        """Nothing to restore."""
