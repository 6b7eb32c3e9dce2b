"""The prompt length limit: prompts longer than it are skipped, with a warning that counts them.

The limit is ``max_prompt_tokens`` when set, else what the model's context leaves after the
completion and the chat template (at most ``PROMPT_TOKEN_CAP``). Pure functions of the examples,
a token counter and the numbers; ``RLVRDataModule`` applies them to every split.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from rlvr_lightning.data.prompts import to_messages
from rlvr_lightning.data.sources import Example

PROMPT_TOKEN_CAP = 4096
"""Most prompt tokens kept when ``max_prompt_tokens`` is unset (this project's choice).

Four times the 512-1024 that RLVR recipes usually allow (verl, OpenRLHF, TRL), so ordinary
math and code prompts all pass, while a long-context model cannot be asked to prefill and
back-propagate through tens of thousands of prompt tokens times ``G`` by one stray row.
"""


def default_prompt_limit(
    context: int | None, max_new_tokens: int, template_tokens: int, cap: int = PROMPT_TOKEN_CAP
) -> int:
    """Prompt tokens allowed by default: what the context leaves, at most ``cap``.

    ``context - max_new_tokens - template_tokens`` (chat template, system prompt and
    instruction around the question), so prompt plus completion fit the model's positions.
    ``context=None`` (unknown) gives ``cap``.
    """
    if context is None:
        return cap
    room = context - max_new_tokens - template_tokens
    if room < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} plus {template_tokens} chat-template tokens leave no "
            f"room for prompts in the model's {context} positions; lower sampling.max_new_tokens."
        )
    return min(cap, room)


def drop_long_prompts(
    examples: list[Example],
    count_tokens: Callable[[str], int],
    limit: int,
    what: str,
    why: str | None = None,
) -> list[Example]:
    """``examples`` whose prompt has at most ``limit`` tokens; the rest skipped with a count.

    ``why`` says where the limit comes from in the warning (default: ``max_prompt_tokens``).
    Each distinct prompt is counted once (mixtures repeat examples).
    """
    counts: dict[str, int] = {}
    for e in examples:
        if e.prompt not in counts:
            counts[e.prompt] = count_tokens(e.prompt)
    kept = [e for e in examples if counts[e.prompt] <= limit]
    if len(kept) < len(examples):
        warnings.warn(
            f"Skipped {len(examples) - len(kept)} of {len(examples)} {what} prompts longer than "
            f"{why or f'max_prompt_tokens={limit}'}.",
            stacklevel=2,
        )
    return kept


def limit_prompts(
    train: list[Example],
    val: list[Example],
    count_tokens: Callable[[str], int],
    limit: int,
    why: str,
) -> tuple[list[Example], list[Example], dict[str, int]]:
    """Both splits without prompts over ``limit`` tokens, and how many each lost."""
    kept = drop_long_prompts(train, count_tokens, limit, "training", why)
    val_kept = drop_long_prompts(val, count_tokens, limit, "validation", why)
    if not kept:
        raise ValueError(
            f"All {len(train)} training prompts are longer than {why}; raise "
            "data.max_prompt_tokens (within the model's context) or shorten the prompts."
        )
    skipped = {"training": len(train) - len(kept), "validation": len(val) - len(val_kept)}
    return kept, val_kept, skipped


def model_prompt_limit(
    module: Any, template_tokens: Callable[[Any], int]
) -> tuple[int, str] | None:
    """The default limit for ``module``'s model (see ``default_prompt_limit``) and its reason.

    Reads ``module.policy.config.max_position_embeddings``, the ``max_new_tokens`` of
    ``module.sampling``/``val_sampling`` and ``module.tokenizer`` (``template_tokens`` counts
    the template around a question with it); None when there is no such module.
    """
    tokenizer = getattr(module, "tokenizer", None)
    if tokenizer is None or not hasattr(module, "policy"):
        return None
    context = getattr(getattr(module.policy, "config", None), "max_position_embeddings", None)
    samplings = [getattr(module, name, None) for name in ("sampling", "val_sampling")]
    new_tokens = max((s.max_new_tokens for s in samplings if s is not None), default=0)
    template = template_tokens(tokenizer)
    limit = default_prompt_limit(context, new_tokens, template)
    return limit, (
        f"{limit} tokens, the default limit min({PROMPT_TOKEN_CAP}, context {context} - "
        f"max_new_tokens {new_tokens} - chat template {template}); set data.max_prompt_tokens "
        "to change it"
    )


def template_tokens(tokenizer: Any, system_prompt: str | None, instruction: str | None) -> int:
    """Tokens the chat template, system prompt and instruction add around a question (0 for a
    tokenizer without a chat template: encoding the prompts then fails with its own error)."""
    messages = to_messages("", system_prompt, instruction)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except ValueError:
        return 0
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def token_counter(tokenizer: Any) -> Callable[[str], int]:
    """Counts a prompt's tokens under ``tokenizer``, without special tokens."""
    if tokenizer is None:
        raise ValueError(
            "max_prompt_tokens needs a tokenizer: use the data module with an RLVRModule in "
            "a Trainer, or set `datamodule.tokenizer` before setup."
        )
    return lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)
