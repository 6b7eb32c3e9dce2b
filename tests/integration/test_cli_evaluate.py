"""Evaluation through the command line as a user meets it: `test` on a named test split,
`predict` writing a JSONL file, and data sources read through the `datasets` library."""

import json
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import build_cli, main

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
TEST_ROWS = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(5)]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(tmp_path: Path, command: str, *args: str):
    return build_cli([command, "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}", *args])


def test_test_evaluates_the_named_test_source_under_test_names(tmp_path):
    test_file = _write_jsonl(tmp_path / "test.jsonl", TEST_ROWS)
    cli = _run(tmp_path, "test", f"--data.init_args.test_source={test_file}")
    assert [e.columns["answer"] for e in cli.datamodule.test_examples] == ["1", "2", "3", "4", "5"]
    metrics = cli.trainer.callback_metrics
    assert {"test/accuracy", "test/reward"} <= set(metrics)
    assert not [name for name in metrics if name.startswith("val/")]


def test_test_reads_the_test_split_of_a_dataset_folder(tmp_path):
    data = tmp_path / "sums"
    (data / "data").mkdir(parents=True)
    _write_jsonl(data / "data" / "train.jsonl", TEST_ROWS * 4)
    _write_jsonl(data / "data" / "test.jsonl", TEST_ROWS[:3])
    cli = _run(tmp_path, "test", f"--data.init_args.source={data}", "--data.init_args.val_size=4")
    assert len(cli.datamodule.test_examples) == 3
    assert "test/accuracy" in cli.trainer.callback_metrics


def test_test_on_a_procedural_task_names_the_fix(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["test", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "data.test_source" in err and "validate" in err and "Traceback" not in err


def test_predict_writes_completions_rewards_and_pass_at_k(tmp_path, capsys):
    _run(tmp_path, "predict", "--model.init_args.val_sampling.group_size=3")
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 8  # val_size of tiny.yaml
    first = records[0]
    assert {"prompt_id", "prompt", "answer", "completions", "pass@1", "pass@3"} <= set(first)
    assert len(first["completions"]) == 3
    assert {"text", "reward", "rewards", "correct"} <= set(first["completions"][0])
    assert "digit_fraction" in first["completions"][0]["rewards"]
    assert f"Wrote 8 prompts to {tmp_path / 'predictions.jsonl'}" in capsys.readouterr().out


def test_an_unreachable_hub_dataset_says_offline_and_the_local_alternative(
    capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, "--data.init_args.source=no-such-org/no-such-set"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    err = err[err.index("rlvr-lightning") :]
    assert "no-such-org/no-such-set" in err and "HF_DATASETS_OFFLINE" in err
    assert len(err.splitlines()) < 8 and "Traceback" not in err


def test_a_csv_named_on_the_command_line_is_read_as_data(tmp_path, monkeypatch):
    # jsonargparse once read `source=sums.csv` as a config and passed the file's text on.
    monkeypatch.chdir(tmp_path)
    rows = "".join(f"What is {a} + 3?,{a + 3}\n" for a in range(12))
    (tmp_path / "sums.csv").write_text("prompt,answer\n" + rows)
    (tmp_path / "val.csv").write_text("prompt,answer\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4\n")
    cli = build_cli(
        ["--config", CONFIG, "--data.init_args.source=sums.csv",
         "--data.init_args.val_source=val.csv", f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )  # fmt: skip
    assert cli.datamodule.hparams.source == "sums.csv"
    assert type(cli.datamodule.hparams.source) is str  # a subclass fails weights_only loads
    cli.datamodule.setup("fit")
    assert len(cli.datamodule.train_examples) == 12
    assert [e.columns["answer"] for e in cli.datamodule.val_examples] == [2, 4]  # as typed


@pytest.mark.parametrize("how", ["flag", "config"])
def test_an_empty_jsonl_says_it_holds_no_rows(how, capsys, tmp_path, monkeypatch):
    # jsonargparse once loaded an existing (empty) file as a list of lines: `source: []`.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "run.yaml").write_text("data:\n  init_args:\n    source: empty.jsonl\n")
    given = ["--data.init_args.source=empty.jsonl"] if how == "flag" else ["--config", "run.yaml"]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, *given])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "empty.jsonl: holds no rows" in err and "list of sources" not in err


def test_a_path_object_is_a_source(tmp_path):
    from rlvr_lightning.data import RLVRDataModule

    data = RLVRDataModule(source=tmp_path / "train.jsonl", val_size=0, prompts_per_step=1)
    assert data.hparams.source == str(tmp_path / "train.jsonl")
