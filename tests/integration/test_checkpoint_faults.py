"""Injected checkpoint faults: signals, unwritable or shared-filesystem directories, corrupt
files, non-finite updates. Each run either continues or stops with a clear message, and what
is on disk is one consistent state (or nothing)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from rlvr_lightning.cli.main import build_cli, main
from rlvr_lightning.runtime import checkpointing

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def ckpt_flags(dirpath: Path, every: int = 1, keep: int = 2) -> list[str]:
    """The shipped configs' ModelCheckpoint settings, on ``dirpath``."""
    return [
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={dirpath}",
        f"--trainer.callbacks.every_n_train_steps={every}",
        "--trainer.callbacks.monitor=step",
        "--trainer.callbacks.mode=max",
        f"--trainer.callbacks.save_top_k={keep}",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.save_on_exception=true",
    ]


def cli(tmp_path: Path, *extra: str, subcommand: bool = False):
    args = ["--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    args += ["--trainer.limit_val_batches=0", *extra]
    return build_cli(["fit", *args]) if subcommand else build_cli(args, run=False)


def fit(c, ckpt_path: Path | None = None):
    c.trainer.fit(c.model, datamodule=c.datamodule, ckpt_path=ckpt_path)
    return c


# ---- 1. shipped configs save periodically, on signals, and keep the last K -------------------


@pytest.mark.parametrize(
    "name",
    [
        "quickstart",
        "replay",
        "curriculum",
        "mixed_policy_guidance",
        "execution_feedback",
        "tool_calculator",
    ],
)
def test_shipped_configs_save_every_n_steps_on_exception_and_keep_the_last_k(name):
    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    (cb,) = [
        c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")
    ]
    args = cb["init_args"]
    assert 1 <= args["every_n_train_steps"] < config["trainer"]["max_steps"]
    assert args["monitor"] == "step" and args["mode"] == "max" and args["save_top_k"] >= 2
    assert args["save_last"] is True and args["save_on_exception"] is True
    assert args["dirpath"].startswith(f"outputs/{name}")  # fixed: `ckpt_path: last` finds it


def test_the_last_k_step_checkpoints_and_last_are_kept(tmp_path):
    fit(cli(tmp_path, "--trainer.max_steps=4", *ckpt_flags(tmp_path / "c", every=1, keep=2)))
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert names == ["epoch=0-step=3.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"]
    assert torch.load(tmp_path / "c" / "last.ckpt", weights_only=False)["global_step"] == 4


# ---- 2. SIGTERM: checkpoint, then a non-zero exit code ---------------------------------------


def test_sigterm_from_outside_saves_and_exits_143(tmp_path):
    exe = Path(sys.executable).parent / "rlvr-lightning"
    cmd = [str(exe), "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    cmd += ["--trainer.max_steps=100000", "--trainer.limit_val_batches=0"]
    cmd += ckpt_flags(tmp_path / "c", every=1)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "c" / "last.ckpt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, out
    assert "SIGTERM received" in out
    assert not list((tmp_path / "c").glob(".*.tmp")), "a temporary file was left behind"
    last = torch.load(tmp_path / "c" / "last.ckpt", weights_only=False)
    assert last["global_step"] >= 1 and checkpointing.UNSAFE_KEY not in last


@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_mid_write_finishes_the_file_then_stops_143(tmp_path, monkeypatch, caplog, signals):
    """A stop signal inside ``torch.save`` used to break the zip writer ("unexpected pos"):
    exit code 1 and the file lost. Now one signal waits for the write; a second stops at once,
    still with 143 and no partial file."""
    real_save, saves = torch.save, []

    class SignalledFile:  # torch.save's target; sends SIGTERM on given write calls of save 3
        def __init__(self, f, at: tuple[int, ...]):
            self.f, self.at, self.calls = f, at, 0

        def write(self, data):
            self.calls += 1
            if self.calls in self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    def save(obj, f):
        saves.append(1)
        at = (2, 4)[:signals] if len(saves) == 3 else ()  # save 3: step 2's step file
        return real_save(obj, SignalledFile(f, at))

    monkeypatch.setattr(checkpointing.torch, "save", save)
    d = tmp_path / "c"
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    args += ["--trainer.max_steps=5", "--trainer.limit_val_batches=0", *ckpt_flags(d, every=1)]
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 143
    assert not list(d.glob(".*.tmp")), "a temporary file was left behind"
    assert "SIGTERM received during a checkpoint write: stopping when it ends" in caplog.text
    if signals == 2:
        assert "SIGTERM received again: stopping now" in caplog.text
    # Finished, or (second signal) written again by the on-exception save: step 2 either way.
    assert torch.load(d / "epoch=0-step=2.ckpt", weights_only=False)["global_step"] == 2
    assert torch.load(d / "last.ckpt", weights_only=False)["global_step"] == 2
    for path in d.glob("*.ckpt"):
        assert checkpointing.readable(path), path


# ---- 3. SIGINT mid-step: one consistent state, resumed bit-identically ------------------------


def _interrupt_at(c, method: str, call: int, action) -> None:
    """Run ``action`` just before call number ``call`` of ``c.model.<method>``."""
    original, calls = getattr(c.model, method), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            action()
        return original(*args, **kwargs)

    setattr(c.model, method, wrapped)


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def _boom() -> None:
    raise RuntimeError("injected failure during the update")


def _state(c) -> dict:
    return {
        "weights": {k: v.clone() for k, v in c.model.state_dict().items()},
        "optimizer": c.trainer.optimizers[0].state_dict(),
        "data": c.datamodule.state_dict(),
        "rollout_step": c.model._rollout_step,
        "global_step": c.trainer.global_step,
        "rng": torch.get_rng_state(),
    }


def _assert_same(a, b, path="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}/{i}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


# Two optimiser steps per rollout step; calls 1-2 belong to rollout step 0, 3-4 to step 1.
STEP = ["--model.init_args.update.minibatches_per_rollout=2", "--trainer.max_steps=6"]


@pytest.mark.parametrize(
    ("method", "call", "saved_at"),
    [
        ("score", 2, 2),  # after step 1's rollout drew samples: saved as of step 0's end
        ("manual_backward", 4, 4),  # after step 1's first optimiser step: waits for its end
    ],
)
def test_sigint_mid_step_saves_one_state_that_resumes_bit_identically(
    tmp_path, method, call, saved_at
):
    flags = [*STEP, *ckpt_flags(tmp_path / "c", every=100)]  # only the on-exception save
    full = _state(fit(cli(tmp_path / "full", *STEP)))
    c = cli(tmp_path, *flags)
    _interrupt_at(c, method, call, _sigint)
    with pytest.raises(SystemExit) as stop:
        fit(c)
    assert stop.value.code == 130
    last = tmp_path / "c" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == saved_at
    resumed = _state(fit(cli(tmp_path, *flags), ckpt_path=last))
    _assert_same(resumed, full)


def test_an_error_after_the_weights_changed_writes_no_checkpoint(tmp_path, caplog):
    c = cli(tmp_path, *STEP, *ckpt_flags(tmp_path / "c", every=100))
    _interrupt_at(c, "manual_backward", 4, _boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(c)
    assert not list((tmp_path / "c").glob("*.ckpt"))
    assert "NOT written: interrupted during the weight update of rollout step 1" in caplog.text


# ---- 4. an unwritable checkpoint directory fails before training ------------------------------


def test_unwritable_checkpoint_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    c = cli(tmp_path, *ckpt_flags(blocker / "ckpt"))
    with pytest.raises(checkpointing.CheckpointError, match=f"{blocker / 'ckpt'} is not writable"):
        fit(c)
    assert c.trainer.global_step == 0 and c.model._rollout_step == 0


# ---- 5. atomic writes: a kill mid-write keeps the previous checkpoint -------------------------


def test_a_kill_mid_write_keeps_the_previous_file_and_writes_beside_it(tmp_path, monkeypatch):
    io, target = checkpointing.AtomicCheckpointIO(), tmp_path / "c" / "last.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}}, target)
    before = target.read_bytes()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))  # another filesystem, maybe
    written_to = []

    def killed(obj, f):
        written_to.extend(p.name for p in target.parent.glob(".last.ckpt.*.tmp"))
        f.write(b"partial")
        raise KeyboardInterrupt  # the process dies mid-write

    monkeypatch.setattr(checkpointing.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}}, target)
    assert target.read_bytes() == before
    assert written_to, "the temporary file was not written beside the target"
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]


