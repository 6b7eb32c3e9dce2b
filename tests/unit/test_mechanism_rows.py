"""Issue 37's rows D1-D5 and E1-E5: each mechanism correct when combined with another or run
with non-default settings. Every test here failed on the code before the fix (see the issue).
Hand-made groups on the tiny in-process model; no fit."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from rlvr_lightning.callbacks import MixedPolicyGuidance

from rlvr_lightning import RLVRModule
from rlvr_lightning.algorithms import advantages
from rlvr_lightning.algorithms.losses import agg_loss
from rlvr_lightning.algorithms.offpolicy import floor_accuracy, mixed_advantages
from rlvr_lightning.algorithms.ops import masked_whiten
from rlvr_lightning.algorithms.outcomes import informative_groups
from rlvr_lightning.algorithms.presets import get_preset
from rlvr_lightning.data import RLVRDataModule
from rlvr_lightning.data.replay import PromptReplay
from rlvr_lightning.device import completion_logprobs
from rlvr_lightning.guidance.experience import ExperiencePool, Trajectory
from rlvr_lightning.heads import ProbeHead, ValueHead
from rlvr_lightning.testing import grouped
from rlvr_lightning.types import PromptBatch, Sampling, Scored, StepOutput

ROOT = Path(__file__).resolve().parents[2]


def _batch(n: int, answer: str = "7") -> PromptBatch:
    return PromptBatch(
        prompt_ids=[f"p{i}" for i in range(n)],
        messages=[[{"role": "user", "content": f"q{i}"}] for i in range(n)],
        columns={"answer": [answer] * n},
    )


def _trainer_logprobs(module: RLVRModule, r) -> torch.Tensor:
    """``[N, T]`` the trainer's full-softmax log-probs of ``r``'s tokens at temperature 1."""
    with torch.no_grad():
        return completion_logprobs(
            module.policy, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
            torch.ones(r.num_rows),
        )[0]  # fmt: skip


# ---- D1: top-p / top-k sampling and π_old ---------------------------------------------------


@pytest.mark.parametrize("truncation", [{"top_p": 0.7}, {"top_k": 5}])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_d1_a_truncated_sampler_never_gives_pi_old(truncation, minibatches):
    sampling = Sampling(max_new_tokens=6, temperature=1.0, group_size=4, **truncation)
    module = RLVRModule(
        "tiny:0", **grouped(sampling=sampling, minibatches_per_rollout=minibatches, isolate=False)
    )
    batch = _batch(2)
    torch.manual_seed(0)
    scored = module.score(batch, module.rollout(batch))
    r = scored.rollouts
    full = _trainer_logprobs(module, r)  # [N, T]
    valid = r.completion_mask.bool()
    # The truncated, renormalised sampler puts more mass on each kept token than the softmax.
    assert bool((r.behaviour_logp[valid] > full[valid] + 1e-3).any())
    out, _ = module.recompute_old_logprobs(scored)
    old = out.rollouts.old_logp  # [N, T]
    assert old is not None  # before the fix: None, π_old = the nucleus' log-probs
    if minibatches == 1:  # deferred to the update's own forward (NaN: "this forward's")
        assert bool(old[valid].isnan().all())
    else:  # the trainer's pass: ratio 1 on the first minibatch before any update
        torch.testing.assert_close(old[valid], full[valid], atol=1e-5, rtol=0)


# ---- D2, E3: AMPO's forced teacher reward -----------------------------------------------------


def test_floor_accuracy_by_hand():
    # accuracy + format, weights 1 and 1: wrong-but-boxed (1, acc 0) -> (2, 1, True); correct
    # (2, 1) stays; NaN accuracy counts as 0: (0.5, NaN) -> (1.5, 1, True) with weight 1.
    total, acc, ok = floor_accuracy(
        torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.0, 1.0, float("nan")]), 1.0, 1.0, 1.0
    )
    assert total.tolist() == [2.0, 2.0, 1.5] and acc.tolist() == [1.0, 1.0, 1.0]
    assert ok.tolist() == [True, True, True]


def _ampo_step(teachers: list[str]) -> Scored:
    """One all-fail group of G = 8 whose samples are all boxed but wrong (reward 1.0 each
    under the default rewards, boxed_accuracy + boxed_format), through AMPO's injection."""
    module = RLVRModule(
        "tiny:0", **grouped(sampling=Sampling(max_new_tokens=4, group_size=8), isolate=False)
    )
    batch = _batch(1)
    batch = dataclasses.replace(batch, columns={**batch.columns, "teacher_responses": [teachers]})
    torch.manual_seed(0)
    scored = module.score(batch, module.rollout(batch))
    n = scored.rollouts.num_rows
    wrong = torch.zeros(n, dtype=torch.bool)
    scored = dataclasses.replace(
        scored, rewards=torch.ones(n), correct=wrong, sampled_correct=wrong,
        sampled_rewards=torch.ones(n),
        per_function={"boxed_accuracy": torch.zeros(n), "boxed_format": torch.ones(n)},
    )  # fmt: skip
    cb = MixedPolicyGuidance(
        source="teacher", injection="on_all_fail", num_replaced=2, reward=1.0, seed=0
    )
    cb.on_before_rollout(None, module, batch)
    module.step_batch = batch
    return cb.on_after_score(None, module, scored)


