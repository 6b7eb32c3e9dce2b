"""The per-prompt outcome on hand-made groups, under every mechanism that can change a group.

Groups (G = 4) are set by hand: ``[1, 0, 0, 0]``, ``[1, 1, 0, 0]`` and ``[0, 0, 0, 0]``. The
same groups then go through each injection recipe and the data module's stats, replay and
curriculum: the outcome every mechanism reads must be the sampled one, ``k / G``, whatever was
injected (1/4, 1/2, 0; normalised variances 3/4, 1, 0 for the curriculum).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from rlvr_lightning.callbacks import GroundTruthInjection, MixedPolicyGuidance

from rlvr_lightning import RLVRModule
from rlvr_lightning.algorithms.offpolicy import mixed_advantages
from rlvr_lightning.algorithms.outcomes import informative_groups
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.curriculum import VarianceCurriculum
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.data.stats import observations
from rlvr_lightning.rewards import extract_boxed
from rlvr_lightning.stages.summary import summarise_step
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import PromptBatch, Rollouts, Sampling, Scored

G = 4
GROUPS = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
PASS_RATES = [0.25, 0.5, 0.0]
# Curriculum score 4k(G-k)/G^2 with the unbiased variance: k=1 -> 3/4, k=2 -> 1, k=0 -> 0.
CURRICULUM_SCORES = [0.75, 1.0, 0.0]


def boxed_match(completions: list[str], answer: list[str], **_: object) -> list[float]:
    return [float(extract_boxed(c) == str(a)) for c, a in zip(completions, answer, strict=True)]


@pytest.fixture(scope="module")
def module() -> RLVRModule:
    return RLVRModule(
        "tiny:0",
        **grouped(reward_fns=[boxed_match], sampling=Sampling(max_new_tokens=4, group_size=G)),
    )


def make_dm(**strategies) -> RLVRDataModule:
    dm = RLVRDataModule(train_size=40, val_size=4, prompts_per_step=3, **strategies)
    dm.setup("fit")
    return dm


def hand_made(module: RLVRModule, batch: PromptBatch, formats: list[float] | None = None):
    """The batch's rollouts with ``GROUPS`` as correctness; reward = correct + 0.25 format."""
    torch.manual_seed(0)
    scored = module.score(batch, module.rollout(batch))
    correct = torch.tensor([bool(c) for group in GROUPS for c in group])  # [N]
    fmt = torch.tensor(formats if formats is not None else [0.0] * len(correct))  # [N]
    rewards = correct.float() + 0.25 * fmt
    return dataclasses.replace(
        scored, correct=correct, rewards=rewards, sampled_correct=correct, sampled_rewards=rewards
    )


RECIPES = {
    "none": None,
    "gt_append": lambda: GroundTruthInjection(max_pass_rate=None, reward_capping=False),
    "gt_replace_last": lambda: GroundTruthInjection(
        max_pass_rate=None, reward_capping=False, composition="replace_last"
    ),
    "luffy": lambda: MixedPolicyGuidance(source="reference", injection="always", reward=1.0),
    "ampo_random": lambda: MixedPolicyGuidance(
        source="reference", injection="always", num_replaced=2, composition="replace_random"
    ),
}


def inject(module: RLVRModule, recipe: str, batch: PromptBatch, scored: Scored) -> Scored:
    if RECIPES[recipe] is None:
        return scored
    cb = RECIPES[recipe]()
    cb.on_before_rollout(None, module, batch)
    module.step_batch = batch
    return cb.on_after_score(None, module, scored)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_outcomes_and_logged_accuracy_ignore_whatever_is_injected(module, recipe):
    dm = make_dm(replay=PromptReplay(cooldown_steps=1), curriculum=VarianceCurriculum())
    batch = dm.compose_step()
    scored = inject(module, recipe, batch, hand_made(module, batch))
    if recipe != "none":  # every group got a correct reference: the trained rows changed
        assert scored.rollouts.offpolicy_mask is not None and bool(scored.correct.sum() > 3)
    adv = mixed_advantages(scored, "grpo", "mixed")
    out = summarise_step(0, batch, scored, adv, {}, lr=0.0)
    assert out.pass_rate.tolist() == PASS_RATES
    assert out.correct.long().tolist() == GROUPS
    assert out.metrics["accuracy"] == pytest.approx(3 / 12)
    assert out.metrics["reward"] == pytest.approx(3 / 12)
    if recipe != "none":
        assert out.metrics["accuracy_with_offpolicy"] > out.metrics["accuracy"]
    observed = observations(out)
    assert [(o.num_correct, o.group_size) for o in observed] == [(1, 4), (2, 4), (0, 4)]
    dm.on_step_output(out)
    ids = batch.prompt_ids
    assert [dm.stats.pass_rate(p) for p in ids] == PASS_RATES
    assert [dm.replay.pass_rates[p] for p in ids] == PASS_RATES
    assert ids[2] in dm.replay.zero_pass  # the all-wrong group, whatever was injected
    scores = [dm.curriculum.observation_score(o) for o in observed]
    assert scores == pytest.approx(CURRICULUM_SCORES)
    banked = {p for p, s in zip(ids, scores, strict=True) if s >= 0.75}
    assert set(dm.curriculum.bank.entries) == banked