def test_a_full_disk_stops_the_cli_naming_the_disk_and_the_newest_good_checkpoint(
    tmp_path, monkeypatch, capsys
):
    real_save, saves = torch.save, []

    def save_until_full(obj, f):  # two files fit (step 1 and last), then the disk is full
        saves.append(1)
        if len(saves) <= 2:
            return real_save(obj, f)
        f.write(b"partial")  # what torch's zip writer reports when a write comes up short:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpointing.torch, "save", save_until_full)

    def disk_usage(directory):  # the disk is full while the partial file is on it, not after
        full = any(Path(directory).glob(".*.tmp"))
        return shutil._ntuple_diskusage(10**9, 10**9, 2**20 if full else 10**9)

    monkeypatch.setattr(checkpointing.shutil, "disk_usage", disk_usage)
    args = ["fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    args += ["--trainer.max_steps=3", "--trainer.limit_val_batches=0"]
    with pytest.raises(SystemExit) as stop:
        main([*args, *ckpt_flags(tmp_path / "c", every=1)])
    err = capsys.readouterr().err
    assert stop.value.code == 1, err
    assert "CheckpointError: Checkpoint" in err and "could not be written: no space left" in err
    assert "the newest good checkpoint is" in err and "--ckpt_path" in err
    good = Path(err.split("the newest good checkpoint is ")[1].split(".ckpt.")[0] + ".ckpt")
    assert torch.load(good, weights_only=False)["global_step"] == 1
    assert not list((tmp_path / "c").glob(".*.tmp")), "a temporary file was left behind"


def test_a_file_size_limit_is_named_when_it_stops_a_checkpoint(tmp_path):
    exe = Path(sys.executable).parent / "rlvr-lightning"
    cmd = [str(exe), "fit", "--config", CONFIG, f"--trainer.default_root_dir={tmp_path}"]
    cmd += ["--trainer.max_steps=2", "--trainer.limit_val_batches=0"]
    cmd += ckpt_flags(tmp_path / "c", every=1)
    limit = 64 * 1024  # below the tiny model's checkpoint, above everything else the run writes

    def limit_writes() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=limit_writes)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "the file size limit (ulimit -f) stopped it" in proc.stderr, proc.stderr[-3000:]
    assert "no good checkpoint was found" in proc.stderr
    assert not list((tmp_path / "c").glob(".*.tmp")), "a temporary file was left behind"


