import math

import pytest
import torch

from rlvr_lightning.device import decode_head
from rlvr_lightning.device.decode_head import head_by_blocks
from rlvr_lightning.device.forward import completion_logprobs
from rlvr_lightning.rollout import hf
from rlvr_lightning.rollout.hf import (
    HFEngine,
    completion_mask,
    draw,
    draw_rows,
    row_position_temperatures,
    sampling_scores,
)
from rlvr_lightning.testing import tiny_policy
from rlvr_lightning.types import Sampling


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = tiny_policy(seed=0)
    tokenizer.padding_side = "left"
    return HFEngine(model, tokenizer)


def _prompts(engine, texts):
    enc = engine.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def sampling_logprobs(logits, temperature, top_k, top_p):
    return sampling_scores(logits, temperature, top_k, top_p).log_softmax(-1)


def test_sampling_logprobs_temperature_topk_topp_by_hand():
    logits = torch.tensor([[math.log(4.0), math.log(2.0), math.log(1.0), math.log(1.0)]])
    # temperature 1: probs 4/8, 2/8, 1/8, 1/8
    got = sampling_logprobs(logits, torch.tensor([1.0]), top_k=0, top_p=1.0).exp()
    assert torch.allclose(got, torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    # temperature 2 takes square roots: 2, sqrt2, 1, 1 over 4 + sqrt2
    got = sampling_logprobs(logits, torch.tensor([2.0]), top_k=0, top_p=1.0).exp()
    z = 4 + math.sqrt(2)
    assert torch.allclose(got, torch.tensor([[2 / z, math.sqrt(2) / z, 1 / z, 1 / z]]))
    # top-k 2 keeps 4 and 2: 2/3, 1/3
    got = sampling_logprobs(logits, torch.tensor([1.0]), top_k=2, top_p=1.0).exp()
    assert torch.allclose(got, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))
    # top-p 0.6: mass before token 2 is 0.5 < 0.6 so it stays; before token 3 it is 0.75 -> drop
    got = sampling_logprobs(logits, torch.tensor([1.0]), top_k=0, top_p=0.6).exp()
    assert torch.allclose(got, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]]))


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9], [2, 0, 0, 0, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert torch.equal(completion_mask(ids, [2]), expected)


def test_behaviour_logprobs_match_a_forward_pass(engine):
    torch.manual_seed(0)
    ids, mask = _prompts(engine, ["hi", "a longer prompt here"])
    r = engine.generate(ids, mask, Sampling(max_new_tokens=10, temperature=0.7, group_size=3))
    assert r.completion_ids.shape[0] == 6 and r.group_size == 3
    with torch.no_grad():
        logp, _ = completion_logprobs(
            engine.model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            r.temperature,
        )
    diff = ((logp - r.behaviour_logp) * r.completion_mask).abs().max()
    assert diff < 1e-4
    assert torch.equal(r.truncated, r.completion_mask.sum(-1) == 10) or bool(r.truncated.any())


def test_per_row_temperature_and_greedy(engine):
    ids, mask = _prompts(engine, ["x", "yy"])
    greedy = Sampling(max_new_tokens=6, temperature=0.0, group_size=2)
    a = engine.generate(ids, mask, greedy)
    b = engine.generate(ids, mask, greedy)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_ids[0], a.completion_ids[1])  # same prompt, greedy
    temps = torch.tensor([0.5, 0.5, 2.0, 2.0])
    r = engine.generate(ids, mask, Sampling(max_new_tokens=6, group_size=2), temperatures=temps)
    assert torch.equal(r.temperature, temps)
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        engine.generate(ids, mask, Sampling(group_size=2), temperatures=torch.zeros(4))


def test_inverse_cdf_sampling_frequencies_and_never_a_cut_token():
    # probs 0.5, 0.25, 0 (cut by top-k), 0.25, as unnormalised scores (log 2, log 1, -inf,
    # log 1): 20000 draws land within 0.02 of them, and each log-prob is its token's log p.
    scores = torch.tensor([2.0, 1.0, 0.0, 1.0]).log().expand(20000, 4)
    torch.manual_seed(0)
    picked, logp = draw(scores)
    freq = torch.bincount(picked, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.0, 0.25]), atol=0.02)
    assert int((picked == 2).sum()) == 0
    expected = torch.tensor([0.5, 0.25, 0.0, 0.25]).log()[picked]
    assert torch.allclose(logp, expected)


def test_greedy_draw_takes_the_argmax_with_its_logprob():
    scores = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, float("-inf")]])
    token, logp = draw(scores, greedy=True)
    assert token.tolist() == [1, 0]
    assert torch.allclose(logp, scores.log_softmax(-1)[[0, 1], [1, 0]])


