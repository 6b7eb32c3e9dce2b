"""Rollouts with ``transformers`` generation, sharing the policy's weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.types import Rollouts, Sampling


def sampling_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float
) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from: temperature, then top-k, top-p.

    Args:
        logits: ``[N, V]`` next-token logits.
        temperature: ``[N]`` per-row temperature (> 0).
    """
    scores = logits.float() / temperature[:, None]  # [N, V]
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # [N, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)  # [N, V]
        cum = sorted_scores.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the first always stays.
        drop_sorted = (cum - sorted_scores.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


class _SampleAndRecord(LogitsProcessor):
    """Applies our sampling transform and records the log-prob of each sampled token.

    Generation calls the processor once per new token with the ids so far, so the token sampled
    at call ``t`` is visible at call ``t + 1``; only one ``[N, V]`` tensor is kept, never the
    full history of scores.
    """

    def __init__(self, temperature: torch.Tensor, top_k: int, top_p: float) -> None:
        self.temperature = temperature  # [N]
        self.top_k, self.top_p = top_k, top_p
        self.recorded: list[torch.Tensor] = []  # T x [N]
        self._last: torch.Tensor | None = None  # [N, V]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._last is not None:
            self.recorded.append(self._last.gather(1, input_ids[:, -1:]).squeeze(1))
        self._last = sampling_logprobs(scores, self.temperature, self.top_k, self.top_p)
        return self._last

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Record the final token and return the log-probs ``[N, T]``."""
        assert self._last is not None
        self.recorded.append(self._last.gather(1, last_tokens[:, None]).squeeze(1))
        return torch.stack(self.recorded, dim=1)


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """``[N, T]`` mask that is 1 up to and including the first EOS token of each row."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # [N, T] strictly after the first EOS
    return (~after_eos).long()


class HFEngine:
    """Batched ``model.generate`` with KV cache, left padding and per-row temperature.

    Args:
        model: the policy (shared; weights are always current, so ``load_weights`` is a no-op).
        tokenizer: its tokenizer; EOS and pad ids come from it.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model = model
        self.tokenizer = tokenizer
        eos = model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        self.eos_ids = sorted({i for i in [*eos_ids, tokenizer.eos_token_id] if i is not None})

    @property
    def shares_policy(self) -> bool:
        return True

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to do: the engine generates with the policy module itself."""

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        temperatures: torch.Tensor | None = None,
    ) -> Rollouts:
        g = sampling.group_size
        ids = prompt_ids.repeat_interleave(g, dim=0)  # [N, P]
        mask = prompt_mask.repeat_interleave(g, dim=0)  # [N, P]
        greedy = sampling.temperature <= 0 and temperatures is None
        if temperatures is None:
            temperatures = torch.full((ids.shape[0],), 1.0 if greedy else sampling.temperature)
        temperatures = temperatures.to(ids.device, torch.float32)  # [N]
        if not greedy and bool((temperatures <= 0).any()):
            raise ValueError("Per-row temperatures must be > 0; use temperature=0 for greedy.")
        recorder = _SampleAndRecord(
            temperatures, 0 if greedy else sampling.top_k, 1.0 if greedy else sampling.top_p
        )
        config = GenerationConfig(
            do_sample=not greedy,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.tokenizer.pad_token_id,
            top_k=None,
            top_p=None,
            temperature=None,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([recorder]),
            )
        finally:
            self.model.train(was_training)
        completion_ids = out[:, ids.shape[1] :]  # [N, T]
        logp = recorder.finish(completion_ids[:, -1])  # [N, T]
        cmask = completion_mask(completion_ids, self.eos_ids)  # [N, T]
        ends_with_eos = torch.isin(completion_ids, torch.tensor(self.eos_ids, device=ids.device))
        texts = self.tokenizer.batch_decode(
            completion_ids * cmask + self.tokenizer.pad_token_id * (1 - cmask),
            skip_special_tokens=True,
        )
        return Rollouts(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=completion_ids,
            completion_mask=cmask,
            behaviour_logp=logp * cmask,
            temperature=temperatures,
            truncated=~ends_with_eos.any(-1),
            completions=texts,
            group_size=g,
        )
