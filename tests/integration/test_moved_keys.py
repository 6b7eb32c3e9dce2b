"""Keys from before the option groups fail in one line that names their new place."""

from pathlib import Path

import pytest
import yaml

from rlvr_lightning.cli.main import main
from rlvr_lightning.options import MOVED

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


@pytest.mark.parametrize(
    ("old", "value"),
    [("kl_coef", "0.1"), ("reward_fns", "[rlvr_lightning.rewards.boxed_format]"),
     ("lora_rank", "4"), ("rollout_correction", "mask"), ("micro_batch_size", "2")],
)  # fmt: skip
def test_an_old_key_on_the_command_line_names_its_group(fit_error, old, value):
    err = fit_error(f"--model.init_args.{old}={value}")
    fix = [line for line in err.splitlines() if "Fix:" in line]
    assert fix == [f"  Fix: `model.init_args.{old}` moved: write `model.init_args.{MOVED[old]}` "
                   f"(YAML: `{MOVED[old].split('.')[0]}: {{{MOVED[old].split('.')[1]}: ...}}` "
                   "under init_args)."]  # fmt: skip


def test_an_old_key_in_a_yaml_file_names_its_group(tmp_path, fit_error):
    run = tmp_path / "old.yaml"
    run.write_text(yaml.safe_dump({"model": {"init_args": {"lr": 1e-4}}}))
    err = fit_error("--config", str(run))
    assert "`model.init_args.lr` moved: write `model.init_args.update.lr`" in err


def test_every_config_file_parses(capsys):
    for path in sorted(Path(CONFIG).parent.glob("*.yaml")):
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--config", str(path), "--print_config"])
        assert exit_info.value.code in (0, None), f"{path.name}: {capsys.readouterr().err}"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("path", sorted(Path(CONFIG).parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_builds_its_module(tmp_path, path):
    # Every key of every shipped config reaches the constructors (the tiny model swapped in).
    from rlvr_lightning.cli.main import build_cli

    cli = build_cli(
        ["--config", str(path), "--model.init_args.policy=tiny:0", "--trainer.callbacks=[]",
         "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"],
        run=False,
    )  # fmt: skip
    assert cli.model.tokenizer is not None and cli.datamodule is not None


def test_a_group_field_set_to_null_on_the_command_line(tmp_path):
    # jsonargparse alone rejects a dotted null inside a dataclass argument ("Given value: None").
    from rlvr_lightning.cli.main import build_cli

    cli = build_cli(
        ["--config", CONFIG, "--model.init_args.update.grad_clip=null",
         "--model.update.max_steps_without_update=null", "--trainer.logger=false"],
        run=False,
    )  # fmt: skip
    update = cli.model.options.update
    assert update.grad_clip is None and update.max_steps_without_update is None
    assert update.lr == 1e-3  # the config's other fields stay


def test_the_console_script_sets_a_null_without_lightnings_args_warning(tmp_path):
    import subprocess
    import sys

    exe = str(Path(sys.executable).with_name("rlvr-lightning"))
    out = subprocess.run(
        [exe, "fit", "--config", CONFIG, "--model.init_args.update.grad_clip=null",
         "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "args parameter is intended" not in out.stderr