def test_drawing_in_row_blocks_takes_the_same_uniforms_as_all_rows_at_once(monkeypatch):
    # 37 rows in blocks of 16, 16, 5 draw what one block of 37 draws from the same seed
    logits = torch.randn(37, 50, generator=torch.Generator().manual_seed(1)) * 3
    temps = torch.linspace(0.5, 2.0, 37)
    torch.manual_seed(0)
    blocked = draw_rows(logits, temps, top_k=10, top_p=0.9, greedy=False)
    monkeypatch.setattr(hf, "DRAW_ROWS", 37)
    torch.manual_seed(0)
    whole = draw_rows(logits, temps, top_k=10, top_p=0.9, greedy=False)
    assert torch.equal(blocked[0], whole[0])
    assert torch.allclose(blocked[1], whole[1])
    expected = sampling_logprobs(logits, temps, 10, 0.9).gather(1, whole[0][:, None])
    assert torch.allclose(whole[1], expected.squeeze(1), atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_the_decode_head_by_blocks_is_the_linear_head(monkeypatch, bias):
    # 10 vocabulary rows in blocks of 4, 4, 2; hidden [2, 1, 3] as in a decoding step
    monkeypatch.setattr(decode_head, "HEAD_BLOCK", 4)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 3, generator=gen)
    b = torch.randn(10, generator=gen) if bias else None
    hidden = torch.randn(2, 1, 3, generator=gen)
    got = head_by_blocks(weight, b, hidden)
    assert got.shape == (2, 1, 10) and got.is_contiguous()
    assert torch.allclose(got, torch.nn.functional.linear(hidden, weight, b), atol=1e-6)


def test_shared_prompt_cache_gives_the_same_greedy_rollouts(engine):
    ids, mask = _prompts(engine, ["hi", "a longer prompt here"])
    greedy = Sampling(max_new_tokens=8, temperature=0.0, group_size=3)
    engine.share_prompts = False
    plain = engine.generate(ids, mask, greedy)
    engine.share_prompts = True
    shared = engine.generate(ids, mask, greedy)
    assert torch.equal(plain.completion_ids, shared.completion_ids)
    assert torch.allclose(plain.behaviour_logp, shared.behaviour_logp, atol=1e-5)


