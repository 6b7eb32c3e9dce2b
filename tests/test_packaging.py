"""The installed package matches the source folders; importing it stays light."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _folders_with_init(base: Path) -> set[str]:
    return {
        str(p.parent.relative_to(base))
        for p in base.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }


def test_package_list_covers_every_package_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = set(config["packages"])
    found = {
        "rlvr_lightning" if f == "." else "rlvr_lightning." + f.replace("/", ".")
        for f in _folders_with_init(ROOT / "rlvr_lightning")
    }
    found |= {"rlvr_lightning.callbacks", "rlvr_lightning.hub_cards"}
    assert declared == found
    assert config["package-dir"]["rlvr_lightning.callbacks"] == "callbacks"
    assert config["package-dir"]["rlvr_lightning.hub_cards"] == "hub_cards"


def test_import_does_not_pull_vllm():
    code = "import sys, rlvr_lightning, rlvr_lightning.cli.main; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_callbacks_refuse_a_second_identity():
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import callbacks"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "rlvr_lightning.callbacks" in out.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_every_config_parses(config, capsys):
    from rlvr_lightning.cli.main import build_cli

    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path" in capsys.readouterr().out
