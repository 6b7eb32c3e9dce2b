"""Checkpoints that can be trusted: atomic writes, one consistent state, clear refusals.

- ``AtomicCheckpointIO`` writes to a temporary file in the target's own directory, fsyncs and
  renames it over the target, so a kill mid-write leaves the previous file intact; it refuses a
  checkpoint ``RLVRModule.on_save_checkpoint`` marked inconsistent, names the newest readable
  checkpoint when asked to load an unreadable one, and turns a write that a full disk or a file
  size limit stopped into a ``CheckpointError`` that says so.
- ``CheckpointGuard`` checks the checkpoint directories are writable and locks them for this
  run (``run_lock``: one run per directory; then ``checkpoint_files.tidy`` removes leftover
  temporary files) before training, and turns SIGINT/SIGTERM into a stop at a consistent
  point, exiting with ``128 + signum`` (130, 143).
The CLI installs both by default.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import resource
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from rlvr_lightning.runtime.checkpoint_files import (
    UNSAFE_KEY,
    CheckpointError,
    check_loadable,
    checkpoint_dirs,
    describe_newest,
    newest_good,
    readable,  # noqa: F401  (re-exported: callers name checkpointing.readable)
    tidy,
)
from rlvr_lightning.runtime.run_lock import RunLock

log = logging.getLogger(__name__)

# Parts of a checkpoint taken live at save time; everything else can come from a snapshot.
LIVE_KEYS = ("state_dict", "optimizer_states", "lr_schedulers")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A failed checkpoint write with less free space than this is reported as a full disk.
LOW_SPACE_BYTES = 64 * 2**20


class TrainingStopped(SystemExit):
    """Raised on SIGINT/SIGTERM; its exit code is ``128 + signum``, the shell convention, so a
    scheduler reads the run as stopped by that signal (Lightning itself exits 0 on SIGTERM)."""

    def __init__(self, signum: int, forced: bool = False) -> None:
        super().__init__(128 + signum)
        self.signum, self.forced = signum, forced


# ---- state consistency (used by RLVRModule's checkpoint hooks) -----------------------------


def boundary_snapshot(trainer: pl.Trainer) -> dict[str, Any]:
    """Everything a checkpoint holds except the weights, optimiser and schedulers, copied now.

    Taken when a rollout step has ended; the weights are not copied because they only change
    at ``opt.step()``, which the module records.
    """
    full = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    return copy.deepcopy({k: v for k, v in full.items() if k not in LIVE_KEYS})


def use_snapshot(checkpoint: dict[str, Any], snapshot: dict[str, Any]) -> None:
    """Replace everything but the live weights/optimiser/schedulers of ``checkpoint``."""
    live = {k: checkpoint[k] for k in LIVE_KEYS if k in checkpoint}
    checkpoint.clear()
    checkpoint.update(copy.deepcopy(snapshot), **live)


def nonfinite_tensors(state_dict: dict[str, Any]) -> list[str]:
    """Names of floating-point tensors in ``state_dict`` holding NaN or inf."""
    return [
        name
        for name, t in state_dict.items()
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())
    ]


# ---- writing --------------------------------------------------------------------------------


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _size_text(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _write_blocked(err: BaseException, directory: Path, written: int) -> tuple[str, str] | None:
    """Why a checkpoint write failed and the fix, when the disk or a limit is to blame, else None.

    torch's zip writer reports a failed write as a ``RuntimeError`` ("unexpected pos ...",
    "file write failed") without the errno, so a write that failed with less than
    ``LOW_SPACE_BYTES`` left on the disk counts as out of space, and one that failed within
    1 MiB of the file size limit (RLIMIT_FSIZE) as stopped by it.
    """
    if not isinstance(err, Exception):
        return None
    code = err.errno if isinstance(err, OSError) else None
    size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    near_limit = size_limit != resource.RLIM_INFINITY and written + 2**20 >= size_limit
    if code == errno.EFBIG or near_limit:
        return (
            f"the file size limit (ulimit -f) stopped it after {_size_text(written)}",
            "raise the limit (ulimit -f unlimited)",
        )
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < LOW_SPACE_BYTES):
        left = "" if free is None else f", {_size_text(free)} left"
        return (
            f"no space left on the disk of {directory} (wrote {_size_text(written)}{left})",
            "free space, or point the ModelCheckpoint's dirpath at a disk with room",
        )
    return None


def _stop_in(err: BaseException | None) -> TrainingStopped | None:
    """The ``TrainingStopped`` that ``err`` is, or that it was raised while handling (torch's
    zip writer raises "unexpected pos" when a stop interrupts ``torch.save``)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, TrainingStopped):
            return err
        seen.add(id(err))
        err = err.__context__
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file beside the target, fsync, ``os.replace``.

    The temporary file is in the target's directory, not ``TMPDIR``: a rename across
    filesystems (EXDEV) would force an in-place write. A checkpoint marked with
    ``UNSAFE_KEY`` is not written (an error is logged instead); remote paths (fsspec) fall back
    to Lightning's writer. ``writing`` is true while a file is being written:
    ``CheckpointGuard`` then holds a stop signal until the write has ended.
    """

    writing = False

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        path = Path(path) if _is_local_file_protocol(path) else path
        if checkpoint.get(UNSAFE_KEY):
            where = Path(path).parent if isinstance(path, Path) else None
            dirs = [where] if where else []
            log.error(
                "Checkpoint %s NOT written: %s. %s.",
                path,
                checkpoint[UNSAFE_KEY],
                describe_newest(dirs).capitalize(),
            )
            return
        self.writing = True
        try:
            if not isinstance(path, Path) or storage_options is not None:
                super().save_checkpoint(checkpoint, path, storage_options)
            else:
                self._write_atomically(checkpoint, path)
        finally:
            self.writing = False

    def _write_atomically(self, checkpoint: dict[str, Any], path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes 0600; checkpoints are shared like other outputs
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            # Judged before the partial file goes: deleting it gives its space back.
            blocked = _write_blocked(err, path.parent, _file_size(tmp))
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            stop = _stop_in(err)
            if stop is not None and stop is not err:
                raise stop from None  # a forced stop mid-write, not the writer's follow-up error
            if blocked is None:
                raise
            reason, fix = blocked
            kept = "the file it would replace is intact; " if path.exists() else ""
            newest = newest_good([path.parent])
            then = f"resume with --ckpt_path {newest}" if newest else "run again"
            raise CheckpointError(
                f"Checkpoint {path} could not be written: {reason}.\n"
                f"Nothing was overwritten: {kept}{describe_newest([path.parent])}.\n"
                f"Fix: {fix}, then {then}."
            ) from err
        _fsync_dir(path.parent)

    @override
    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if _is_local_file_protocol(path):
            check_loadable(path)
        ckpt = super().load_checkpoint(path, *args, **kwargs)
        if ckpt.get(UNSAFE_KEY):
            raise CheckpointError(f"Checkpoint {path} was marked unusable: {ckpt[UNSAFE_KEY]}.")
        return ckpt


def with_atomic_io(plugins: Any) -> list[Any]:
    """``plugins`` (None, one or a list) plus an ``AtomicCheckpointIO`` unless one is given."""
    from lightning.fabric.plugins import CheckpointIO

    plugins = [] if plugins is None else list(plugins) if isinstance(plugins, list) else [plugins]
    if not any(isinstance(p, CheckpointIO) for p in plugins):
        plugins.append(AtomicCheckpointIO())
    return plugins


# ---- before training, and on signals --------------------------------------------------------


def check_writable(directory: Path) -> None:
    """Create ``directory`` and a file in it, or raise ``CheckpointError`` naming it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-"):
            pass
    except OSError as err:
        raise CheckpointError(
            f"Checkpoint directory {directory} is not writable ({err}). Fix its permissions or "
            "set the checkpoint callback's dirpath (or trainer.default_root_dir) to a "
            "writable directory."
        ) from err