def _manual_logprobs(model, r, temps):
    """``[N, T]`` log-probs of the completion tokens under ``log_softmax(logits / temps)``."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], dim=1)  # [N, P + T]
    mask = torch.cat([r.prompt_mask, r.completion_mask], dim=1)  # [N, P + T]
    p, t = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits[:, p - 1 : p + t - 1]  # [N, T, V]
    logp = torch.log_softmax(logits.float() / temps[:, :, None], dim=-1)  # [N, T, V]
    return logp.gather(-1, r.completion_ids[:, :, None]).squeeze(-1)


def test_row_position_temperatures_multiply_and_validate():
    # Rows 0.5 and 2.0 times factors [1, 0.5, 0.25] (the 4th factor is beyond T_max = 3).
    got = row_position_temperatures(torch.tensor([0.5, 2.0]), torch.tensor([1, 0.5, 0.25, 9]), 3)
    assert got.tolist() == [[0.5, 0.25, 0.125], [2.0, 1.0, 0.5]]
    with pytest.raises(ValueError, match="at least max_new_tokens=3"):
        row_position_temperatures(torch.ones(2), torch.ones(2), 3)
    with pytest.raises(ValueError, match="> 0"):
        row_position_temperatures(torch.ones(2), torch.tensor([1.0, 0.0, 1.0]), 3)


def test_position_temperatures_reach_the_sampler_and_its_logprobs(engine):
    # Factors 1, 1, 3, 0.2, 0.05, ... on rows at 0.7 and 1.5: each recorded log-prob is that of
    # log_softmax(logits / (T_row * f_t)) at its own position t.
    torch.manual_seed(0)
    ids, mask = _prompts(engine, ["hi", "a longer prompt"])
    factors = torch.tensor([1.0, 1.0, 3.0, 0.2, 0.05, 0.5, 2.0, 1.0])
    temps = torch.tensor([0.7, 0.7, 1.5, 1.5])
    r = engine.generate(
        ids, mask, Sampling(max_new_tokens=8, group_size=2), temps, position_temperatures=factors
    )
    t = r.completion_ids.shape[1]
    assert torch.allclose(r.position_temperature, temps[:, None] * factors[None, :t])
    assert torch.equal(r.temperature, temps)  # the rows' base temperature is kept
    manual = _manual_logprobs(engine.model, r, r.position_temperature)
    assert ((manual - r.behaviour_logp) * r.completion_mask).abs().max() < 1e-4
    # The per-row forward of the update (no schedule) does not reproduce them.
    per_row = _manual_logprobs(engine.model, r, temps[:, None].expand(-1, t))
    assert ((per_row - r.behaviour_logp) * r.completion_mask).abs().max() > 1e-2


def test_a_tiny_position_temperature_samples_the_argmax(engine):
    ids, mask = _prompts(engine, ["x", "yy"])
    greedy = engine.generate(ids, mask, Sampling(max_new_tokens=6, temperature=0.0, group_size=2))
    torch.manual_seed(0)
    cold = engine.generate(
        ids,
        mask,
        Sampling(max_new_tokens=6, temperature=1.0, group_size=2),
        position_temperatures=torch.full((6,), 1e-5),
    )
    assert torch.equal(cold.completion_ids, greedy.completion_ids)
    assert float(cold.behaviour_logp.min()) > -1e-3  # each drawn token had probability ~1
    # Greedy sampling ignores the factors: same tokens and log-probs as without them.
    again = engine.generate(
        ids,
        mask,
        Sampling(max_new_tokens=6, temperature=0.0, group_size=2),
        position_temperatures=torch.full((6,), 3.0),
    )
    assert torch.equal(again.completion_ids, greedy.completion_ids)
    assert again.position_temperature is None


@pytest.mark.parametrize("evict_fraction", [0.0, 0.5])
def test_finished_rows_leave_the_batch_and_the_others_decode_unchanged(
    engine, monkeypatch, evict_fraction
):
    """Rows end at different steps (an EOS id chosen from a first greedy run); whether they
    leave the batch at once (fraction 0) or in pairs, every row's tokens and log-probs are the
    first run's up to its EOS, and pad / 0 after it."""
    import rlvr_lightning.rollout.hf as hf

    ids, mask = _prompts(engine, ["hi", "a longer prompt here", "xyz"])
    greedy = Sampling(max_new_tokens=10, temperature=0.0, group_size=2)
    first = engine.generate(ids, mask, greedy)
    stop = int(first.completion_ids[0, 2])  # row 0 ends at step 2, others wherever it appears
    monkeypatch.setattr(hf, "EVICT_FRACTION", evict_fraction)
    monkeypatch.setattr(engine, "eos_ids", [stop])
    calls = []
    handle = engine.model.register_forward_pre_hook(
        lambda _m, _a, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        ended = engine.generate(ids, mask, greedy)
    finally:
        handle.remove()
    assert calls[1] == 6 and min(calls) < 6  # rows left the batch
    for row in range(6):
        hits = (first.completion_ids[row] == stop).nonzero()
        n = int(hits[0]) + 1 if len(hits) else 10
        assert torch.equal(ended.completion_ids[row, :n], first.completion_ids[row, :n])
        torch.testing.assert_close(ended.behaviour_logp[row, :n], first.behaviour_logp[row, :n])
        assert int(ended.completion_mask[row].sum()) == n
        assert (ended.behaviour_logp[row, n:] == 0).all()
        assert (ended.completion_ids[row, n:] == engine.tokenizer.pad_token_id).all()
    assert ended.completion_ids.shape[1] == max(int(m.sum()) for m in ended.completion_mask)


def test_fp32_decoding_uses_the_head_by_blocks_and_bf16_does_not(engine, monkeypatch):
    ids, mask = _prompts(engine, ["hi", "a longer prompt here"])
    greedy = Sampling(max_new_tokens=6, temperature=0.0, group_size=2)
    plain = engine.generate(ids, mask, greedy)  # the tiny vocabulary in one block
    calls = []
    monkeypatch.setattr(decode_head, "HEAD_BLOCK", 7)  # the tiny vocabulary in several blocks
    original = decode_head.head_by_blocks
    monkeypatch.setattr(decode_head, "head_by_blocks", lambda *a: calls.append(1) or original(*a))
    blocked = engine.generate(ids, mask, greedy)
    assert len(calls) == blocked.completion_ids.shape[1]  # every decoding step
    assert torch.equal(blocked.completion_ids, plain.completion_ids)
    assert torch.allclose(blocked.behaviour_logp, plain.behaviour_logp, atol=1e-5)
    assert "forward" not in vars(engine.model.get_output_embeddings())  # restored
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.generate(ids, mask, greedy)
    assert calls == []