def test_d2_a_teacher_the_verifier_scored_higher_keeps_its_score():
    out = _ampo_step(["So \\boxed{7}", "Hence \\boxed{7}"])
    teachers = [i for i, s in enumerate(out.rollouts.sources) if s == "teacher"]
    assert len(teachers) == 2
    # Verifier: accuracy 1 + format 1 = 2; max(2, ...) keeps it (before: forced to 1.0).
    assert out.rewards[teachers].tolist() == [2.0, 2.0]
    assert out.correct[teachers].tolist() == [True, True]
    # dr_grpo over the group: mean = (6 * 1 + 2 * 2) / 8 = 1.25 -> samples -0.25, teachers 0.75
    adv = mixed_advantages(out, "dr_grpo", "mixed")
    expected = torch.full((8,), -0.25)
    expected[teachers] = 0.75
    torch.testing.assert_close(adv, expected)


def test_e3_a_teacher_the_verifier_rejects_still_rescues_its_group():
    out = _ampo_step(["So \\boxed{8}", "Hence \\boxed{9}"])  # wrong answers, boxed
    teachers = [i for i, s in enumerate(out.rollouts.sources) if s == "teacher"]
    # Accuracy floored to 1: total 0 + 1 (format) -> 1 + 1 = 2, and the flag follows.
    assert out.rewards[teachers].tolist() == [2.0, 2.0]
    assert out.per_function["boxed_accuracy"][teachers].tolist() == [1.0, 1.0]
    assert out.correct[teachers].tolist() == [True, True]
    assert informative_groups(out.correct, out.rewards, 8, "accuracy").tolist() == [True]
    # The prompt's outcome is still the sampled one: 0 of 8.
    assert not bool(out.sampled_correct.any())


# ---- D4, E1, E2: ExGRPO's pool, retirement and the data stream ------------------------------


def _dm(**kwargs) -> RLVRDataModule:
    dm = RLVRDataModule(train_size=12, val_size=2, prompts_per_step=4, **kwargs)
    dm.setup("fit")
    return dm


def _output(step: int, ids: list[str], correct: list[list[int]]) -> StepOutput:
    c = torch.tensor(correct, dtype=torch.bool)  # [B, G]
    return StepOutput(
        step=step, prompt_ids=ids, group_size=c.shape[1], rewards=c.float(), correct=c,
        lengths=torch.ones(c.shape), pass_rate=c.float().mean(1),
        group_variance=c.float().var(1),
    )  # fmt: skip


def test_d4_a_question_solved_k_of_k_leaves_the_data_for_later_epochs():
    dm = _dm()
    batch = dm.compose_step()
    solved = batch.prompt_ids[0]
    out = _output(0, batch.prompt_ids, [[1, 1], [1, 0], [0, 0], [0, 1]])
    dm.on_step_output(out)
    cb = MixedPolicyGuidance(source="experience")
    cb.pool = ExperiencePool(8, 2, group_size=2)
    cb.on_step_output(SimpleNamespace(datamodule=dm), None, out)
    served = [pid for _ in range(9) for pid in dm.compose_step().prompt_ids]  # 3 more epochs
    assert solved not in served
    assert set(batch.prompt_ids[1:]) <= set(served)
    state = dm.state_dict()  # the skip set survives a resume
    fresh = _dm()
    fresh.load_state_dict(state)
    assert solved in fresh.composer.retired
    # retire_solved: false keeps the data as it is (ExGRPO's pool still retires it).
    dm2 = _dm()
    dm2.on_step_output(_output(0, dm2.compose_step().prompt_ids, [[1, 1]] * 4))
    off = MixedPolicyGuidance(source="experience", retire_solved=False)
    off.pool = ExperiencePool(8, 2, group_size=2)
    off.on_step_output(SimpleNamespace(datamodule=dm2), None, out)
    assert not dm2.composer.retired


