"""Asynchronous rollouts through a real fit: the delay line, the stale-round drop, the weight
check, and SIGTERM mid-step with rounds in flight resumed with ``--ckpt_path=last`` exactly as
an uninterrupted run, in ``sync`` and ``async`` mode on the HF engine."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlvr_lightning.asynchrony import WeightSyncError
from rlvr_lightning.cli.main import build_cli
from rlvr_lightning.stages.hooks import RLVRCallback
from rlvr_lightning.testing import quiet_trainer, tiny_module

ROOT = Path(__file__).parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def ckpt_flags(dirpath: Path) -> list[str]:
    return [
        "--trainer.enable_checkpointing=true",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={dirpath}",
        "--trainer.callbacks.every_n_train_steps=100",  # only the on-exception save and last
        "--trainer.callbacks.monitor=step",
        "--trainer.callbacks.mode=max",
        "--trainer.callbacks.save_top_k=2",
        "--trainer.callbacks.save_last=true",
        "--trainer.callbacks.save_on_exception=true",
    ]


def cli(root: Path, *extra: str, run: bool = False):
    args = ["--config", CONFIG, f"--trainer.default_root_dir={root}"]
    args += ["--trainer.limit_val_batches=0", "--trainer.max_steps=4", *extra]
    return build_cli(["fit", *args]) if run else build_cli(args, run=False)


def fit(c, ckpt_path: Path | str | None = None):
    c.trainer.fit(c.model, datamodule=c.datamodule, ckpt_path=ckpt_path)
    return c


def state(c) -> dict:
    return {
        "weights": {k: v.clone() for k, v in c.model.state_dict().items()},
        "optimizer": c.trainer.optimizers[0].state_dict(),
        "data": c.datamodule.state_dict(),
        "queue": c.model.rollout_queue.state_dict(),
        "partial": c.model.partial_pool.state_dict(),
        "rollout_step": c.model._rollout_step,
        "global_step": c.trainer.global_step,
        "rng": torch.get_rng_state(),
    }


def assert_same(a, b, path="") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), path
    else:
        assert a == b, path


def interrupt_at(c, method: str, call: int) -> None:
    """SIGTERM to this process just before call number ``call`` of ``c.model.<method>``."""
    original, calls = getattr(c.model, method), [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    setattr(c.model, method, wrapped)


# Two optimiser steps per rollout step (one micro-batch each): a signal after the first waits
# for the end of its rollout step.
TWO = ["--model.init_args.update.minibatches_per_rollout=2", "--trainer.max_steps=6"]
WORKER = "--model.init_args.engine_kwargs={process: true}"


@pytest.mark.parametrize(
    ("mode", "extra", "method", "call", "saved_at"),
    [
        # score 3 = step 2's generation. sync: saved as of step 1's end (2 updates); async:
        # step 0 only filled the queue, so 1 update, and step 1's round is in flight.
        ("sync", [], "score", 3, 2),
        ("async", [], "score", 3, 1),
        # manual_backward 4 = after the first optimiser step of sync step 1 / async step 2 (step
        # 0 only generated): the stop waits for the step's end, 2 updates of 2 steps each.
        ("sync", TWO, "manual_backward", 4, 4),
        ("async", TWO, "manual_backward", 4, 4),
        # The HF engine in a worker process (overlapped): same schedule, same guarantee. Score 3
        # is step 2's round, scored when it arrives after step 2's update: saved at its end.
        ("async", [WORKER], "score", 3, 2),
        ("async", [WORKER, *TWO], "manual_backward", 4, 4),
    ],
)
def test_sigterm_mid_step_then_ckpt_path_last_gives_the_uninterrupted_run(
    tmp_path, mode, extra, method, call, saved_at
):
    run = [f"--model.init_args.rollout_mode={mode}", *extra]
    full = state(fit(cli(tmp_path / "full", *run)))
    flags = [*run, *ckpt_flags(tmp_path / "c")]
    c = cli(tmp_path, *flags)
    interrupt_at(c, method, call)
    # At once: the guard's exit 143. Deferred to the step's end: Lightning's SIGTERMException
    # (which the console command turns into exit 143 too, cli/main.py).
    with pytest.raises((SystemExit, SIGTERMException)) as stop:
        fit(c)
    assert isinstance(stop.value, SIGTERMException) or stop.value.code == 143
    saved = torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)
    assert saved["global_step"] == saved_at
    if mode == "async":  # the round generated but not trained is in the checkpoint
        assert len(saved["rlvr_async"]["queue"]["rounds"]) == 1
    resumed = state(cli(tmp_path, *flags, "--ckpt_path=last", run=True))
    assert_same(resumed, full)
    updates = full["global_step"] // (2 if TWO[0] in extra else 1)
    assert full["rollout_step"] == updates + (mode == "async")  # async: + 1 step that filled


def test_async_trains_each_round_one_version_after_it_was_drawn(tmp_path):
    c = fit(cli(tmp_path, "--model.init_args.rollout_mode=async"))
    m = c.model.last_step.metrics
    assert m["async/staleness_1"] == 1.0 and m["async/staleness_0"] == 0.0
    assert m["async/queue_depth"] == 1.0 and m["async/dropped_rows"] == 0.0
    assert 0 < m["async/trainer_idle_share"] < 1 and 0 < m["async/worker_idle_share"] < 1
    assert c.model.weight_sync.version == 4  # one push per update
    assert c.datamodule.composer.steps == 4  # every trained round reported to the data


def test_a_round_older_than_max_staleness_never_reaches_the_loss(tmp_path):
    """Written with max_staleness 2 (two rounds in flight), resumed with 1 at version 2: the
    oldest round (version 0) lags 2 versions and is dropped whole; the update never sees it."""
    flags = [*ckpt_flags(tmp_path / "c"), "--model.init_args.rollout_mode=async"]
    fit(cli(tmp_path, *flags, "--model.init_args.max_staleness=2", "--trainer.max_steps=2"))
    saved = torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)
    rounds = saved["rlvr_async"]["queue"]["rounds"]
    # Steps 0, 1 filled the queue with version 0's rounds; steps 2, 3 trained them (pushing
    # versions 1, 2) and queued rounds from versions 0 (step 2, before its update) and 1.
    assert [r["version"] for r in rounds] == [0, 1]
    stale = rounds[0]["scored"]["rollouts"]["completion_ids"]
    c = cli(tmp_path, *flags, "--model.init_args.max_staleness=1", "--trainer.max_steps=3")
    seen = []
    update = c.model.update

    def recording(scored, *args, **kwargs):
        seen.append(scored.rollouts.completion_ids.clone())
        return update(scored, *args, **kwargs)

    c.model.update = recording
    fit(c, ckpt_path=tmp_path / "c" / "last.ckpt")
    assert seen and not any(s.shape == stale.shape and torch.equal(s, stale) for s in seen)
    m = c.model.last_step.metrics
    assert (m["async/dropped_rounds"], m["async/dropped_rows"]) == (1.0, float(len(stale)))


class Tamper(RLVRCallback):
    """Changes the policy's weights after the first step, outside the update."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            with torch.no_grad():
                next(module.policy.parameters()).add_(1.0)


