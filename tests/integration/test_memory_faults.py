"""Memory you can see: a prompt limit beyond the model's context is refused at start, and a
reward that allocates without bound is stopped with a message and a checkpoint, not
OOM-killed. Both go through ``rlvr-lightning fit`` on ``configs/tiny.yaml``."""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from rlvr_lightning import memory
from rlvr_lightning.cli import main

CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")

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
    code, out, seconds = run(
        ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
        + ["--data.init_args.max_prompt_tokens=200000"],
        capsys,
    )
    assert code == 1, out
    assert "max_prompt_tokens=200000" in out and "context of 512 positions" in out
    assert "set data.init_args.max_prompt_tokens to at most" in out
    assert seconds < 60


def test_a_reward_allocating_without_bound_stops_with_a_message_and_a_checkpoint(
    tmp_path, capsys, caplog, monkeypatch
):
    """Before: the trainer was OOM-killed with no message and nothing saved. Now MemoryGuard
    warns once near the limit, naming the settings, then stops the run (exit code 1) with the
    on-exception checkpoint written."""
    cap = 2 * 2**30
    (tmp_path / "hog_reward.py").write_text(textwrap.dedent(HOG.format(cap=cap)))
    monkeypatch.syspath_prepend(str(tmp_path))
    limit = memory.resident_bytes() + 2**30  # a limit 1 GiB above what the test holds now
    d = tmp_path / "c"
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    args += ["--trainer.max_steps=4", "--trainer.limit_val_batches=0"]
    args += ["--model.init_args.reward_fns=[hog_reward.hog]"]
    args += ["--trainer.enable_checkpointing=true"]
    args += ["--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint"]
    args += [f"--trainer.callbacks.dirpath={d}", "--trainer.callbacks.save_last=true"]
    args += ["--trainer.callbacks.every_n_train_steps=1"]
    args += ["--trainer.callbacks.save_on_exception=true"]
    args += ["--trainer.callbacks+=rlvr_lightning.callbacks.MemoryGuard"]
    args += [f"--trainer.callbacks.limit_bytes={limit}", "--trainer.callbacks.interval_s=0.05"]
    try:
        code, out, _ = run(args, capsys)
        held = sum(t.numel() * 4 for t in sys.modules["hog_reward"].HELD)
    finally:
        sys.modules["hog_reward"].HELD.clear()
    assert code == 1, out
    assert held < cap, "the guard did not stop the reward before its cap"
    warnings = [r for r in caplog.records if "Memory: the trainer holds" in r.getMessage()]
    assert [r.levelname for r in warnings] == ["WARNING", "ERROR"], caplog.text
    assert "micro_batch_size (4)" in warnings[0].getMessage()
    assert "sampling.max_new_tokens (12)" in warnings[0].getMessage()
    assert "over MemoryGuard's stop_share 0.95" in warnings[1].getMessage()
    saved = torch.load(d / "last.ckpt", weights_only=False)  # step 1, or the on-exception save
    assert saved["global_step"] >= 1
