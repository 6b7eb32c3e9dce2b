"""Memory you can see: a prompt limit beyond the model's context is refused at start, and a
reward that allocates without bound is stopped with a message and a checkpoint, not
OOM-killed. Both go through ``rlvr-lightning fit`` on ``configs/tiny.yaml``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlvr_lightning.cli.main import main

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
EXE = str(Path(sys.executable).parent / "rlvr-lightning")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# A reward that, from its second call on, allocates (and writes) 20 MiB every 20 ms, up to a
# cap that keeps a broken guard from taking the machine down with the test.
HOG = """
import time
import torch

HELD, CALLS = [], [0]
CAP = {cap}


def hog(completions, **_):
    CALLS[0] += 1
    while CALLS[0] >= 2 and sum(t.numel() * 4 for t in HELD) < CAP:
        HELD.append(torch.ones(5 * 2**20))
        time.sleep(0.02)
    return [0.5] * len(completions)
"""


def run(args: list[str], capsys) -> tuple[int, str, float]:
    start = time.monotonic()
    try:
        main(args)
        code = 0
    except SystemExit as stop:
        code = int(stop.code or 0)
    out = capsys.readouterr()
    return code, out.out + out.err, time.monotonic() - start


def test_a_prompt_limit_beyond_the_context_is_refused_at_start(tmp_path, capsys):
    """Before: ``max_prompt_tokens: 200000`` on a 512-position model was accepted, ran ~300 s
    and was OOM-killed. Now ``fit`` stops before the first step with the largest value that
    fits."""
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    code, out, seconds = run([*args, "--data.init_args.max_prompt_tokens=200000"], capsys)
    assert code == 1, out
    assert "max_prompt_tokens=200000" in out and "context of 512 positions" in out
    assert "set data.init_args.max_prompt_tokens to at most" in out
    assert seconds < 60


def test_a_reward_allocating_without_bound_stops_with_a_message_and_a_checkpoint(tmp_path):
    """Before: the trainer was OOM-killed with no message and nothing saved. Now MemoryGuard
    warns once near the limit, naming the settings, then stops the run with exit code 1
    (not 134: the reward's thread still allocates while the process ends) and the
    on-exception checkpoint written. Run as the console script, with a 3 GiB limit."""
    limit, cap = 3 * 2**30, 3 * 2**30
    (tmp_path / "hog_reward.py").write_text(textwrap.dedent(HOG.format(cap=cap)))
    d = tmp_path / "c"
    cmd = [EXE, "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    cmd += ["--trainer.max_steps=4", "--trainer.limit_val_batches=0"]
    cmd += ["--model.init_args.rewards.functions=[hog_reward.hog]"]
    cmd += ["--trainer.enable_checkpointing=true"]
    cmd += ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint"]
    cmd += [f"--trainer.callbacks.dirpath={d}", "--trainer.callbacks.save_last=true"]
    cmd += ["--trainer.callbacks.every_n_train_steps=1"]
    cmd += ["--trainer.callbacks.save_on_exception=true"]
    cmd += ["--trainer.callbacks+=rlvr_lightning.callbacks.MemoryGuard"]
    cmd += [f"--trainer.callbacks.limit_bytes={limit}"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("Memory: the trainer holds")]
    assert len(lines) == 2, out[-3000:]  # one warning, one stop
    assert "it may use (MemoryGuard.limit_bytes). To use less, lower" in lines[0]
    assert "update.micro_batch_size (4)" in lines[0] and "sampling.max_new_tokens (12)" in lines[0]
    assert "over MemoryGuard's stop_share 0.95: stopping" in lines[1]
    held = float(lines[1].split("holds ")[1].split(" GiB")[0])
    assert 0.95 * 3 <= held < 3 + 0.2  # stopped near the limit, not after the reward's cap
    saved = torch.load(d / "last.ckpt", weights_only=False)  # step 1, or the on-exception save
    assert saved["global_step"] >= 1
