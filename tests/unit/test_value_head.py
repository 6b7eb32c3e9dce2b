"""ValueHead: values from the log-prob forward, the fused V_old pass, gradients, setup checks."""

from __future__ import annotations

import functools

import pytest
import torch

from rlvr_lightning.device import trainer_forward
from rlvr_lightning.device.forward import completion_forward
from rlvr_lightning.heads import ValueBatch, ValueHead
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.stages.build import check_value_head
from rlvr_lightning.stages.lifecycle import plain_hparam
from rlvr_lightning.stages.update import PolicyUpdate
from rlvr_lightning.testing import ppo_update, tiny_policy
from rlvr_lightning.types import Sampling


def _rollouts(seed: int = 0):
    model, tok = tiny_policy(seed=seed)
    tok.padding_side = "left"
    enc = tok(["ab", "hello there"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    rollouts = HFEngine(model, tok).generate(
        enc.input_ids, enc.attention_mask, Sampling(max_new_tokens=8, group_size=3)
    )
    return model, rollouts


def _head(hidden: int, **kwargs) -> ValueHead:
    head = ValueHead(hidden, **kwargs)
    with torch.no_grad():  # a non-zero head, so the values say something
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return head


def _inputs(r, idx=slice(None)):
    return (
        r.prompt_ids[idx],
        r.prompt_mask[idx],
        r.completion_ids[idx],
        r.completion_mask[idx],
        r.temperature[idx],
    )


def test_zero_initialised_heads_start_at_zero_and_mlp_has_its_layer() -> None:
    h = torch.randn(2, 5, 32)  # [n, t, H]
    assert torch.equal(ValueHead(32)(h), torch.zeros(2, 5))
    mlp = ValueHead(32, mlp_hidden=8)
    assert [type(m).__name__ for m in mlp.net] == ["Linear", "GELU", "Linear"]
    assert mlp(h.bfloat16()).dtype == torch.float32
    assert ValueHead(32).param_group()["lr"] == 1e-4


@pytest.mark.parametrize("share", [True, False])
def test_values_are_the_head_on_the_hidden_state_before_each_token(share: bool) -> None:
    # Reference: the decoder's final (normed) hidden states of prompt + completion; the value
    # of completion token t sits at the position that predicts it, P + t - 1.
    model, r = _rollouts(seed=1)
    head = _head(32)
    with torch.no_grad():
        out = completion_forward(model, *_inputs(r), share_prompts=share, value_head=head)
        attn = torch.cat([r.prompt_mask, r.completion_mask], dim=1)  # [N, P + T]
        hidden = model.model(
            input_ids=torch.cat([r.prompt_ids, r.completion_ids], dim=1),
            attention_mask=attn,
            position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
        ).last_hidden_state  # [N, P + T, H]
        p, t = r.prompt_ids.shape[1], r.completion_ids.shape[1]
        expected = head(hidden[:, p - 1 : p + t - 1])  # [N, T]
    valid = r.completion_mask.bool()
    torch.testing.assert_close(out.values[valid], expected[valid], atol=1e-5, rtol=1e-4)
    assert (out.values[:, valid.sum(0) == 0] == 0).all()  # trimmed columns


def test_fused_pass_gives_old_logprobs_and_values_of_the_update_forward() -> None:
    model, r = _rollouts(seed=2)
    head = _head(32)
    logp, values, _ = trainer_forward(model, r, micro_batch_size=2, value_head=head)
    with torch.no_grad():
        out = completion_forward(model, *_inputs(r), value_head=head)
    mask = r.completion_mask.bool()
    torch.testing.assert_close(logp[mask], out.logp[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values[mask], out.values[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(values[~mask], torch.zeros_like(values[~mask]))


def _update(micro: int) -> PolicyUpdate:
    return ppo_update(micro_batch_size=micro)


def _value_step(model, r, head, micro: int):
    model.zero_grad()
    head.zero_grad()
    _, old, _ = trainer_forward(model, r, micro, head)  # [N, T]
    returns = torch.where(r.completion_mask.bool(), old + 0.1, 0.0)  # [N, T]
    adv = torch.zeros(r.num_rows)  # [N]: only the value loss moves anything
    _, metrics = _update(micro).accumulate(
        model,
        r,
        adv,
        torch.arange(r.num_rows),
        lambda f: None,
        lambda x: x.backward(),
        value=ValueBatch(head, old, returns),
    )
    return metrics, [p.grad.clone() for p in head.parameters()]


def test_value_loss_in_the_update_is_exact_and_micro_batch_invariant() -> None:
    # Before any step V = V_old exactly and R = V_old + 0.1, so the loss is 0.5 * 0.01 = 0.005
    # whatever the micro-batching, and the accumulated head gradient is the full batch's.
    model, r = _rollouts(seed=3)
    head = _head(32)
    full, full_grads = _value_step(model, r, head, micro=6)
    part, part_grads = _value_step(model, r, head, micro=2)
    for metrics in (full, part):
        assert metrics["value_loss"] == pytest.approx(0.005, abs=1e-6)
        assert metrics["value_clip_frac"] == 0.0
    for a, b in zip(full_grads, part_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("train_trunk", [False, True])
def test_value_gradient_reaches_the_policy_only_with_train_trunk(train_trunk: bool) -> None:
    model, r = _rollouts(seed=4)
    head = _head(32, train_trunk=train_trunk)
    out = completion_forward(model, *_inputs(r), value_head=head)
    out.values.sum().backward()
    policy_grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert all(p.grad is not None for p in head.parameters())
    assert bool(policy_grads) is train_trunk


def test_estimator_and_value_head_must_go_together() -> None:
    with pytest.raises(ValueError, match="value_head"):
        check_value_head("gae", has_value_head=False)
    with pytest.raises(ValueError, match="estimator: gae"):
        check_value_head("grpo", has_value_head=True)
    check_value_head("gae", has_value_head=True)
    check_value_head("rloo", has_value_head=False)


def test_value_head_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="gamma"):
        ValueHead(8, gamma=1.5)
    with pytest.raises(ValueError, match="clip_range"):
        ValueHead(8, clip_range=0.0)


def test_a_value_head_factory_is_a_plain_hyperparameter() -> None:
    # What LightningCLI passes for value_head: a partial of the class with its init args.
    factory = functools.partial(ValueHead, lr=0.01, clip_range=None)
    assert plain_hparam(factory) == {
        "class_path": "rlvr_lightning.heads.value.ValueHead",
        "init_args": {"lr": 0.01, "clip_range": None},
    }
    assert plain_hparam(ValueHead) == "rlvr_lightning.heads.value.ValueHead"
