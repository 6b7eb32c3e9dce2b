"""Multi-turn trajectories under the mechanisms that can be switched on with them, on hand-made
rows: dynamic sampling's concatenation, injected (guidance) members, row selection, deferred
π_old, scoring over conversations with the environment's reward, per-turn credit."""

from __future__ import annotations

import torch

from rlvr_lightning.options import MultiTurn
from rlvr_lightning.rewards import RewardCombiner
from rlvr_lightning.rewards.trl_contract import RewardState
from rlvr_lightning.stages.dynamic import concat_rollouts
from rlvr_lightning.stages.multiturn import turn_credit
from rlvr_lightning.stages.offpolicy import replace_rows, select_rows
from rlvr_lightning.stages.old_logprobs import deferred_trainer_logprobs
from rlvr_lightning.stages.scoring import score_rollouts
from rlvr_lightning.stages.summary import row_advantages, turn_metrics
from rlvr_lightning.types import PromptBatch, Rollouts, Scored

NAN = float("nan")


def multi_turn(rewards_env=(1.0, NAN)) -> Rollouts:
    """Two trajectories of one prompt: row 0 = model(2) env(2) model(1); row 1 = model(3)."""
    env = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    logp = torch.tensor([[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.4, -0.5, -0.6, 0.0, 0.0]])
    return Rollouts(
        prompt_ids=torch.tensor([[5, 6], [5, 6]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        completion_ids=torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]]),
        completion_mask=mask,
        behaviour_logp=logp,
        temperature=torch.ones(2),
        truncated=torch.tensor([False, False]),
        completions=["a\n\n[user] no\n\nb", "c"],
        group_size=2,
        env_mask=env,
        conversations=(
            (
                {"role": "assistant", "content": "a"},
                {"role": "user", "content": "no"},
                {"role": "assistant", "content": "\\boxed{4}"},
            ),
            ({"role": "assistant", "content": "\\boxed{5}"},),
        ),
        turn_stats={
            "turns": torch.tensor([2.0, 1.0]),
            "tool_calls": torch.tensor([1.0, 0.0]),
            "tool_errors": torch.tensor([1.0, 0.0]),
            "env_reward": torch.tensor(rewards_env),
        },
    )


def single_turn() -> Rollouts:
    return Rollouts(
        prompt_ids=torch.tensor([[7], [7]]),
        prompt_mask=torch.ones(2, 1, dtype=torch.long),
        completion_ids=torch.tensor([[30, 31], [32, 0]]),
        completion_mask=torch.tensor([[1, 1], [1, 0]]),
        behaviour_logp=torch.tensor([[-1.0, -1.0], [-1.0, 0.0]]),
        temperature=torch.ones(2),
        truncated=torch.tensor([False, False]),
        completions=["x", "y"],
        group_size=2,
    )


def test_dynamic_sampling_concatenation_keeps_environment_tokens_out_of_the_loss() -> None:
    both = concat_rollouts(multi_turn(), single_turn(), pad_id=0)
    assert both.env_mask.tolist() == [[0, 0, 1, 1, 0], [0] * 5, [0] * 5, [0] * 5]
    assert both.loss_mask.tolist()[0] == [1, 1, 0, 0, 1]
    assert both.turn_stats["turns"].tolist() == [2.0, 1.0, 1.0, 1.0]
    assert both.turn_stats["env_reward"][2:].isnan().all()
    assert both.conversations[2] == ({"role": "assistant", "content": "x"},)


def test_an_injected_member_replacing_a_trajectory_is_a_single_answer() -> None:
    out = replace_rows(multi_turn(), [0], [[40, 41]], [None], ["guide"], [1.0], ["g"], pad_id=0)
    assert out.env_mask[0].sum() == 0 and out.loss_mask[0].tolist() == [1, 1, 0, 0, 0]
    assert out.conversations[0] == ({"role": "assistant", "content": "g"},)
    assert out.turn_stats["turns"][0] == 1.0 and out.turn_stats["tool_calls"][0] == 0.0
    assert out.turn_stats["env_reward"][0].isnan()
    assert out.env_mask[1].tolist() == [0] * 5 and out.turn_stats["turns"][1] == 1.0


def test_selecting_rows_carries_the_trajectories() -> None:
    out = select_rows(multi_turn(), [0])
    assert out.env_mask.tolist() == [[0, 0, 1, 1, 0]]
    assert len(out.conversations) == 1 and out.turn_stats["turns"].tolist() == [2.0]


