"""The tokens between two model turns, through the model's own chat template.

A multi-turn trajectory is the prompt's tokens, then the model's sampled tokens, then what the
environment said (tool results, feedback) rendered by the chat template with the next
assistant header, then the model's next turn, and so on. The model's tokens are kept exactly as
sampled (their log-probs belong to them); only the text between turns is rendered, as the
difference between the template's rendering of a fixed two-message conversation with and
without the new messages. Earlier turns are never re-rendered, so the ids the trainer sees are
exactly the ids the model was conditioned on, and they equal the template's rendering of the
whole conversation whenever the template renders earlier turns the same way later and the
sampled tokens are the tokenizer's own encoding of their text (tested on two templates).

A template that renders an earlier turn differently once later turns exist (Qwen3-style
templates drop the reasoning of earlier assistant turns) is handled the same way: the model
saw our concatenation, so the trainer trains on that; the template's re-rendering is not used
(this project's choice, the one that keeps log-probs and the loss on the same tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

MARK = "RLVR-TURN-MARK"
"""Content of the fixed assistant message the differences are taken against."""
_BASE = ({"role": "user", "content": "RLVR-TURN-USER"}, {"role": "assistant", "content": MARK})


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], gen: bool) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=gen, tokenize=False
        )
    except Exception as error:  # jinja raises its own errors on roles a template refuses
        roles = [m.get("role") for m in messages]
        raise ValueError(
            f"The chat template cannot render the conversation roles {roles}: {error}. "
            "Multi-turn rollouts need a template that renders 'tool' (tool results) and "
            "'user' (feedback) turns after an assistant turn; set the tokenizer's "
            "chat_template to one that does."
        ) from error


@dataclass(frozen=True)
class TurnText:
    """How a template closes an assistant turn and renders the turns after it.

    Args:
        closing: the text the template puts after an assistant message's content (for
            ChatML ``<|im_end|>\\n``).
        eos_text: the tokenizer's EOS token as text (what a finished turn's last token reads).
    """

    closing: str
    eos_text: str

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TurnText:
        rendered = _render(tokenizer, _BASE, gen=False)
        at = rendered.rfind(MARK)
        if at < 0:
            raise ValueError(
                "The chat template drops the assistant message's content; multi-turn "
                "rollouts need a template that renders it."
            )
        return cls(closing=rendered[at + len(MARK) :], eos_text=tokenizer.eos_token or "")

    def after_turn(self, ended_with_eos: bool) -> str:
        """What closes a model turn: the template's closing, less the EOS the model wrote
        itself (a turn cut by the token budget gets the whole closing)."""
        if ended_with_eos and self.eos_text and self.closing.startswith(self.eos_text):
            return self.closing[len(self.eos_text) :]
        return self.closing

    def environment(self, tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict]) -> str:
        """The text of ``messages`` (what the environment said) and the next assistant header,
        as the template renders them after an assistant turn."""
        before = _render(tokenizer, _BASE, gen=False)
        after = _render(tokenizer, [*_BASE, *messages], gen=True)
        if not after.startswith(before):
            raise ValueError(
                "The chat template renders the turns before a tool or feedback message "
                "differently once it is added, so the turns cannot be appended; set a "
                "chat_template that renders earlier turns the same way."
            )
        return after[len(before) :]


def between_turns(
    tokenizer: PreTrainedTokenizerBase,
    turn_text: TurnText,
    ended_with_eos: bool,
    messages: Sequence[dict],
) -> list[int]:
    """Token ids between a model turn and the next one: the turn's closing, the environment's
    ``messages`` and the next assistant header (never trained on)."""
    text = turn_text.after_turn(ended_with_eos) + turn_text.environment(tokenizer, messages)
    return tokenizer(text, add_special_tokens=False).input_ids
