"""Rollouts from the policy itself (a ``transformers`` model): prompt prefill once per group,
then a decode loop that drops finished rows, with our own sampling and its log-probs."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from rlvr_lightning.device import cache_kwarg, fp32_head_by_blocks, prompt_pass
from rlvr_lightning.types import Rollouts, Sampling


def sampling_scores(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float
) -> torch.Tensor:
    """Unnormalised log-weights of the distribution actually sampled from: temperature, then
    top-k, top-p (cut tokens are ``-inf``); ``log_softmax`` of them gives its log-probs.

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
    return scores


def draw(scores: torch.Tensor, greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``[N, V]`` scores (``sampling_scores``) and its log-prob under
    their normalised distribution: ``([N] ids, [N] log-probs)``; ``greedy`` takes the argmax.

    Sampling is by inverse CDF: one uniform per row and a cumulative sum of the weights
    replace ``torch.multinomial``, whose exponential draw over all ``N * V`` entries was ~13%
    of generation time on CPU. The weights are not normalised first (the uniform is scaled by
    their sum), so no ``[N, V]`` log-softmax is built. Tokens of weight 0 (cut by top-k /
    top-p) are never drawn: the CDF is flat there and ``searchsorted(..., right=True)``
    returns the first index whose CDF exceeds ``u``.
    """
    top = scores.amax(-1, keepdim=True)  # [N, 1]
    weights = (scores - top).exp_()  # [N, V], the largest is 1
    if greedy:
        token = scores.argmax(-1)  # [N]
        total = weights.sum(-1, keepdim=True)  # [N, 1]
    else:
        cdf = weights.cumsum_(-1)  # [N, V]
        total = cdf[:, -1:]  # [N, 1]
        u = torch.rand(cdf.shape[0], 1, device=cdf.device) * total  # [N, 1]
        token = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
    logp = scores.gather(1, token[:, None]) - top - total.log()  # [N, 1]
    return token, logp.squeeze(1)


# Rows whose next token is drawn together: a [16, V] block of the embedded model's vocabulary
# (3 MB in fp32) stays in the CPU's cache through temperature, exp, cumsum and search, where
# 64 rows at once spill it (measured 3.3 ms against 12-22 ms a step at 64 rows; this project's
# choice).
DRAW_ROWS = 16


def draw_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``draw(sampling_scores(...))`` for ``[N, V]`` logits, ``DRAW_ROWS`` rows at a time."""
    picked = [
        draw(
            sampling_scores(
                logits[i : i + DRAW_ROWS], temperature[i : i + DRAW_ROWS], top_k, top_p
            ),
            greedy,
        )
        for i in range(0, logits.shape[0], DRAW_ROWS)
    ]
    return torch.cat([p[0] for p in picked]), torch.cat([p[1] for p in picked])


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
        temperatures, per_token = row_temperatures(
            sampling, temperatures, position_temperatures, ids.shape[0], greedy, ids.device
        )  # [N], [N, T_max] or None
        top_k = 0 if greedy else sampling.top_k
        top_p = 1.0 if greedy else sampling.top_p

        def next_token(logits: torch.Tensor, rows: torch.Tensor, t: int):
            temp = temperatures[rows] if per_token is None else per_token[rows, t]  # [n]
            return draw_rows(logits, temp, top_k, top_p, greedy)

        with _eval_mode(self.model):
            cache = None
            if ids.shape[1] > 1 and self.share_prompts:
                cache = shared_prompt_cache(self.model, prompt_ids, prompt_mask, g)
            elif ids.shape[1] > 1:
                cache = shared_prompt_cache(self.model, ids, mask, 1)
            with fp32_head_by_blocks(self.model):
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
        return self._rollouts(ids, mask, completion_ids, logp, temperatures, per_token, g)

    def _rollouts(self, ids, mask, completion_ids, logp, temperatures, per_token, g) -> Rollouts:
        """The decoded rows as ``Rollouts``: completion mask up to EOS, texts, truncation."""
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


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def row_temperatures(
    sampling: Sampling,
    temperatures: torch.Tensor | None,
    position_temperatures: torch.Tensor | None,
    rows: int,
    greedy: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[N]`` fp32 temperature of each row (1 when greedy) and, with a per-position schedule
    (not greedy), the ``[N, T_max]`` temperature of each row and position."""
    if temperatures is None:
        temperatures = torch.full((rows,), 1.0 if greedy else sampling.temperature)
    temperatures = temperatures.to(device, torch.float32)  # [N]
    if not greedy and bool((temperatures <= 0).any()):
        raise ValueError("Per-row temperatures must be > 0; use temperature=0 for greedy.")
    if position_temperatures is None or greedy:
        return temperatures, None
    per_token = row_position_temperatures(
        temperatures, position_temperatures, sampling.max_new_tokens
    )  # [N, T_max]
    return temperatures, per_token
