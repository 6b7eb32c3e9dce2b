"""The rollout engine protocol: every engine turns token prompts into ``Rollouts``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from rlvr_lightning.types import Rollouts, Sampling

POSITION_TEMPERATURE_REFUSAL = (
    "A temperature that changes along the completion (AnnealedTemperature, EAD) is applied by "
    "the HF engine's own sampler; the vLLM engine applies one temperature per request and "
    "records its log-probs after its own sampler, so it cannot. Set `model.engine: hf`."
)


def request_seeds(n: int) -> list[int]:
    """One sampling seed per request row, drawn from torch's global RNG (so
    ``torch.manual_seed`` makes an engine's rollouts reproducible), where the request is made."""
    return torch.randint(0, 2**31 - 1, (n,)).tolist()


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates ``G`` completions per prompt and keeps its weights in sync with the policy.

    ``generate`` receives left-padded prompt tokens ``[B, P]`` and returns ``B * G`` rows, the
    ``G`` completions of each prompt consecutive. ``temperatures`` (``[B * G]``) overrides the
    sampling temperature per row; ``position_temperatures`` (``[T_max]``) multiplies it at
    each completion position, for engines that can sample that way (HF; vLLM refuses it).
    Engines that hold their own copy of the weights (vLLM) reload them in ``load_weights``;
    engines that share the policy (HF) do nothing there.
    """

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        temperatures: torch.Tensor | None = None,
        position_temperatures: torch.Tensor | None = None,
    ) -> Rollouts: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    @property
    def shares_policy(self) -> bool: ...


@contextmanager
def policy_weights(model: nn.Module) -> Iterator[Iterable[tuple[str, torch.Tensor]]]:
    """The policy's weights under Hugging Face names, for an engine's ``load_weights``.

    A LoRA (peft) policy is merged for the duration of the block: its base layers then hold
    ``W + BA`` and are yielded under the base model's names, adapter tensors left out; the
    adapter is unmerged on exit, so training continues on the unmerged weights. Tied weights
    are yielded under each of their names (``lm_head.weight`` too): vLLM's in-place reload
    expects every module's weights and would otherwise keep a stale output head.
    """
    if not hasattr(model, "get_base_model"):
        yield ((name, p.detach()) for name, p in model.named_parameters(remove_duplicate=False))
        return
    model.merge_adapter()
    try:
        yield (
            (name.replace(".base_layer.", "."), p.detach())
            for name, p in model.get_base_model().named_parameters(remove_duplicate=False)
            if "lora_" not in name
        )
    finally:
        model.unmerge_adapter()