@pytest.mark.parametrize("recipe", ["none", "gt_append", "luffy"])
@pytest.mark.parametrize("judge", ["trained", "sampled"])
def test_the_curriculum_mask_reads_the_rows_its_judge_names(module, recipe, judge):
    # kappa 0.3. As sampled the all-wrong group scores 0 and never trains, however rescued.
    # As trained (the default) a reference in its last slot makes it [0, 0, 0, 1]: k = 1,
    # 4*1*3/16 = 0.75 >= 0.3, so the rescue trains; the others score 1 and 0.75 either way.
    curriculum = VarianceCurriculum(kappa_start=0.3, kappa_end=0.3, judge=judge)
    dm = make_dm(curriculum=curriculum)
    batch = dm.compose_step()
    scored = inject(module, recipe, batch, hand_made(module, batch))
    module._trainer = SimpleNamespace(datamodule=dm)  # what select_groups reads of the trainer
    rescued = judge == "trained" and recipe != "none"
    try:
        assert module.select_groups(batch, scored).tolist() == [True, True, rescued]
    finally:
        module._trainer = None


def test_an_all_wrong_group_with_varied_formats_is_not_informative(module):
    dm = make_dm()
    batch = dm.compose_step()
    # Group 2 is all wrong but two of its samples have the format: its rewards differ.
    formats = [0.0] * 8 + [1.0, 0.0, 1.0, 0.0]
    scored = hand_made(module, batch, formats)
    assert informative_groups(scored.correct, scored.rewards, G, "accuracy").tolist() == [
        True,
        True,
        False,
    ]
    assert informative_groups(scored.correct, scored.rewards, G, "reward").tolist() == [True] * 3
    out = summarise_step(0, batch, scored, torch.zeros(12), {}, lr=0.0)
    assert out.metrics["uniform_outcome_frac"] == pytest.approx(1 / 3)
    assert out.metrics["zero_variance_frac"] == 0.0
    dapo = RLVRModule("tiny:0", **grouped(algorithm="dapo", reward_fns=[boxed_match]))
    assert dapo.filter_zero_variance and dapo.informative == "accuracy"
    assert dapo.select_groups(batch, scored).tolist() == [True, True, False]
    by_reward = RLVRModule(
        "tiny:0", **grouped(algorithm="dapo", informative="reward", reward_fns=[boxed_match])
    )
    assert by_reward.select_groups(batch, scored).tolist() == [True, True, True]


def test_a_prompt_observed_but_not_trained_is_not_replayed_within_its_cooldown():
    dm = make_dm(replay=PromptReplay(cooldown_steps=3, min_pass_rate=0.25, max_pass_rate=0.75))
    batch = dm.compose_step()
    correct = torch.tensor([[True, True, False, False]] * 3)  # pass rate 0.5: admissible
    out = dataclasses.replace(
        summarise_step(0, batch, _scored_like(correct), torch.zeros(12), {}, lr=0.0),
        trained=torch.tensor([False, False, False]),  # e.g. dynamic-sampling surplus
    )
    dm.on_step_output(out)
    for step in (1, 2):  # cooling down: fresh prompts only
        nxt = dm.compose_step()
        assert not set(nxt.prompt_ids) & set(batch.prompt_ids), step
        dm.on_step_output(_untouched(nxt, step))
    assert set(dm.compose_step().prompt_ids) & set(batch.prompt_ids)  # step 3: cooled


def _scored_like(correct: torch.Tensor) -> Scored:
    """Scored rows with ``[B, G]`` correctness as reward; one-token completions."""
    n, flat = correct.numel(), correct.reshape(-1)
    rollouts = Rollouts(
        prompt_ids=torch.ones(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1),
        completion_ids=torch.ones(n, 1, dtype=torch.long), completion_mask=torch.ones(n, 1),
        behaviour_logp=torch.zeros(n, 1), temperature=torch.ones(n),
        truncated=torch.zeros(n, dtype=torch.bool), completions=[""] * n, group_size=G,
    )  # fmt: skip
    return Scored(rollouts, flat.float(), {"acc": flat.float()}, flat)


def _untouched(batch: PromptBatch, step: int):
    """An all-wrong step (never admitted to replay) for the prompts of ``batch``."""
    correct = torch.zeros(len(batch), G, dtype=torch.bool)
    return summarise_step(step, batch, _scored_like(correct), torch.zeros(correct.numel()), {}, 0.0)
