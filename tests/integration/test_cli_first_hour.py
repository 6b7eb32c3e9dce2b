"""A new user's first hour through the command line: their own reward module, the optimiser
options, short errors, the help, and a quiet run."""

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import build_cli, main, silence_library_noise

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")
SCRIPT = str(Path(sys.executable).with_name("rlvr-lightning"))  # the console script
MY_REWARDS = "def short(completions, **_):\n    return [float(len(c) < 8) for c in completions]\n"


def _script(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_console_script_imports_reward_modules_from_the_working_directory(tmp_path):
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    run = "model:\n  init_args:\n    rewards: {functions: [my_rewards.short]}\n"
    (tmp_path / "run.yaml").write_text(run)
    out = _script(tmp_path, "fit", "--config", CONFIG, "--config", "run.yaml", "--print_config")
    assert out.returncode == 0, out.stderr
    assert "my_rewards.short" in out.stdout


def test_console_script_from_the_repository_root_still_loads_callbacks_once():
    # The repository root on sys.path is the trap of STYLE.md ("Top-level callbacks/").
    callback = "--trainer.callbacks+=rlvr_lightning.callbacks.ExportModel"
    out = _script(ROOT, "fit", "--config", "configs/tiny.yaml", callback, "--print_config")
    assert out.returncode == 0, out.stderr
    assert "rlvr_lightning.callbacks.ExportModel" in out.stdout


def _fails(capsys, *args: str, code: int) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    # Under pytest, LightningCLI warns that sys.argv holds pytest's arguments: skip that line.
    err = err[err.index("rlvr-lightning") :].strip() if "rlvr-lightning" in err else err
    assert len(err.splitlines()) < 8, err
    assert "Traceback" not in err and "Namespace(" not in err and "Subtypes" not in err
    return err


@pytest.mark.parametrize("option", ["--optimizer=Adam", "--lr_scheduler=StepLR"])
def test_optimizer_options_are_refused_and_name_model_lr(capsys, option):
    err = _fails(capsys, "fit", "--config", CONFIG, option, code=2)
    assert option.split("=")[0] in err and "model.init_args.update: lr" in err
    assert "warmup_steps" in err


def test_model_lr_and_warmup_drive_the_optimiser_and_export_reads_the_checkpoint(tmp_path):
    from rlvr_lightning.cli.main import build_cli

    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    cli = build_cli(
        [*args, "--model.init_args.update.lr=0.002", "--model.init_args.update.warmup_steps=4"]
    )
    # Two optimiser steps of a linear warm-up over 4: lr * min(1, (2 + 1) / 4).
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.002 * 3 / 4)
    ckpt = tmp_path / "run.ckpt"
    cli.trainer.save_checkpoint(ckpt)
    main(["export", str(ckpt), "--output", str(tmp_path / "exported")])
    assert {"config.json", "model.safetensors", "README.md"} <= {
        p.name for p in (tmp_path / "exported").iterdir()
    }


def test_lr_decay_reaches_its_floor_at_max_steps(tmp_path):
    from rlvr_lightning.cli.main import build_cli

    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    decay = [
        "--model.init_args.update.lr_decay=linear",
        "--model.init_args.update.min_lr_ratio=0.5",
    ]
    cli = build_cli([*args, "--model.init_args.update.lr=0.002", "--trainer.max_steps=2", *decay])
    # After 2 of 2 optimiser steps: 0.002 * (0.5 + 0.5 * (2 - 2) / 2).
    assert cli.trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.001)


BAD_YAML = "model:\n  init_args:\n    lr_typo: 1.0\n"