def test_e1_a_pooled_question_later_seen_at_k0_loses_its_trajectories():
    pool = ExperiencePool(8, 4, group_size=4)
    traj = Trajectory(token_ids=[1, 2], behaviour_logp=[-0.1, -0.2], temperature=1.0, text="a")
    pool.record("q", {"messages": [], "columns": {}}, 2, 4, [traj])
    assert len(pool) == 1 and pool.sample(1, random.Random(0)) == ["q"]
    pool.record("q", {"messages": [], "columns": {}}, 0, 4, [])
    assert len(pool) == 0 and pool.sample(1, random.Random(0)) == []
    assert "q" not in pool.entries and "q" not in pool.retired  # not retired: it may return
    pool.record("q", {"messages": [], "columns": {}}, 1, 4, [traj])
    assert len(pool) == 1


def test_e2_a_replay_displaced_by_the_mix_in_is_replayed_later():
    replay = PromptReplay(fraction=0.5, cooldown_steps=0, min_pass_rate=0.25, max_pass_rate=0.75)
    dm = _dm(replay=replay)
    first = dm.compose_step()
    dm.on_step_output(_output(0, first.prompt_ids, [[1, 0]] * 4))  # all admitted at 0.5
    second = dm.compose_step()
    replays = sorted(dm.composer.served)
    assert len(replays) == 2
    displaced = replays[0]
    # ExGRPO's mix-in puts a pooled question in the displaced replay's slot.
    ids = ["pooled" if pid == displaced else pid for pid in second.prompt_ids]
    dm.on_step_output(_output(1, ids, [[1, 0]] * 4))
    assert displaced not in replay.active  # before the fix: in flight for ever
    assert replay.reuse[displaced] == 0  # the unused replay is given back
    later = {pid for _ in range(4) for pid in _observe_step(dm, 2)}
    assert displaced in later


def _observe_step(dm: RLVRDataModule, step: int) -> list[str]:
    batch = dm.compose_step()
    served = sorted(dm.composer.served)
    dm.on_step_output(_output(step, batch.prompt_ids, [[1, 0]] * len(batch)))
    return served


# ---- E4: EAD and the stored trajectories -----------------------------------------------------


def test_e4_stored_trajectories_hold_the_trainer_logprobs_at_the_base_temperature():
    module = RLVRModule(
        "tiny:0", **grouped(sampling=Sampling(max_new_tokens=6, group_size=4), isolate=False)
    )
    batch = _batch(2)
    torch.manual_seed(0)
    scored = module.score(batch, module.rollout(batch))
    r = scored.rollouts
    # EAD sampled every token at 0.5 x the base; the sampler's log-probs are those of that
    # distribution (here: anything but the trainer's).
    r = dataclasses.replace(
        r, position_temperature=torch.full(r.completion_ids.shape, 0.5),
        behaviour_logp=torch.full(r.completion_ids.shape, -0.01) * r.completion_mask,
    )  # fmt: skip
    correct = torch.tensor([True, False, False, False, False, True, True, False])
    scored = dataclasses.replace(scored, rollouts=r, correct=correct, sampled_correct=correct)
    cb = MixedPolicyGuidance(source="experience", injection="delayed")
    cb.setup(None, module, "fit")
    cb.on_before_rollout(None, module, batch)
    module.step_batch = batch
    cb.on_after_score(None, module, scored)
    full = _trainer_logprobs(module, r)  # [N, T] at temperature 1
    for b, rows in ((0, [0]), (1, [5, 6])):
        stored = cb.pool.trajectories(batch.prompt_ids[b])
        assert [t.temperature for t in stored] == [1.0] * len(rows)
        for traj, row in zip(stored, rows, strict=True):
            n = int(r.completion_mask[row].sum())
            torch.testing.assert_close(
                torch.tensor(traj.behaviour_logp), full[row, :n], atol=1e-5, rtol=0
            )


# ---- E5: GAE whitening over the trained groups ----------------------------------------------


def test_whiten_over_by_hand():
    # x = [[1, 3], [100, 100]], rows [True, False]: mean 2, unbiased variance 2 -> [-1, 1]/√2;
    # the dropped row is whitened with the same statistics: (100 - 2)/√2.
    x, mask = torch.tensor([[1.0, 3.0], [100.0, 100.0]]), torch.ones(2, 2)
    out = advantages.whiten_over(x, mask, torch.tensor([True, False]))
    s = 2**0.5
    torch.testing.assert_close(out, torch.tensor([[-1 / s, 1 / s], [98 / s, 98 / s]]))
    torch.testing.assert_close(advantages.whiten_over(x, mask), masked_whiten(x, mask))


