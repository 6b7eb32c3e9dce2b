"""Refuse at start a prompt limit that the model's context cannot hold.

``max_prompt_tokens: 200000`` on a 512-position model was accepted: the run went on for
minutes and was then OOM-killed. Prompt, chat template and completion must fit the model's
positions together (``max_position_embeddings``), as the default limit already ensures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlvr_lightning.data.prompt_limit import model_prompt_limit, template_tokens


def model_context(module: Any) -> int | None:
    """``max_position_embeddings`` of ``module.policy``'s config, None where it is not known."""
    config = getattr(getattr(module, "policy", None), "config", None)
    context = getattr(config, "max_position_embeddings", None)
    return context if isinstance(context, int) else None


def check_prompt_room(
    max_prompt_tokens: int, module: Any, template_tokens: Callable[[Any], int]
) -> None:
    """Raise a ValueError when ``max_prompt_tokens`` plus the chat template's tokens plus the
    larger ``max_new_tokens`` of ``module.sampling``/``val_sampling`` exceed the context of
    ``module.policy``; nothing when the module, its tokenizer or its context is unknown."""
    context, tokenizer = model_context(module), getattr(module, "tokenizer", None)
    if context is None or tokenizer is None:
        return
    samplings = [getattr(module, name, None) for name in ("sampling", "val_sampling")]
    new_tokens = max((s.max_new_tokens for s in samplings if s is not None), default=0)
    template = template_tokens(tokenizer)
    total = max_prompt_tokens + template + new_tokens
    if total <= context:
        return
    room = context - new_tokens - template
    fix = (
        f"set data.init_args.max_prompt_tokens to at most {room}, or leave it unset (the "
        "default fits the context)"
        if room >= 1
        else "lower sampling.max_new_tokens"
    )
    raise ValueError(
        f"max_prompt_tokens={max_prompt_tokens} + {template} chat-template tokens + "
        f"max_new_tokens={new_tokens} = {total} tokens, beyond the model's context of {context} "
        f"positions (max_position_embeddings): {fix}."
    )


def prompt_limit(
    module: Any, max_prompt_tokens: int | None, system_prompt: str | None, instruction: str | None
) -> tuple[int, str] | None:
    """The prompt token limit and the reason the warning gives (None: no limit):
    ``max_prompt_tokens`` once it fits the context with the template and the completion
    (refused otherwise), else the model's default (``prompt_limit.model_prompt_limit``)."""

    def counter(tokenizer: Any) -> int:
        return template_tokens(tokenizer, system_prompt, instruction)

    if max_prompt_tokens is not None:
        check_prompt_room(max_prompt_tokens, module, counter)
        return max_prompt_tokens, f"max_prompt_tokens={max_prompt_tokens}"
    return model_prompt_limit(module, counter)
