"""Rollouts from the policy itself (a ``transformers`` model): prompt prefill once per group,
then a decode loop that drops finished rows, with our own sampling and its log-probs."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.shared_prompts import cache_kwarg, prompt_pass
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


def sample_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """One token per row of ``[N, V]`` log-probs by inverse-CDF sampling; ``[N]`` ids.

    One uniform per row and a cumulative sum replace ``torch.multinomial``, whose exponential
    draw over all ``N * V`` entries was ~13% of generation time on CPU (measured on SmolLM2-135M,
    32 rows). Tokens of probability 0 (cut by top-k / top-p) are never drawn: the CDF is flat
    there and ``searchsorted(..., right=True)`` returns the first index whose CDF exceeds ``u``.
    """
    cdf = logp.exp().cumsum(-1)  # [N, V]
    u = torch.rand(cdf.shape[0], 1, device=cdf.device) * cdf[:, -1:]  # [N, 1]
    picked = torch.searchsorted(cdf, u, right=True).squeeze(1)  # [N]
    return picked.clamp_(max=cdf.shape[-1] - 1)


def shared_prompt_cache(model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, g: int):
    """KV cache of all but the last token of each of the ``B`` prompts, repeated ``G`` times.

    The ``G`` rows of a group share their prompt, so it is encoded once instead of ``G`` times;
    ``decode`` then starts from this cache and runs only each prompt's last token.

    Args:
        ids: ``[B, P]`` left-padded prompts (``P >= 2``); mask: ``[B, P]``.
    """
    out = prompt_pass(model, ids[:, :-1], mask[:, :-1])  # the first P - 1 tokens
    cache = out[cache_kwarg(model)]
    if g > 1:
        cache.batch_repeat_interleave(g)  # [B] -> [B * G] rows, group rows consecutive
    return cache


# Finished rows leave the decoding batch once they are this share of the rows still decoding
# (each eviction copies the whole KV cache): this project's choice.
EVICT_FRACTION = 0.125


def decode(
    model: PreTrainedModel,
    cache: object | None,
    last_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    max_new_tokens: int,
    next_token,
    eos_ids: list[int],
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode up to ``max_new_tokens`` tokens per row from ``cache`` (all but the last prompt
    token of each row; None when the prompts are one token long): ``([N, T] ids, [N, T]
    log-probs)``, pad and 0 after a row's first EOS, ``T`` the steps run.

    ``next_token(logits [n, V], rows [n], t) -> (tokens [n], log-probs [n])`` draws the tokens
    of the rows still decoding (``rows``: their indices in ``0..N-1``) at completion position
    ``t``. Rows that emitted an EOS stop costing compute: once they make up ``EVICT_FRACTION``
    of the batch they are dropped from it and from the cache (``generate`` decodes every row
    until the last one ends).

    Args:
        last_ids: ``[N]`` last prompt token of each row; prompt_mask: ``[N, P]`` (left padding).
    """
    n = last_ids.shape[0]
    ids = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=last_ids.device)
    logps = torch.zeros(n, max_new_tokens, device=last_ids.device)
    eos = torch.tensor(eos_ids, device=last_ids.device)
    rows = torch.arange(n, device=last_ids.device)  # [n] rows still in the batch
    done = torch.zeros(n, dtype=torch.bool, device=last_ids.device)  # [n] of those, finished
    attn, token = prompt_mask, last_ids  # [n, P + t], [n]
    kwarg = cache_kwarg(model)
    steps = 0
    for t in range(max_new_tokens):
        out = model(
            input_ids=token[:, None],
            attention_mask=attn,
            position_ids=attn.sum(-1, keepdim=True) - 1,
            use_cache=True,
            logits_to_keep=1,
            **({} if cache is None else {kwarg: cache}),
        )
        cache = out[kwarg]
        token, logp = next_token(out.logits[:, -1], rows, t)  # [n] each
        live = ~done
        ids[rows[live], t] = token[live]
        logps[rows[live], t] = logp[live].float()
        steps = t + 1
        done = done | torch.isin(token, eos)
        if bool(done.all()):
            break
        if int(done.sum()) >= max(1, EVICT_FRACTION * len(rows)):
            keep = (~done).nonzero().squeeze(-1)  # [n']
            cache.batch_select_indices(keep)
            rows, token, attn, done = rows[keep], token[keep], attn[keep], done[keep]
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], dim=1)
    return ids[:, :steps], logps[:, :steps]