def test_weights_changed_outside_the_update_stop_the_run_naming_both_versions():
    from rlvr_lightning.data import RLVRDataModule

    module = tiny_module(rollout_mode="async")
    data = RLVRDataModule(source="addition", train_size=16, val_size=4, prompts_per_step=2)
    trainer = quiet_trainer(max_steps=3, callbacks=[Tamper()])
    with pytest.raises(WeightSyncError, match="weights of no version pushed recently, but "):
        trainer.fit(module, datamodule=data)
    assert module.weight_sync.version == 1


def test_a_sync_run_resumed_from_an_async_checkpoint_is_refused(tmp_path):
    flags = ckpt_flags(tmp_path / "c")
    fit(cli(tmp_path, *flags, "--model.init_args.rollout_mode=async", "--trainer.max_steps=1"))
    with pytest.raises(ValueError, match=r"resume it with model\.init_args\.rollout_mode: async"):
        fit(cli(tmp_path, *flags, "--trainer.max_steps=2"), ckpt_path="last")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.init_args.max_staleness=0"], "max_staleness is 0; use >= 1"),
        (["--model.init_args.deterministic_schedule=false"], "set it to true"),
        (
            [
                "--model.init_args.rollout_mode=async",
                "--model.init_args.selection.dynamic_sampling=true",
            ],
            "rollout_mode: async with selection.dynamic_sampling",
        ),
        (["--model.init_args.concurrent_rollouts=4"], "set rollout_mode: async too"),
        (
            [
                "--model.init_args.rollout_mode=async",
                "--model.init_args.concurrent_rollouts=4",
                "--model.init_args.multiturn.tools=[rlvr_lightning.environments.calculator]",
            ],
            "continues single-turn completions",
        ),
        (
            ["--model.init_args.rollout_mode=async", "--model.init_args.concurrent_rollouts=1"],
            "Set model.init_args.concurrent_rollouts >= 2",
        ),
    ],
)
def test_bad_asynchrony_settings_are_named_by_the_cli(capsys, args, message):
    from rlvr_lightning.cli.main import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", CONFIG, *args])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and message in err and "Traceback" not in err, err