def test_deferred_pi_old_leaves_environment_tokens_at_zero() -> None:
    out = deferred_trainer_logprobs(multi_turn(), base_temperature=1.0)
    old = out.old_logp[0]
    assert old[[0, 1, 4]].isnan().all()  # the update's own forward fills the model's tokens
    assert old[2].item() == 0.0 and old[3].item() == 0.0  # never NaN: NaN * 0 is NaN in sums


def _seen_columns(store: dict):
    def reward(completions, num_turns, tool_calls, turns, completion_length, **_):
        store.setdefault("calls", []).append(len(completions))
        if len(store["calls"]) == 1:  # the trajectories (a second call scores first answers)
            store.update(
            completions=completions, num_turns=num_turns, tool_calls=tool_calls, turns=turns,
            length=completion_length,
            )  # fmt: skip
        return [1.0 if "4" in c[-1]["content"] else 0.0 for c in completions]

    return reward


def test_rewards_see_whole_conversations_and_the_environment_reward_adds_with_weight_1() -> None:
    seen: dict = {}
    combiner = RewardCombiner([_seen_columns(seen)], names=["acc"], timeout_s=None)
    batch = PromptBatch(["p"], [[{"role": "user", "content": "2+2?"}]])
    scored = score_rollouts(combiner, batch, multi_turn(), "acc", 1.0, RewardState())
    assert seen["completions"][0][1] == {"role": "user", "content": "no"}
    assert seen["num_turns"] == [2, 1] and seen["tool_calls"] == [1, 0]
    assert seen["turns"][0] == ["a", "\\boxed{4}"]
    assert seen["length"] == [3, 3]  # model tokens only
    assert scored.rewards.tolist() == [2.0, 0.0]  # 1 (acc) + 1 (environment); 0 + nothing
    assert scored.per_function["environment"][0] == 1.0
    assert scored.correct.tolist() == [True, False]
    # The first answer ("a") of row 0 was not correct: first-turn accuracy 0 of 2.
    assert scored.metrics["multiturn/first_turn_accuracy"] == 0.0
    assert seen["calls"] == [2, 1]  # only the multi-turn row is scored again


def test_turn_credit_blends_step_advantages_on_each_turns_tokens() -> None:
    r = multi_turn()
    scored = Scored(r, torch.tensor([1.0, 0.0]), {}, torch.tensor([True, False]))
    episode = torch.tensor([0.7, -0.7])
    assert turn_credit(scored, episode, MultiTurn(step_weight=0.0)) is episode
    out = turn_credit(scored, episode, MultiTurn(step_weight=0.5, turn_discount=0.5))
    # Returns: row 0 (2 turns, R 1): [0.5, 1]; row 1 (1 turn, R 0): [0].
    # Turn 0: [0.5, 0] -> mean 0.25, std 0.3536 -> [+0.7071, -0.7071]; turn 1: row 0 alone -> 0.
    a = 0.5 * 0.7 + 0.5 * 0.70710
    assert torch.allclose(out[0], torch.tensor([a, a, 0.0, 0.0, 0.35]), atol=1e-4)
    b = 0.5 * -0.7 + 0.5 * -0.70710
    assert torch.allclose(out[1], torch.tensor([b, b, b, 0.0, 0.0]), atol=1e-4)


def test_logged_advantages_and_token_counts_skip_environment_tokens() -> None:
    r = multi_turn()
    adv = torch.tensor([[1.0, 1.0, 9.0, 9.0, 1.0], [2.0, 2.0, 2.0, 0.0, 0.0]])
    assert row_advantages(adv, r.loss_mask).tolist() == [1.0, 2.0]
    m = turn_metrics(r)
    assert m["multiturn/tokens_trained"] == 6.0 and m["multiturn/tokens_seen"] == 8.0
    assert m["multiturn/turns"] == 1.5 and m["multiturn/tool_errors"] == 0.5
    assert "multiturn/env_reward" not in m


def test_a_queued_multi_turn_round_keeps_its_turns_through_a_checkpoint() -> None:
    """Async rollouts queue trajectories in checkpoints (``asynchrony.plain``)."""
    import io

    from rlvr_lightning.asynchrony.plain import from_plain, to_plain

    buffer = io.BytesIO()
    torch.save(to_plain(multi_turn()), buffer)
    buffer.seek(0)
    back = from_plain(torch.load(buffer, weights_only=True))
    assert back.conversations == multi_turn().conversations
    assert torch.equal(back.loss_mask, multi_turn().loss_mask)
    assert back.turn_stats["env_reward"][1].isnan()
    assert torch.equal(back.turn_stats["turns"], multi_turn().turn_stats["turns"])