def test_e5_groups_the_selection_drops_never_shape_the_gae_statistics():
    module = RLVRModule(
        "tiny:0",
        **grouped(sampling=Sampling(max_new_tokens=4, group_size=2), isolate=False),
        estimator="gae", value_head=ValueHead,
    )  # fmt: skip
    batch = _batch(2)
    torch.manual_seed(0)
    scored = module.score(batch, module.rollout(batch))
    r = scored.rollouts
    r = dataclasses.replace(r, old_values=torch.zeros(r.completion_ids.shape))
    keep = torch.tensor([True, False])  # the second group is dropped (e.g. zero variance)
    adv = []
    for dropped_rewards in ([0.0, 0.0], [50.0, 50.0]):
        rewards = torch.tensor([1.0, 0.0, *dropped_rewards])
        s = dataclasses.replace(scored, rollouts=r, rewards=rewards, trained_groups=keep)
        adv.append(module.compute_advantages(s))  # [N, T]
    rows = r.completion_mask[:2].bool()
    torch.testing.assert_close(adv[0][:2][rows], adv[1][:2][rows])
    # By hand: V = 0, γ = λ = 1, so Â_t = the row's reward on each token: row 0 all 1, row 1
    # all 0; whitened over those tokens only.
    raw = torch.where(rows, torch.tensor([1.0, 0.0])[:, None], 0.0)
    torch.testing.assert_close(adv[0][:2][rows], masked_whiten(raw, rows.float())[rows])


# ---- the probe head's range -----------------------------------------------------------------


def test_the_probe_head_never_clips_a_total_reward_above_one_by_default():
    head = ProbeHead(4, prompt_pca=2, response_pca=2, alpha=1e-4)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(16, head.num_features, generator=g)  # [16, F]
    last = features[:, -1]  # the entropy scalar, fitted unscaled: targets linear in it
    targets = (last - last.min()) / (last.max() - last.min()) * 2.0  # [16] in 0..2
    head._append(features, targets, torch.arange(16) // 2)
    head.refit()
    pred = head.predict(features)
    assert float(pred.max()) > 1.5  # the default rewards' 0-2 range, not (0, 1)
    assert float(pred.max()) <= 2.0 + 1e-6 and float(pred.min()) >= -1e-6  # the targets' range
    fixed = ProbeHead(4, prompt_pca=2, response_pca=2, alpha=1e-4, reward_range=(0.0, 1.0))
    fixed._append(features, targets, torch.arange(16) // 2)
    fixed.refit()
    assert float(fixed.predict(features).max()) == 1.0  # POISE's range when asked for


# ---- D5: LUFFY's aggregation in the shipped config ------------------------------------------


def test_d5_the_luffy_config_weighs_a_reference_token_as_a_sample_token():
    text = (ROOT / "configs" / "mixed_policy_guidance.yaml").read_text()
    config = yaml.safe_load(text)["model"]["init_args"]
    preset = get_preset(config["algorithm"])
    agg = config.get("loss", {}).get("agg_mode") or preset.agg_mode
    assert agg == "seq-mean-token-sum-norm"
    assert (config.get("estimator") or preset.estimator) == "dr_grpo"  # no std
    # A reference of 8 tokens and a sample of 32, unit loss per token: each token's gradient
    # weight is d(loss)/d(token); equal under sum-norm (before: seq-mean-token-mean, 4x).
    mask = torch.zeros(2, 32)
    mask[0, :8], mask[1, :] = 1, 1
    loss_mat = torch.ones(2, 32, requires_grad=True)
    agg_loss(loss_mat, mask, agg, norm_len=32).backward()
    weights = loss_mat.grad  # [2, 32]
    assert float(weights[0, 0]) == pytest.approx(float(weights[1, 0]))
    comments = [line for line in text.splitlines() if line.startswith("#")]
    ampo = "\n".join(comments[comments.index(next(c for c in comments if "AMPO:" in c)) :])
    exgrpo = ampo[ampo.index("ExGRPO:") :]
    assert "seq-mean-token-sum-norm" in ampo[: ampo.index("ExGRPO:")] and "dual_clip: 10" in ampo
    assert "seq-mean-token-sum-norm" in exgrpo and "clip_low: 1.0e9" in exgrpo
