"""PolicyUpdate with injected rows: the mixed loss is what the update optimises."""

from __future__ import annotations

import pytest
import torch

from rlvr_lightning.algorithms.losses import agg_loss, ppo_clip_loss
from rlvr_lightning.algorithms.offpolicy_losses import mixed_policy_loss
from rlvr_lightning.device.forward import completion_logprobs
from rlvr_lightning.rollout.hf import HFEngine
from rlvr_lightning.stages.offpolicy import replace_rows
from rlvr_lightning.stages.update import PolicyUpdate
from rlvr_lightning.testing import tiny_policy
from rlvr_lightning.types import Sampling


def _mixed_rollouts():
    model, tok = tiny_policy(seed=1)
    tok.padding_side = "left"
    enc = tok(["ab", "hello there"], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    sampled = HFEngine(model, tok).generate(
        enc.input_ids, enc.attention_mask, Sampling(max_new_tokens=6, group_size=3)
    )
    eos = tok.eos_token_id
    rollouts = replace_rows(
        sampled,
        rows=[2, 5],
        token_ids=[[50, 51, 52, 53, 54, 55, 56, 57, 58, eos], [60, eos]],
        behaviour_logp=[None, [-0.3, -0.1]],
        sources=["reference", "experience"],
        temperatures=[1.0, 1.0],
        texts=["ref", "exp"],
        pad_id=tok.pad_token_id,
    )
    return model, rollouts


def _update(weighting: str, micro: int) -> PolicyUpdate:
    return PolicyUpdate(
        loss_fn=ppo_clip_loss,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
        agg_mode="token-mean",
        norm_len=6,
        kl_coef=0.0,
        kl_estimator="k3",
        entropy_coef=0.0,
        micro_batch_size=micro,
        offpolicy_weighting=weighting,
    )


ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


@pytest.mark.parametrize("weighting", ["shaping", "mis", "on_policy"])
def test_update_loss_is_the_mixed_loss_and_micro_batching_holds(weighting):
    model, ro = _mixed_rollouts()
    rows = torch.arange(6)
    with torch.no_grad():
        logp, _ = completion_logprobs(
            model,
            ro.prompt_ids,
            ro.prompt_mask,
            ro.completion_ids,
            ro.completion_mask,
            ro.temperature,
        )
    mat, _ = mixed_policy_loss(
        ppo_clip_loss,
        logp,
        ro.behaviour_logp,
        ADV,
        ro.completion_mask,
        ro.offpolicy_mask,
        weighting=weighting,
        gamma=0.1,
        exploration=0.5,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=None,
    )
    expected = agg_loss(mat, ro.completion_mask, "token-mean").item()
    off = ro.offpolicy_mask.bool() & ro.completion_mask.bool()
    prob_mean = logp.exp()[off].mean().item()  # over injected tokens only, whatever the split
    grads = []
    for micro in (6, 2):
        model.zero_grad()
        loss, metrics = _update(weighting, micro).accumulate(
            model, ro, ADV, rows, lambda f: None, lambda x: x.backward()
        )
        assert loss == pytest.approx(expected, abs=1e-5)
        grads.append([p.grad.clone() for p in model.parameters()])
        shares = [v for k, v in metrics.items() if k.endswith("/loss_share")]
        assert len(shares) == 3 and sum(shares) == pytest.approx(1.0, abs=1e-5)
        assert metrics["source/experience/advantage"] == pytest.approx(-2.0)
        assert metrics["offpolicy_prob_mean"] == pytest.approx(prob_mean, abs=1e-5)
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
