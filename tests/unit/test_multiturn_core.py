"""Multi-turn core: per-turn credit maths, the tokens between turns through two chat templates,
the turn loop on the HF engine, and the loss mask that keeps environment tokens out."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from rlvr_lightning.algorithms.multiturn import (
    blend_turn_advantages,
    step_advantages,
    turn_counts,
    turn_index,
    turn_returns,
)
from rlvr_lightning.models.tiny import byte_tokenizer, tiny_policy
from rlvr_lightning.rollout.multiturn import TurnLimits, run_trajectories
from rlvr_lightning.rollout.turns import TurnText, between_turns
from rlvr_lightning.testing import ppo_update
from rlvr_lightning.types import Rollouts, Sampling

# A Qwen2.5-like template: tools in the system turn, tool results wrapped in one user turn.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_turn_index_and_counts_by_hand() -> None:
    mask = torch.tensor([[1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    assert turn_index(mask).tolist() == [
        [0, 0, -1, 1, -1, -1],
        [0, 0, 0, -1, -1, -1],
        [-1, -1, -1, -1, -1, -1],
    ]
    assert turn_counts(mask).tolist() == [2, 1, 0]


def test_turn_returns_discount_the_final_reward_by_turns_left() -> None:
    # Row 0: 3 turns, R = 1, gamma 0.5 -> [0.25, 0.5, 1]; row 1: one turn, R = 2 -> [2].
    out = turn_returns(torch.tensor([1.0, 2.0]), torch.tensor([3, 1]), 0.5)
    assert out[0].tolist() == [0.25, 0.5, 1.0]
    assert out[1, 0] == 2.0 and out[1, 1:].isnan().all()


def test_step_advantages_compare_the_same_turn_within_a_group() -> None:
    nan = float("nan")
    # One group of 3: turn 0 returns [1, 0, 0.5]; turn 1 only rows 0 and 1 -> [1, 0].
    returns = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.5, nan]])
    adv = step_advantages(returns, group_size=3, eps=0.0)
    # turn 0: mean 0.5, unbiased std 0.5 -> [1, -1, 0]; turn 1: mean 0.5, std 0.7071.
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0, 0.0])
    assert adv[0, 1].item() == pytest.approx(0.5 / math.sqrt(0.5))
    assert adv[1, 1].item() == pytest.approx(-0.5 / math.sqrt(0.5))
    assert math.isnan(adv[2, 1].item())
    # A turn only one row reached carries no signal.
    lone = step_advantages(torch.tensor([[1.0, 3.0], [0.0, nan]]), group_size=2)
    assert lone[0, 1] == 0.0


def test_blend_puts_each_turns_advantage_on_its_tokens_only() -> None:
    turn_idx = torch.tensor([[0, 0, -1, 1, -1]])
    step = torch.tensor([[2.0, -2.0]])
    out = blend_turn_advantages(torch.tensor([1.0]), step, turn_idx, step_weight=0.5)
    assert out.tolist() == [[1.5, 1.5, 0.0, -0.5, 0.0]]


def _tokenizer(template: str | None):
    tok = byte_tokenizer()
    if template is not None:
        tok.chat_template = template
    return tok


@pytest.mark.parametrize("template", [None, QWEN_LIKE], ids=["chatml", "qwen-like"])
def test_concatenated_turns_equal_the_templates_whole_conversation(template) -> None:
    tok = _tokenizer(template)
    prompt = [{"role": "user", "content": "What is 123 + 456?"}]
    turns = [
        ("assistant", '<tool_call>{"name": "calculator"}</tool_call>'),
        ("tool", "579"),
        ("tool", "ok"),
        ("assistant", "It is \\boxed{578}."),
        ("user", "Not correct; check again."),
        ("assistant", "\\boxed{579}"),
    ]
    ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False).input_ids
    text, pending = TurnText.of(tok), []
    for role, content in turns:
        if role != "assistant":
            pending.append({"role": role, "content": content})
            continue
        if pending:
            ids += between_turns(tok, text, True, pending)
            pending = []
        ids += [*tok(content, add_special_tokens=False).input_ids, tok.eos_token_id]
    whole = prompt + [{"role": r, "content": c} for r, c in turns]
    rendered = tok.apply_chat_template(whole, tokenize=False)
    expected = tok(rendered, add_special_tokens=False).input_ids
    closing = tok(text.after_turn(True), add_special_tokens=False).input_ids
    assert ids + closing == expected


class _Scripted:
    """An environment per row: a tool result after the first turn, done after the second."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[str]]] = []

    def __call__(self, rows, texts):
        self.calls.append((list(rows), list(texts)))
        first = len(self.calls) == 1
        return [
            SimpleNamespace(
                messages=[{"role": "tool", "content": "RESULT"}] if first else [],
                done=not first,
                tool_calls=1 if first else 0,
                tool_errors=0,
            )
            for _ in rows
        ]


