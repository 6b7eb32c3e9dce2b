"""The chunked LM head in ``completion_forward`` and the update: same numbers as full logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rlvr_lightning import models
from rlvr_lightning.device import cpu_linear
from rlvr_lightning.device.forward import completion_forward, fused_head
from rlvr_lightning.heads import ValueHead
from rlvr_lightning.module import RLVRModule
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.stages.update import PolicyUpdate
from rlvr_lightning.testing import grouped, ppo_update, tiny_policy
from rlvr_lightning.types import Sampling

CHUNK = 5  # tokens per chunk: several chunks per micro-batch, not a divisor of n * t


def _rollouts(seed: int = 0):
    model, tok = tiny_policy(seed=seed)
    tok.padding_side = "left"
    enc = tok(["ab", "hello there"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    r = HFEngine(model, tok).generate(
        enc.input_ids, enc.attention_mask, Sampling(max_new_tokens=8, group_size=3)
    )
    # Per-row temperatures other than 1, so the chunks divide by them too.
    return model, dataclasses.replace(r, temperature=torch.tensor([1.0, 0.7, 1.3, 0.9, 1.0, 1.6]))


def _inputs(r):
    return r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, r.temperature


def _forward_and_grads(model, r, chunk, share, head=None):
    model.zero_grad()
    if head is not None:
        head.zero_grad()
    out = completion_forward(
        model,
        *_inputs(r),
        with_entropy=True,
        entropy_grad=True,
        share_prompts=share,
        value_head=head,
        head_chunk_tokens=chunk,
    )
    mask = r.completion_mask.bool()
    loss = out.logp[mask].sum() + 0.3 * out.entropy[mask].sum()
    if head is not None:
        loss = loss + out.values[mask].sum()
    loss.backward()
    values = [out.logp[mask], out.entropy[mask]]
    if head is not None:
        values.append(out.values[mask])
    params = [*model.parameters(), *(head.parameters() if head is not None else ())]
    return [v.detach() for v in values], [p.grad.clone() for p in params if p.requires_grad]


@pytest.mark.parametrize("share", [True, False])
def test_fused_forward_matches_full_logits_in_value_and_gradient(share: bool, monkeypatch) -> None:
    # The chunking's arithmetic, on one matmul kernel: the fused head would take oneDNN and the
    # model's head MKL, which differ by fp32 rounding (cpu_linear's own tests cover that).
    monkeypatch.setattr(cpu_linear, "available", lambda: False)
    model, r = _rollouts(seed=3)
    head = ValueHead(32, train_trunk=True)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    fused = _forward_and_grads(model, r, CHUNK, share, head)
    full = _forward_and_grads(model, r, None, share, head)
    for a, e in zip([*fused[0], *fused[1]], [*full[0], *full[1]], strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_fused_forward_under_bf16_autocast_is_close_to_full_logits() -> None:
    model, r = _rollouts(seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _forward_and_grads(model, r, CHUNK, True)
        full = _forward_and_grads(model, r, None, True)
    for a, e in zip([*fused[0], *fused[1]], [*full[0], *full[1]], strict=True):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=3e-2, rtol=3e-2)


class _LargestVocabBlock(TorchDispatchMode):
    """The most rows of any ``[..., V]`` tensor an op returns while active, forward and
    backward (a dispatch mode sees the autograd engine's ops too); views of the parameters
    (``W^T`` is ``[H, V]``) are not counted."""

    def __init__(self, vocab: int, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or not t.dim() or t.shape[-1] != self.vocab:
                continue
            if t.untyped_storage().data_ptr() not in self.params:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("chunk", [CHUNK, None])
def test_no_logits_block_over_a_chunk_exists_in_forward_or_backward(chunk: int | None) -> None:
    model, r = _rollouts(seed=7)
    with _LargestVocabBlock(model.config.vocab_size, list(model.parameters())) as seen:
        _forward_and_grads(model, r, chunk, True)
    n, t = r.num_rows, int(r.completion_mask.sum(-1).max())
    assert seen.rows == (CHUNK if chunk else n * (t - 1))  # full logits: the [n, t - 1, V] piece


def _update(chunk: int | None) -> PolicyUpdate:
    return ppo_update(kl_coef=0.1, entropy_coef=0.01, head_chunk_tokens=chunk)


def test_update_gradient_is_the_same_with_and_without_the_chunked_head() -> None:
    model, r = _rollouts(seed=5)
    reference = models.frozen_copy(model)
    with torch.no_grad():  # a reference that differs, so the KL term has a gradient
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    results = []
    for chunk in (CHUNK, None):
        model.zero_grad()
        loss, metrics = _update(chunk).accumulate(
            model,
            r,
            adv,
            torch.arange(6),
            lambda compute: compute(reference),
            lambda x: x.backward(),
        )
        results.append((loss, metrics, [p.grad.clone() for p in model.parameters()]))
    (loss_a, m_a, g_a), (loss_b, m_b, g_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    assert m_a["kl"] == pytest.approx(m_b["kl"], abs=1e-6)
    assert m_a["entropy"] == pytest.approx(m_b["entropy"], abs=1e-6)
    for a, e in zip(g_a, g_b, strict=True):
        torch.testing.assert_close(a, e, atol=1e-6, rtol=1e-5)


def test_module_option_reaches_the_update_and_is_validated() -> None:
    assert RLVRModule("tiny:0").updater.head_chunk_tokens == 1024
    assert RLVRModule("tiny:0", **grouped(head_chunk_tokens=64)).updater.head_chunk_tokens == 64
    assert RLVRModule("tiny:0", **grouped(chunked_head=False)).updater.head_chunk_tokens is None
    with pytest.raises(ValueError, match="chunked_head: false"):
        RLVRModule("tiny:0", **grouped(head_chunk_tokens=0))


def test_lora_policy_keeps_the_fused_head_unless_lm_head_is_adapted() -> None:
    model, _ = tiny_policy(seed=0)
    lora = models.add_lora(model, 4, 8.0, 0.0, "all-linear")
    assert fused_head(lora) is lora.get_output_embeddings()
    model, _ = tiny_policy(seed=0)
    adapted = models.add_lora(model, 4, 8.0, 0.0, ["q_proj", "lm_head"])
    assert fused_head(adapted) is None  # a peft layer: the model's own head


def test_lora_fused_forward_matches_full_logits() -> None:
    model, r = _rollouts(seed=6)
    lora = models.add_lora(model, 4, 8.0, 0.0, "all-linear")
    with torch.no_grad():  # non-zero adapters, so they change the log-probs
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    fused = _forward_and_grads(lora, r, CHUNK, True)
    full = _forward_and_grads(lora, r, None, True)
    assert len(fused[1]) == sum(p.requires_grad for p in lora.parameters()) > 0
    for a, e in zip([*fused[0], *fused[1]], [*full[0], *full[1]], strict=True):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_models_that_post_process_logits_keep_their_head() -> None:
    model, _ = tiny_policy(seed=0)
    assert fused_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0  # as Gemma 2's config says
    assert fused_head(model) is None
    model, _ = tiny_policy(seed=0)
    model.lm_head.register_forward_hook(lambda _m, _a, out: out)
    assert fused_head(model) is None


class _ScaledLogits(nn.Module):
    """A causal LM that scales its head's output, with nothing in its config to say so."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits * 2.0
        return out


def test_unknown_logit_post_processing_is_refused_with_the_fix() -> None:
    model, r = _rollouts(seed=0)
    scaled = _ScaledLogits(model)
    with torch.no_grad(), pytest.raises(RuntimeError, match="chunked_head: false"):
        completion_forward(scaled, *_inputs(r), share_prompts=False, head_chunk_tokens=CHUNK)
    assert "forward" not in vars(model.lm_head)  # the head is restored after the error
    with torch.no_grad():
        out = completion_forward(scaled, *_inputs(r), share_prompts=False, head_chunk_tokens=None)
    assert torch.isfinite(out.logp).all()
