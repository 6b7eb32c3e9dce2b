"""Hidden states at a chosen layer, caught from a forward the module already runs.

POISE's probe (spec §7.1) reads one layer's hidden states over the last prompt and response
tokens. ``output_hidden_states`` would keep every layer's ``[n, L, H]`` states; a forward hook
on the one module whose output is the chosen layer keeps only that one, and works whether or
not the LM head is bypassed (``forward._head_bypassed``): the hooked module runs before it.

Layers are numbered as transformers' ``output_hidden_states`` tuple: 0 = the embeddings,
``i`` = the output of decoder block ``i``, ``L`` (or -1) = the final norm's output, i.e. the
LM head's input.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rlvr_lightning.algorithms.ops import last_n_mean


def layer_module(model: nn.Module, layer: int) -> nn.Module:
    """The module whose output is ``hidden_states[layer]`` of a decoder-only transformers model
    (a peft wrapper is looked through)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    blocks = getattr(decoder, "layers", None)
    if blocks is None or not hasattr(decoder, "norm"):
        raise ValueError(
            f"{type(base).__name__} exposes no decoder with `.layers` and `.norm`, so the probe "
            "cannot hook a layer; use a Llama-style model (Llama, Qwen, SmolLM, Mistral)."
        )
    count = len(blocks)
    if not -(count + 1) <= layer <= count:
        raise ValueError(
            f"probe layer {layer} is out of range for a model with {count} blocks: use "
            f"0..{count} or -1..-{count + 1} (-1: the final norm's output)."
        )
    index = layer % (count + 1)
    if index == 0:
        return base.get_input_embeddings()
    return decoder.norm if index == count else blocks[index - 1]


@contextmanager
def capture_layer(model: nn.Module, layer: int | None) -> Iterator[list[torch.Tensor]]:
    """Collect the output of ``hidden_states[layer]``'s module on every forward call (nothing
    when ``layer`` is None)."""
    captured: list[torch.Tensor] = []
    if layer is None:
        yield captured
        return

    def keep(_module: nn.Module, _args: tuple, out: torch.Tensor | tuple) -> None:
        captured.append(out[0] if isinstance(out, tuple) else out)

    handle = layer_module(model, layer).register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def prompt_response_means(
    captured: list[torch.Tensor],
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    share_prompts: bool,
    last_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``([n, H], [n, H])`` fp32 means over the last ``last_tokens`` prompt tokens and over the
    states predicting the last ``last_tokens`` completion tokens, from the hooked outputs of
    ``forward._model_outputs`` (the same trimmed ``[n, p]`` prompt and ``[n, t]`` completion).

    The completion's last token is never fed to the model, so its own state does not exist;
    the state predicting completion token ``j`` is the one at token ``j - 1`` (the prompt's
    last for ``j = 0``), as for the value head. This project's choice; POISE's actor pass
    feeds the whole response.
    """
    t = completion_mask.shape[1]
    if share_prompts:  # calls: unique prompts [u, p, H], then the completions [n, t - 1, H]
        unique, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)  # [u, p], [n]
        first = inverse.new_zeros(len(unique)).scatter_(0, inverse, torch.arange(len(inverse)))
        prompt_states = captured[0]  # [u, p, H]
        prompt_mean = last_n_mean(prompt_states, prompt_mask[first], last_tokens)[inverse]
        pieces = [prompt_states[inverse, -1:]] + (captured[1:2] if t > 1 else [])
        response = torch.cat(pieces, dim=1)  # [n, t, H]
    else:  # one call: prompt and completion [n, p + t - 1, H]
        p = prompt_ids.shape[1]
        prompt_mean = last_n_mean(captured[0][:, :p], prompt_mask, last_tokens)  # [n, H]
        response = captured[0][:, p - 1 : p + t - 1]  # [n, t, H]
    return prompt_mean, last_n_mean(response, completion_mask, last_tokens)