class _ScriptedEngine:
    """Answers every row with the tokens of ``answer`` then EOS (log-prob -0.1 each), after
    the HF engine's own sampling of nothing: enough to drive the turn loop exactly."""

    shares_policy = True

    def __init__(self, tok, answer: str = "ok") -> None:
        self.tok, self.answer = tok, tok(answer, add_special_tokens=False).input_ids
        self.contexts: list[list[list[int]]] = []

    def generate(self, prompt_ids, prompt_mask, sampling, temperatures=None, **_):
        g = sampling.group_size
        ids, mask = prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0)
        self.contexts.append([p[m.bool()].tolist() for p, m in zip(ids, mask, strict=True)])
        row = ([*self.answer, self.tok.eos_token_id])[: sampling.max_new_tokens]
        n, t = ids.shape[0], len(row)
        done = row[-1] == self.tok.eos_token_id
        return Rollouts(
            prompt_ids=ids,
            prompt_mask=mask,
            completion_ids=torch.tensor([row] * n),
            completion_mask=torch.ones(n, t, dtype=torch.long),
            behaviour_logp=torch.full((n, t), -0.1),
            temperature=torch.ones(n),
            truncated=torch.full((n,), not done),
            completions=[self.tok.decode(row, skip_special_tokens=True)] * n,
            group_size=g,
        )


def _trajectories(max_turns=3, budget=64, max_new=6):
    model, tok = tiny_policy(seed=3)
    tok.padding_side = "left"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    enc = tok([text, text + "x"], return_tensors="pt", padding=True, add_special_tokens=False)
    env, engine = _Scripted(), _ScriptedEngine(tok)
    r = run_trajectories(
        engine,
        tok,
        (enc.input_ids, enc.attention_mask),
        Sampling(max_new_tokens=max_new, group_size=2, temperature=1.0),
        env,
        TurnLimits(max_turns=max_turns, max_total_tokens=budget),
    )
    return model, tok, r, env, engine


def test_trajectories_mark_environment_tokens_and_keep_model_log_probs() -> None:
    _, tok, r, env, engine = _trajectories()
    assert r.num_rows == 4 and r.group_size == 2
    between = between_turns(tok, TurnText.of(tok), True, [{"role": "tool", "content": "RESULT"}])
    for i in range(4):
        env_ids = r.completion_ids[i][r.env_mask[i].bool()].tolist()
        turns = int(r.turn_stats["turns"][i])
        if turns > 1:  # the row ended its first turn with EOS and got the tool result
            assert env_ids == between
            assert r.conversations[i][1] == {"role": "tool", "content": "RESULT"}
        else:
            assert env_ids == []
        assert (r.behaviour_logp[i][r.env_mask[i].bool()] == 0).all()
        model_logp = r.behaviour_logp[i][r.loss_mask[i].bool()]
        assert (model_logp == -0.1).all()  # every sampled token keeps its own log-prob
    assert env.calls[0][0] == [0, 1, 2, 3] and env.calls[1][0] == [0, 1, 2, 3]
    assert (r.turn_stats["turns"] == 2).all() and (r.turn_stats["tool_calls"] == 1).all()
    # The second turn was generated on exactly prompt + turn 1 + the environment's tokens.
    answer = [*engine.answer, tok.eos_token_id]
    first_prompts = engine.contexts[0]
    for i in range(4):
        assert engine.contexts[1][i] == first_prompts[i] + answer + between
        assert (
            r.completion_ids[i][r.completion_mask[i].bool()].tolist() == answer + between + answer
        )


