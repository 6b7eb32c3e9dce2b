"""``attention.grouped_attention`` against ``transformers``' SDPA on a tiny grouped-query Llama:
padded prefill, causal blocks, decoding from a cache, gradients, and its fallbacks."""

import copy

import pytest
import torch

from rlvr_lightning.device import attention, fast_paths
from rlvr_lightning.device.shared_prompts import cache_kwarg
from rlvr_lightning.testing import tiny_policy


@pytest.fixture(autouse=True)
def grouped_chosen():
    """These tests check the grouped path itself: it runs whatever this machine would choose."""
    paths = (attention.PATH, attention.DECODE_PATH)
    dtypes = ("float32", "bfloat16", "float16")
    with fast_paths.forced({f"{p}/{d}": "grouped" for p in paths for d in dtypes}):
        yield


@pytest.fixture
def pair():
    """The same tiny model with SDPA and with ``rlvr_grouped``."""
    sdpa, _ = tiny_policy(seed=0)
    assert sdpa.config._attn_implementation == "sdpa"
    assert sdpa.config.num_attention_heads > sdpa.config.num_key_value_heads  # grouped
    grouped = copy.deepcopy(sdpa)
    attention.prefer_grouped(grouped)
    assert grouped.config._attn_implementation == attention.NAME
    return sdpa, grouped


def _left_padded(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 250, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # rows of different padding, one of none
    mask[1, :1] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_padded_prefill_matches_sdpa_in_values_and_gradients(pair):
    sdpa, grouped = pair
    ids, mask, pos = _left_padded()
    real = mask.bool()
    outs = []
    for model in pair:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits[real].logsumexp(-1).sum().backward()
        outs.append(logits[real])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for p, q in zip(sdpa.parameters(), grouped.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-5)
    assert all(torch.isfinite(q.grad).all() for q in grouped.parameters())  # padded queries


def test_causal_block_without_mask_matches_sdpa(pair):
    ids, _, _ = _left_padded(1)
    a, b = (model(input_ids=ids).logits for model in pair)
    assert torch.allclose(a, b, atol=1e-5)


def test_decoding_from_a_cache_matches_sdpa(pair):
    ids, mask, pos = _left_padded(2)
    nxt = torch.randint(3, 250, (3, 1), generator=torch.Generator().manual_seed(3))
    longer = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    steps = []
    with torch.no_grad():
        for model in pair:
            kw = cache_kwarg(model)
            cache = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)[kw]
            out = model(
                input_ids=nxt,
                attention_mask=longer,
                position_ids=longer.sum(-1, keepdim=True) - 1,
                **{kw: cache},
            )
            steps.append(out.logits[:, -1])
    assert torch.allclose(steps[0], steps[1], atol=1e-5)


def test_bf16_autocast_error_no_larger_than_sdpas(pair):
    """In bf16 both differ from the fp32 result; the grouped path by no more than SDPA."""
    sdpa = pair[0]
    ids, mask, pos = _left_padded(4)
    real = mask.bool()
    with torch.no_grad():
        exact = sdpa(input_ids=ids, attention_mask=mask, position_ids=pos).logits[real]
        errors = []
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for model in pair:
                low = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[real]
                errors.append(float((low.float() - exact).abs().max()))
    assert errors[1] <= 2 * errors[0] + 1e-3, errors


def test_large_score_matrices_fall_back_to_sdpa(pair, monkeypatch):
    """Above MAX_SCORES (and for unsupported features) SDPA runs, with the same results."""
    calls = []
    real_sdpa = attention.sdpa_attention_forward

    def spy(*args, **kwargs):
        calls.append(1)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", spy)
    sdpa, grouped = pair
    ids, mask, pos = _left_padded(5)
    grouped(input_ids=ids, attention_mask=mask, position_ids=pos)
    assert calls == []  # small: the grouped path
    monkeypatch.setattr(attention, "MAX_SCORES", 0)
    a = sdpa(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    b = grouped(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert len(calls) == grouped.config.num_hidden_layers
    assert torch.equal(a, b)


def test_dtypes_outside_matmul_dtypes_keep_sdpa(monkeypatch):
    calls = []
    real_sdpa = attention.sdpa_attention_forward
    monkeypatch.setattr(
        attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or real_sdpa(*a, **k)
    )
    monkeypatch.setattr(attention, "MATMUL_DTYPES", (torch.bfloat16,))
    model, _ = tiny_policy(seed=0)
    attention.prefer_grouped(model)
    ids, mask, pos = _left_padded(6)
    model(input_ids=ids, attention_mask=mask, position_ids=pos)
    assert len(calls) == model.config.num_hidden_layers  # fp32, not listed: SDPA
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, attention_mask=mask, position_ids=pos)
    assert calls == []  # bf16: the matmuls


def test_prefer_grouped_leaves_other_implementations_alone():
    model, _ = tiny_policy(seed=0)
    model.set_attn_implementation("eager")
    attention.prefer_grouped(model)
    assert model.config._attn_implementation == "eager"


def test_the_backward_recomputes_the_weights_instead_of_keeping_them(pair):
    """No ``[.., Q, L]`` float tensor (scores, weights, their bf16 copy) is kept per layer."""
    _, grouped = pair
    ids, mask, pos = _left_padded(5)
    shapes = []

    def pack(t):
        shapes.append((t.dtype, tuple(t.shape)))
        return t

    for autocast in (False, True):
        shapes.clear()
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            grouped(input_ids=ids, attention_mask=mask, position_ids=pos)
        assert shapes  # the hook saw the forward
        assert not [s for d, s in shapes if d.is_floating_point and s[-2:] == (9, 9)]


def test_bf16_gradients_no_further_from_fp32_than_sdpas(pair):
    sdpa, grouped = pair
    ids, mask, pos = _left_padded(6)
    real = mask.bool()

    def grads(model, autocast):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        logits[real].float().logsumexp(-1).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    exact = grads(sdpa, False)
    err_sdpa = (grads(sdpa, True) - exact).norm()
    err_grouped = (grads(grouped, True) - exact).norm()
    assert err_grouped <= 1.5 * err_sdpa
