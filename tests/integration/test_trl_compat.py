"""TRL-style rewards and data through the command line: rewards that name ``prompts`` and
``completion_ids`` or are ``async def``, rows without an ``answer`` column, conversational
prompts in JSONL, and ``prompt_format`` for base models without a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr_lightning import RLVRModule
from rlvr_lightning.cli.main import main
from rlvr_lightning.stages import build
from rlvr_lightning.types import PromptBatch

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")

# Written as a TRL user would: prompts first, completions by keyword, async, **kwargs. It
# records what it received so the test can check it.
TRL_REWARDS = """
import asyncio, json

async def judged(prompts, completions, completion_ids, **kwargs):
    await asyncio.sleep(0)
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"prompt": prompts[0], "ids": completion_ids[0],
                            "completion": completions[0], "kwargs": sorted(kwargs)}) + "\\n")
    return [float(len(c) < 8) for c in completions]
"""


def _jsonl(path: Path, prompts: list) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "topic": "sums"}) + "\n" for p in prompts))
    return str(path)


def _fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, *args: str) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{module}.py").write_text(TRL_REWARDS)
    main(
        [
            "fit",
            "--config",
            CONFIG,
            f"--trainer.default_root_dir={tmp_path}",
            f"--model.init_args.rewards.functions=[{module}.judged]",
            "--data.init_args.val_size=4",
            *args,
        ]
    )


def _seen(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]


def test_trl_style_async_reward_trains_on_rows_without_an_answer(tmp_path, monkeypatch):
    data = _jsonl(tmp_path / "plain.jsonl", [f"What is {i} + 1?" for i in range(12)])
    _fit(tmp_path, monkeypatch, "trl_rewards_plain", f"--data.init_args.source={data}")
    seen = _seen(tmp_path)
    assert len(seen) >= 2  # two training steps (and validation) scored
    first = seen[0]
    # A text prompt arrives as text: the question plus the instruction, without a template.
    assert isinstance(first["prompt"], str) and first["prompt"].startswith("What is ")
    assert first["prompt"].endswith("Put the final answer in \\boxed{}.")
    assert all(isinstance(t, int) for t in first["ids"]) and first["ids"]
    assert isinstance(first["completion"], str)  # a text prompt's completion is text
    # Dataset columns pass through, and TRL's non-row arguments reach **kwargs as in TRL.
    assert first["kwargs"] == [
        "completion_length",
        "log_extra",
        "log_metric",
        "topic",
        "trainer_state",
    ]


def test_conversational_jsonl_prompts_are_the_chat_messages(tmp_path, monkeypatch):
    chats = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} + 2?"}]
        for i in range(12)
    ]
    data = _jsonl(tmp_path / "chat.jsonl", chats)
    _fit(
        tmp_path,
        monkeypatch,
        "trl_rewards_chat",
        f"--data.init_args.source={data}",
        "--data.init_args.system_prompt=Unused since the rows have their own",
    )
    prompt, completion = _seen(tmp_path)[0]["prompt"], _seen(tmp_path)[0]["completion"]
    assert completion == [{"role": "assistant", "content": completion[0]["content"]}]  # TRL's
    assert [m["role"] for m in prompt] == ["system", "user"]
    assert prompt[0]["content"] == "Be brief."  # the row's system turn wins
    assert prompt[1]["content"].endswith("+ 2?\n\nPut the final answer in \\boxed{}.")


def test_a_reward_column_missing_from_the_data_stops_before_training(tmp_path, capsys):
    data = _jsonl(tmp_path / "noanswer.jsonl", [f"What is {i} + 1?" for i in range(12)])
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                CONFIG,
                f"--trainer.default_root_dir={tmp_path}",
                f"--data.init_args.source={data}",
                "--model.init_args.rewards.functions=[rlvr_lightning.rewards.boxed_accuracy]",
            ]
        )
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Reward function 'boxed_accuracy' needs column 'answer'" in err
    assert "training source 'noanswer' has only ['topic']" in err
    assert "data.columns" in err and "Traceback" not in err


def _base_model(prompt_format: str) -> RLVRModule:
    module = RLVRModule("tiny:0", prompt_format=prompt_format)
    module.tokenizer.chat_template = None  # a base model's tokenizer: this instance only
    return module


@pytest.mark.parametrize("prompt_format", ["plain", "auto"])
def test_plain_prompts_encode_without_a_chat_template(prompt_format):
    module = _base_model(prompt_format)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    ids, mask = module.encode_prompts(PromptBatch(prompt_ids=["a"], messages=[messages]))
    assert ids.shape == mask.shape and mask.all()
    # Plain: the contents joined by a blank line, roles dropped, no special tokens.
    expected = module.tokenizer("Be brief.\n\n1+1?", add_special_tokens=False).input_ids
    assert ids[0].tolist() == expected


def test_plain_is_also_available_for_a_chat_model():
    module = RLVRModule("tiny:0", prompt_format="plain")
    batch = PromptBatch(prompt_ids=["a"], messages=[[{"role": "user", "content": "hi"}]])
    ids, _ = module.encode_prompts(batch)
    assert ids[0].tolist() == module.tokenizer("hi", add_special_tokens=False).input_ids
    chat_ids, _ = RLVRModule("tiny:0").encode_prompts(batch)  # auto: the template
    assert chat_ids.shape[1] > ids.shape[1]


def test_chat_format_without_a_chat_template_names_prompt_format_plain():
    tokenizer = RLVRModule("tiny:0").tokenizer
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="prompt_format: plain"):
        build.check_prompt_format("chat", tokenizer, "base-model")
    build.check_prompt_format("auto", tokenizer, "base-model")  # auto falls back to plain