def row_position_temperatures(
    temperatures: torch.Tensor, factors: torch.Tensor, max_new_tokens: int
) -> torch.Tensor:
    """``[N, T_max]`` temperature of row ``n`` at completion position ``t``: ``T_n * f_t``.

    Args:
        temperatures: ``[N]`` per-row temperature (> 0).
        factors: ``[>= T_max]`` per-position factor (> 0), e.g. EAD's schedule.
    """
    if factors.dim() != 1 or factors.shape[0] < max_new_tokens:
        raise ValueError(
            f"position_temperatures must be 1-D with at least max_new_tokens={max_new_tokens} "
            f"entries, got shape {tuple(factors.shape)}."
        )
    f = factors[:max_new_tokens].to(temperatures.device, torch.float32)  # [T_max]
    if bool((f <= 0).any()):
        raise ValueError("position_temperatures must all be > 0.")
    return temperatures[:, None] * f[None, :]


def completion_mask(completion_ids: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """``[N, T]`` mask that is 1 up to and including the first EOS token of each row."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # [N, T] strictly after the first EOS
    return (~after_eos).long()


class HFEngine:
    """Batched decoding with KV cache (``decode``), left padding, per-row temperature and an
    optional per-position temperature factor (EAD).

    Args:
        model: the policy (shared; weights are always current, so ``load_weights`` is a no-op).
        tokenizer: its tokenizer; EOS and pad ids come from it.
        share_prompts: encode each prompt once and repeat its KV cache for the ``G`` rows of
            its group (see ``shared_prompt_cache``), instead of encoding it ``G`` times.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        share_prompts: bool = True,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.share_prompts = share_prompts
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
        position_temperatures: torch.Tensor | None = None,
    ) -> Rollouts:
        """``position_temperatures`` (``[T_max]``, ``T_max >= max_new_tokens``) multiplies each
        row's temperature at completion position ``t``; ignored when sampling is greedy (a
        positive factor does not move the argmax)."""
        g = sampling.group_size
        ids = prompt_ids.repeat_interleave(g, dim=0)  # [N, P]
        mask = prompt_mask.repeat_interleave(g, dim=0)  # [N, P]
        greedy = sampling.temperature <= 0 and temperatures is None
        if temperatures is None:
            temperatures = torch.full((ids.shape[0],), 1.0 if greedy else sampling.temperature)
        temperatures = temperatures.to(ids.device, torch.float32)  # [N]
        if not greedy and bool((temperatures <= 0).any()):
            raise ValueError("Per-row temperatures must be > 0; use temperature=0 for greedy.")
        per_token = None
        if position_temperatures is not None and not greedy:
            per_token = row_position_temperatures(
                temperatures, position_temperatures, sampling.max_new_tokens
            )  # [N, T_max]
        top_k = 0 if greedy else sampling.top_k
        top_p = 1.0 if greedy else sampling.top_p

        def next_token(logits: torch.Tensor, rows: torch.Tensor, t: int):
            temp = temperatures[rows] if per_token is None else per_token[rows, t]  # [n]
            logp = sampling_logprobs(logits, temp, top_k, top_p)  # [n, V]
            token = logp.argmax(-1) if greedy else sample_from_logprobs(logp)  # [n]
            return token, logp.gather(1, token[:, None]).squeeze(1)

        was_training = self.model.training
        self.model.eval()
        try:
            cache = None
            if ids.shape[1] > 1 and self.share_prompts:
                cache = shared_prompt_cache(self.model, prompt_ids, prompt_mask, g)
            elif ids.shape[1] > 1:
                cache = shared_prompt_cache(self.model, ids, mask, 1)
            completion_ids, logp = decode(
                self.model,
                cache,
                ids[:, -1],
                mask,
                sampling.max_new_tokens,
                next_token,
                self.eos_ids,
                self.tokenizer.pad_token_id,
            )  # [N, T] each
        finally:
            self.model.train(was_training)
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
            position_temperature=None
            if per_token is None
            else per_token[:, : completion_ids.shape[1]],
        )