def test_saving_over_a_last_link_replaces_the_link_not_its_target(tmp_path):
    io = checkpointing.AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(1)}}, tmp_path / "step=1.ckpt")
    (tmp_path / "last.ckpt").symlink_to("step=1.ckpt")
    io.save_checkpoint({"state_dict": {"w": torch.zeros(1)}}, tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert torch.load(tmp_path / "step=1.ckpt")["state_dict"]["w"].item() == 1.0


# ---- 6. a corrupt checkpoint names itself and the newest good one -----------------------------


def test_a_corrupt_checkpoint_names_the_file_and_the_newest_good_one(tmp_path):
    d = tmp_path / "c"
    fit(cli(tmp_path, "--trainer.max_steps=2", *ckpt_flags(d, every=1)))
    (d / "last.ckpt").write_bytes(b"")  # a kill mid-write under an in-place writer
    with pytest.raises(checkpointing.CheckpointError) as err:
        cli(
            tmp_path,
            "--trainer.max_steps=3",
            *ckpt_flags(d),
            f"--ckpt_path={d / 'last.ckpt'}",
            subcommand=True,
        )
    assert str(d / "last.ckpt") in str(err.value)
    assert f"newest good checkpoint is {d / 'epoch=0-step=2.ckpt'}" in str(err.value)


def test_ckpt_path_last_skips_a_corrupt_last_and_writes_last_again(tmp_path, caplog):
    """Before: a broken last.ckpt stopped ``--ckpt_path last``, and a run started anyway wrote
    last-v1.ckpt beside it. Now ``last`` resumes from the newest good file, the broken one is
    kept aside as ``last.ckpt.unreadable`` and the run writes ``last.ckpt`` again."""
    d = tmp_path / "c"
    fit(cli(tmp_path, "--trainer.max_steps=2", *ckpt_flags(d, every=1)))
    (d / "last.ckpt").write_bytes(b"")
    c = cli(tmp_path, "--trainer.max_steps=3", *ckpt_flags(d), "--ckpt_path=last", subcommand=True)
    assert "last.ckpt cannot be read; resuming from" in caplog.text
    assert c.trainer.global_step == 3  # resumed at step 2, one more step
    assert (d / "last.ckpt.unreadable").stat().st_size == 0
    assert not list(d.glob("last-v*.ckpt"))
    assert torch.load(d / "last.ckpt", weights_only=False)["global_step"] == 3


# ---- 7. non-finite gradients skip the step; non-finite weights are never saved ----------------


def test_huge_lr_skips_nonfinite_gradient_steps_and_says_which_checkpoint_is_good(tmp_path):
    d = tmp_path / "c"
    c = cli(
        tmp_path,
        "--model.init_args.update.lr=1e30",
        "--model.init_args.update.grad_clip=null",
        "--model.init_args.update.max_nonfinite_steps=2",
        "--trainer.max_steps=8",
        *ckpt_flags(d, every=1, keep=10),
    )
    with pytest.raises(FloatingPointError, match="non-finite for 2 optimiser steps") as err:
        fit(c)
    assert f"on disk the newest good checkpoint is {d}" in str(err.value)
    for path in d.glob("*.ckpt"):
        saved = torch.load(path, weights_only=False)
        assert not checkpointing.nonfinite_tensors(saved["state_dict"]), path


def test_non_finite_weights_are_refused_with_a_clear_error(tmp_path):
    c = fit(cli(tmp_path, "--trainer.max_steps=1"))
    next(c.model.policy.parameters()).data.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match=r"Refusing to save a checkpoint: .* non-finite"):
        c.trainer.save_checkpoint(tmp_path / "nan.ckpt")
    assert not (tmp_path / "nan.ckpt").exists()
