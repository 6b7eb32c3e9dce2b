"""The rollout engine protocol: every engine turns token prompts into ``Rollouts``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from rlvr_lightning.types import Rollouts, Sampling


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates ``G`` completions per prompt and keeps its weights in sync with the policy.

    ``generate`` receives left-padded prompt tokens ``[B, P]`` and returns ``B * G`` rows, the
    ``G`` completions of each prompt consecutive. ``temperatures`` (``[B * G]``) overrides the
    sampling temperature per row. Engines that hold their own copy of the weights (vLLM) reload
    them in ``load_weights``; engines that share the policy (HF) do nothing there.
    """

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        temperatures: torch.Tensor | None = None,
    ) -> Rollouts: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    @property
    def shares_policy(self) -> bool: ...
