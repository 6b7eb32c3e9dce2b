"""A TRL user's names and a new user's slips, through ``rlvr-lightning fit``: each error ends
with a ``Fix:`` line that names the key or import path to write instead."""

import json
import re
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import main
from rlvr_lightning.options import TRL_NAMES

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")


def _fix(fit_error, *args: str) -> str:
    err = fit_error(*args)
    fixes = [line.strip() for line in err.splitlines() if line.strip().startswith("Fix:")]
    assert len(fixes) == 1, err
    return fixes[0]


@pytest.mark.parametrize(
    ("trl", "value"),
    [("num_generations", "8"), ("model_name_or_path", "Qwen/Qwen2.5-0.5B"), ("beta", "0.04"),
     ("learning_rate", "1e-6"), ("max_completion_length", "256"), ("epsilon_high", "0.28"),
     ("per_device_train_batch_size", "16"), ("max_prompt_length", "512")],
)  # fmt: skip
def test_a_trl_flag_names_its_key_here(fit_error, trl, value):
    here = TRL_NAMES[trl][0]
    # TRL's own command line spells it at the top level; in a YAML it may sit under the model.
    for flag in (f"--{trl}={value}", f"--model.init_args.{trl}={value}"):
        assert f"`{trl}` is TRL's name: here it is `{here}`" in _fix(fit_error, flag), flag


def test_a_trl_key_in_a_yaml_file_names_its_key_here(tmp_path, fit_error):
    (tmp_path / "trl.yaml").write_text("num_generations: 8\n")
    fix = _fix(fit_error, "--config", str(tmp_path / "trl.yaml"))
    assert "`model.init_args.sampling.group_size`" in fix


def test_the_readme_trl_table_agrees_with_the_cli():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Coming from TRL") :].split("\n\n")[2]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]
    assert len(rows) >= 15
    for trl, here in rows:
        names = re.findall(r"`(\w+)`", trl)
        keys = re.findall(r"`([\w.-]+)`", here)
        if keys[0].startswith("--"):  # accepted as it is (log_completions)
            continue
        assert TRL_NAMES[names[0]][0] == keys[0], (names[0], keys[0])
        for name in names:
            assert name in TRL_NAMES, name


def test_a_misspelled_sampling_key_gets_the_closest_key(tmp_path, fit_error):
    fix = _fix(fit_error, "--model.init_args.sampling.gruop_size=4")
    assert "`model.init_args.sampling` has no key `gruop_size`: did you mean `group_size`?" in fix
    (tmp_path / "typo.yaml").write_text("model:\n  init_args:\n    sampling: {temprature: 0.7}\n")
    fix = _fix(fit_error, "--config", str(tmp_path / "typo.yaml"))
    assert "did you mean `temperature`?" in fix


def test_a_bare_reward_name_is_told_its_package(fit_error):
    fix = _fix(fit_error, "--model.init_args.rewards.functions=[boxed_accuracy]")
    assert fix == "Fix: name it by its import path: rlvr_lightning.rewards.boxed_accuracy."
    fix = _fix(fit_error, "--model.init_args.rewards.functions=[my_score]")
    assert "my_rewards.my_score" in fix and "callbacks" not in fix


def _no_template_model(tmp_path: Path) -> Path:
    from rlvr_lightning.models.tiny import tiny_policy

    model, tokenizer = tiny_policy(seed=0)
    tokenizer.chat_template = None  # a base model's tokenizer
    folder = tmp_path / "base-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_chat_prompts_to_a_model_without_a_template_warn_once(tmp_path, recwarn):
    from rlvr_lightning.cli.main import build_cli

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
            for i in range(16)]  # fmt: skip
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--config", CONFIG, f"--trainer.default_root_dir={tmp_path}",
            f"--model.init_args.policy={_no_template_model(tmp_path)}",
            f"--data.init_args.source={tmp_path / 'chat.jsonl'}",
            "--data.init_args.val_size=4"]  # fmt: skip
    build_cli(["fit", *base])
    flattened = [w for w in recwarn if "has no chat template" in str(w.message)]
    assert len(flattened) == 1  # two steps and a validation: once
    assert "prompt_format: plain" in str(flattened[0].message)
    recwarn.clear()
    build_cli(["fit", *base, "--model.init_args.prompt_format=plain"])  # chosen: no warning
    assert not [w for w in recwarn if "has no chat template" in str(w.message)]


def test_fit_help_leads_with_the_model_and_data_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    first_trainer = next(i for i, line in enumerate(lines) if "--trainer." in line.split("]")[-1])
    keys = {line.split(":")[0].strip(): i for i, line in enumerate(lines[:40]) if ": " in line}
    assert "group_size" in lines[keys["sampling"]] and "kl_coef" in lines[keys["loss"]]
    assert any(line.strip().startswith("source task_config") for line in lines[:40])
    model_section = lines.index("GRPO-style RL with verifiable rewards:")
    assert max(keys.values()) < model_section < first_trainer