def test_a_look_ahead_puts_the_queue_and_the_pushes_back(tmp_path):
    """NPO's look-ahead trains ahead and restores the training state: with async rollouts
    that state includes the queued rounds and the weight pushes."""
    from rlvr_lightning.guidance import lookahead

    c = fit(cli(tmp_path, "--model.init_args.rollout_mode=async", "--trainer.max_steps=2"))
    module, trainer = c.model, c.trainer
    before = (module.rollout_queue.state_dict(), module.weight_sync.state_dict())
    saved = lookahead.capture(trainer, module)
    module.rollout_queue.rounds.clear()
    module.weight_sync.push(module.weight_sync.version + 1, module.policy.named_parameters())
    lookahead.restore(trainer, module, saved)
    assert_same((module.rollout_queue.state_dict(), module.weight_sync.state_dict()), before)
    assert len(before[0]["rounds"]) == 1


PARTIAL = [
    "--model.init_args.rollout_mode=async",
    "--model.init_args.concurrent_rollouts=4",
    "--model.init_args.partial_chunk_tokens=4",
]


def test_partial_rollouts_train_finished_groups_and_carry_the_rest(tmp_path, uneven_lengths):
    c = cli(tmp_path, *PARTIAL, "--trainer.max_steps=6")
    crossed = []
    publish = c.model.publish

    def recording(output):
        crossed.append(output.metrics["async/partial_cross_stage_rows"])
        return publish(output)

    c.model.publish = recording
    with pytest.warns(UserWarning, match="may span 2 versions; max_staleness=1 drops such rows"):
        fit(c)
    m = c.model.last_step.metrics
    assert c.trainer.global_step == 6 and c.datamodule.composer.steps == 6
    assert m["async/staleness_0"] + m["async/staleness_1"] == 1.0
    assert sum(crossed) > 0  # some trained rows were written by two versions
    # A long row advances one 4-token chunk a step when short groups end each step early:
    # its third chunk would come from a version 2 newer than its first, past max_staleness 1.
    assert m["async/dropped_rows"] > 0


def test_partial_rollouts_resume_exactly_after_sigterm_mid_step(tmp_path, uneven_lengths):
    full = state(fit(cli(tmp_path / "full", *PARTIAL)))
    flags = [*PARTIAL, *ckpt_flags(tmp_path / "c")]
    c = cli(tmp_path, *flags)
    interrupt_at(c, "score", 3)
    with pytest.raises((SystemExit, SIGTERMException)):
        fit(c)
    saved = torch.load(tmp_path / "c" / "last.ckpt", weights_only=True)
    assert saved["rlvr_async"]["partial"]["groups"]  # rows in flight went into the checkpoint
    resumed = fit(cli(tmp_path, *flags), ckpt_path=tmp_path / "c" / "last.ckpt")
    assert_same(state(resumed), full)
