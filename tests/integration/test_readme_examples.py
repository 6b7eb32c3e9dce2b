"""Every YAML example of the README parses through the CLI, beside the Python files it names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(sys.executable).with_name("rlvr-lightning"))
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)


def _blocks(kind: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [body for lang, body in BLOCK.findall(text) if lang == kind]


def _python_files() -> dict[str, str]:
    """The README's Python examples that open with ``# name.py``, by file name."""
    files = {}
    for body in _blocks("python"):
        first = body.splitlines()[0]
        if first.startswith("# ") and first.endswith(".py"):
            files[first[2:]] = body
    return files


CONFIGS = [b for b in _blocks("yaml") if re.search(r"^(model|data|trainer):", b, re.M)]


def test_the_readme_has_config_examples():
    assert len(CONFIGS) >= 3 and "my_rewards.py" in _python_files()


@pytest.mark.parametrize("example", CONFIGS, ids=[c.splitlines()[2][:40] for c in CONFIGS])
def test_a_readme_config_example_parses(tmp_path, example):
    for name, body in _python_files().items():
        (tmp_path / name).write_text(body)
    (tmp_path / "example.yaml").write_text(example)
    tiny = str(ROOT / "configs" / "tiny.yaml")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [SCRIPT, "fit", "--config", tiny, "--config", "example.yaml", "--print_config"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