def test_turn_limit_and_token_budget_stop_trajectories() -> None:
    _, _, one, env, _ = _trajectories(max_turns=1)
    assert env.calls == [] and (one.turn_stats["turns"] == 1).all()
    assert one.env_mask.sum() == 0
    _, _, tight, _, _ = _trajectories(max_turns=3, budget=8, max_new=6)
    assert (tight.completion_mask.sum(-1) <= 8).all()
    assert tight.env_mask.sum() == 0  # no room for the tool result and another turn


def test_an_environment_token_with_a_huge_advantage_changes_no_gradient() -> None:
    model, _, r, _, _ = _trajectories()
    assert r.env_mask.sum() > 0, "the scripted environment must have written tokens"
    base = torch.where(r.loss_mask.bool(), torch.tensor(0.5), torch.tensor(0.0))  # [N, T]
    planted = torch.where(r.env_mask.bool(), torch.tensor(1e6), base)
    grads = []
    for adv in (base, planted):
        model.zero_grad()
        ppo_update(agg_mode="token-mean").accumulate(
            model, r, adv, torch.arange(r.num_rows), None, lambda x: x.backward()
        )
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    # The same plant on a model token does change the gradient (the test can fail).
    model_tok = r.loss_mask.nonzero()[0]
    moved = base.clone()
    moved[model_tok[0], model_tok[1]] = 1e6
    model.zero_grad()
    ppo_update(agg_mode="token-mean").accumulate(
        model, r, moved, torch.arange(r.num_rows), None, lambda x: x.backward()
    )
    assert any(
        not torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads[0], strict=True)
    )


def test_single_turn_rollouts_keep_loss_mask_equal_to_completion_mask() -> None:
    _, _, r, _, _ = _trajectories(max_turns=1)
    plain = dataclasses.replace(r, env_mask=None)
    assert torch.equal(plain.loss_mask, plain.completion_mask)


def hangs(seconds: int) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long.
    """
    import time

    time.sleep(seconds)
    return "late"


def raises(x: int) -> str:
    """Always fails.

    Args:
        x: anything.
    """
    raise RuntimeError("broken tool")


def floods(x: int) -> str:
    """Returns a megabyte.

    Args:
        x: anything.
    """
    return "y" * 1_000_000


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        ("<tool_call>{not json</tool_call>", "not valid JSON"),
        ('<tool_call>{"name": "raises", "arguments": {"x": 1}}</tool_call>', "broken tool"),
        ('<tool_call>{"name": "hangs", "arguments": {"seconds": 30}}</tool_call>', "timed out"),
        ('<tool_call>{"name": "floods", "arguments": {"x": 1}}</tool_call>', "truncated"),
    ],
    ids=["malformed", "raises", "hangs", "1MB"],
)
def test_a_bad_tool_call_is_a_counted_error_and_the_trajectory_goes_on(answer, error) -> None:
    import time

    from rlvr_lightning.environments import SessionFactory, respond_all

    tok = byte_tokenizer()
    tok.padding_side = "left"
    factory = SessionFactory(tools=[hangs, raises, floods], max_tool_output_chars=200)
    sessions = [factory.new() for _ in range(2)]
    for s in sessions:
        s.reset({})
    text = tok.apply_chat_template(
        [{"role": "user", "content": "go"}], add_generation_prompt=True, tokenize=False
    )
    enc = tok([text], return_tensors="pt", add_special_tokens=False)

    def respond(rows, texts):
        return respond_all([sessions[i] for i in rows], texts, tok, timeout_s=0.5)

    start = time.perf_counter()
    r = run_trajectories(
        _ScriptedEngine(tok, answer),
        tok,
        (enc.input_ids, enc.attention_mask),
        Sampling(max_new_tokens=200, group_size=2),
        respond,
        TurnLimits(max_turns=2, max_total_tokens=4000),
    )
    assert time.perf_counter() - start < 10  # a hanging call costs its timeout, not 30 s
    assert r.turn_stats["tool_errors"].tolist() == [1.0, 1.0]
    assert (r.turn_stats["turns"] == 2).all()  # the model got the error and answered again
    tool_message = r.conversations[0][1]
    assert tool_message["role"] == "tool" and error in tool_message["content"]
    assert len(tool_message["content"]) < 400
