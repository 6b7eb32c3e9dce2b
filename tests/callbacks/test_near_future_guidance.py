"""NPO's gate and mistake pool read the prompt's sampled outcome on hand-made groups, whatever
another callback injected before it, and its own injection leaves that outcome unchanged."""

from __future__ import annotations

import dataclasses

import torch
from rlvr_lightning.callbacks import NearFuturePolicyGuidance

from rlvr_lightning import RLVRModule
from rlvr_lightning.guidance.lookahead import trainable_state
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import PromptBatch, Sampling

G = 4


def always_right(completions, **_):
    return [1.0] * len(completions)


def test_gate_and_pool_read_the_sampled_outcome_under_prior_injection():
    torch.manual_seed(0)
    module = RLVRModule(
        "tiny:0",
        **grouped(
            reward_fns=[always_right],
            sampling=Sampling(max_new_tokens=6, temperature=1.0, group_size=G),
        ),
    )
    batch = PromptBatch(
        prompt_ids=["a", "b", "c"],
        messages=[[{"role": "user", "content": f"q{i}"}] for i in range(3)],
        columns={"answer": ["1", "2", "3"]},
    )
    scored = module.score(batch, module.rollout(batch))
    sampled = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0], dtype=torch.bool)
    # as trained: another callback put a correct reference in the last slot of group c
    trained = sampled.clone()
    trained[11] = True
    sources = ("policy",) * 11 + ("reference",)
    scored = dataclasses.replace(
        scored,
        correct=trained,
        sampled_correct=sampled,
        sampled_rewards=sampled.float(),
        rewards=trained.float(),
        rollouts=dataclasses.replace(scored.rollouts, sources=sources),
    )
    cb = NearFuturePolicyGuidance(mode="auto", guide_samples=2)
    cb.guide_weights = trainable_state(module.policy)
    cb.active_until, cb.guide_step = 5, 3
    cb.on_before_rollout(None, module, batch)
    out = cb.on_after_score(None, module, scored)
    tags = out.rollouts.sources
    guided = sorted({i // G for i, t in enumerate(tags) if t == "npo"})
    # a: 1/4 < 0.6 and c: 0/4 sampled (1/4 as trained) are guided; b: 3/4 is not
    assert guided == [0, 2]
    assert out.metrics["npo/guided_groups"] == 2.0 and out.metrics["npo/injected"] == 2.0
    # replace_random takes an incorrect sampled slot; the reference in c stays
    assert tags[11] == "reference"
    assert all(not bool(sampled[i]) for i, t in enumerate(tags) if t == "npo")
    # the prompt's outcome is untouched by the injection
    assert torch.equal(out.sampled_correct, sampled)
    # the pool holds c (no sampled row correct); a and b each had a correct sample
    assert [pid for pid, _ in cb.pool.newest(10)] == ["c"]
    assert cb.pool.entries["c"]["columns"] == {"answer": "3"}