@pytest.mark.parametrize(
    ("extra", "code", "expected"),
    [
        (["--model.init_args.policy=./no_such_model"], 1, "Model folder './no_such_model' does"),
        (["--config", "bad.yaml"], 2, "Option 'lr_typo' is not accepted"),
        (["--model.init_args.rewards.functions=[no_such_rewards.fn]"], 2, "No module named"),
        (["--config", "missing.yaml"], 2, "File does not exist"),
        (["--model.init_args.sampling.group_size=1"], 1, "group_size must be >= 2"),
        (["--model.init_args.sampling.max_new_tokens=0"], 1, "max_new_tokens is 0; use >= 1"),
        (["--data.init_args.source=empty.jsonl"], 1, "empty.jsonl: holds no rows"),
        (["--data.init_args.instruction=Note: be brief"], 2, "is read as a YAML mapping"),
        (
            ["--model.init_args.update.lr_decay=cosine", "--trainer.max_steps=-1"],
            1,
            "trainer.max_steps is -1: set trainer.max_steps",
        ),
    ],
)
def test_bad_input_is_reported_in_a_few_lines(tmp_path, monkeypatch, capsys, extra, code, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    (tmp_path / "empty.jsonl").write_text("")
    err = _fails(capsys, "fit", "--config", CONFIG, *extra, code=code)
    assert err.startswith("rlvr-lightning fit: error")
    assert expected in err and "RLVR_TRACEBACK=1" in err


def test_text_with_a_colon_goes_through_the_mapping_the_fix_names():
    cli = build_cli(
        ["--config", CONFIG, "--data.init_args={instruction: 'Answer: in \\boxed{}'}"],
        run=False,
    )
    assert cli.datamodule.instruction == "Answer: in \\boxed{}"


def test_the_full_traceback_is_behind_an_environment_variable(monkeypatch):
    monkeypatch.setenv("RLVR_TRACEBACK", "1")
    with pytest.raises(Exception, match="does not exist") as raised:
        main(["fit", "--config", CONFIG, "--model.init_args.policy=./no_such_model"])
    assert "Given value: Namespace(" in str(raised.value)  # jsonargparse's own, unchanged


def test_help_names_every_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "rlvr-lightning push", "export"):
        assert command in out
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "--model.help RLVRModule" in capsys.readouterr().out


def test_the_overview_help_imports_neither_torch_nor_lightning():
    # What keeps `rlvr-lightning --help` fast (0.05 s; 5 s when it built LightningCLI).
    code = (
        "import sys\n"
        "from rlvr_lightning.cli.command import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "push" in done.stdout and "export" in done.stdout


def test_a_bare_command_prints_the_overview_as_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "usage: rlvr-lightning COMMAND" in capsys.readouterr().err


def test_a_tiny_run_emits_none_of_the_projects_warnings(tmp_path):
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main([*args, "--ckpt_path=last"])  # "resume if there is one": there is none yet
    messages = [f"{w.filename}: {w.message}" for w in caught]
    assert not [m for m in messages if "transfer_batch_to_device" in m], messages
    assert not [m for m in messages if 'ckpt_path="last"' in m], messages
    assert not [m for m in messages if f"{os.sep}rlvr_lightning{os.sep}" in m], messages
    assert not [m for m in messages if "LeafSpec" in m], messages  # Lightning vs torch 2.13


def test_lightnings_logger_advert_is_dropped_and_other_info_kept():
    silence_library_noise()
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")

    def passes(message: str) -> bool:
        record = logging.LogRecord("x", logging.INFO, __file__, 1, message, None, None)
        return bool(rank_zero_logger.filter(record))

    assert not passes("💡 Tip: For seamless cloud logging and experiment tracking, try ...")
    assert passes("GPU available: False, used: False")


def test_modelcheckpoints_manual_optimisation_example_is_muted_and_other_warnings_kept():
    from lightning.pytorch.utilities import rank_zero_warn

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silence_library_noise()
        rank_zero_warn(
            "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no "
            "pre-optimization state was saved. The checkpoint will contain the model state ..."
        )
        rank_zero_warn(
            "Precision bf16-mixed is not supported by the model summary.  Estimated model size "
            "in MB will not be accurate. Using 32 bits instead."
        )
        warnings.warn("a warning the user should see", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning the user should see"]