class CheckpointGuard(Callback):
    """Makes checkpoints trustworthy around a ``fit``.

    Before training: every checkpoint directory must be writable. During training, SIGINT and
    SIGTERM stop the run at once unless the weights are being updated or a checkpoint file is
    being written; then the stop waits for the update (or the write) to end and is taken at the
    next step's start (a second signal stops at once; an interrupted update is then not
    saved). The stop raises ``TrainingStopped`` (exit code ``128 + signum``), so the
    on-exception checkpoints hold the state at the end of a completed step.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._pending: int | None = None
        self._stopping = False
        self._module: Any = None
        self._io: Any = None
        self._locks: list[RunLock] = []

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a fixed dirpath is known here, before a checkpoint is restored
            self._claim(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._claim(trainer)  # the directories Lightning resolved in its own setup

    def _claim(self, trainer: pl.Trainer) -> None:
        """Check each checkpoint directory is writable; on the rank that writes checkpoints,
        lock it for this run and remove what killed runs left in it."""
        held = {lock.path.parent for lock in self._locks}
        for directory in checkpoint_dirs(trainer):
            if directory in held:
                continue
            check_writable(directory)
            if trainer.is_global_zero:
                self._locks.append(RunLock.acquire(directory))
                tidy(directory)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._module, self._pending, self._stopping = pl_module, None, False
        self._io = trainer.strategy.checkpoint_io
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum)
        if signum == signal.SIGTERM and callable(previous):
            previous(signum, frame)  # Lightning's notifier (forwards to DDP children)
        name = signal.Signals(signum).name
        if self._stopping:
            log.warning("%s received again while saving; the previous checkpoint stays.", name)
            return
        if self._pending is not None:
            log.warning("%s received again: stopping now; this step will not be saved.", name)
            self._stopping = True
            raise TrainingStopped(signum, forced=True)
        if getattr(self._module, "updating_weights", False):
            during = "the weight update"
        elif getattr(self._io, "writing", False):
            during = "a checkpoint write"
        else:
            self._stop(signum)
            return
        self._pending = signum
        log.warning(
            "%s received during %s: stopping when it ends. Send it again to stop now without "
            "saving this step.",
            name,
            during,
        )

    def _stop(self, signum: int) -> None:
        self._stopping = True
        log.warning(
            "%s received: stopping with exit code %d after the on-exception checkpoints.",
            signal.Signals(signum).name,
            128 + signum,
        )
        raise TrainingStopped(signum)

    def _stop_if_pending(self) -> None:
        if self._pending is not None and not self._stopping:
            self._stop(self._pending)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._stop_if_pending()

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_if_pending()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_if_pending()
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # Lightning calls no callback's teardown after an exception. The on-exception
        # checkpoints are written after this hook (checkpoint callbacks run last), within
        # milliseconds; a run started in that window could meet one of them.
        self._restore()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    def _restore(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks = []
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}


def with_guard(callbacks: list[Callback]) -> list[Callback]:
    """``callbacks`` plus a ``CheckpointGuard`` unless one is already there."""
    if any(isinstance(cb, CheckpointGuard) for cb in callbacks):
        return callbacks
    return [*callbacks, CheckpointGuard()]
