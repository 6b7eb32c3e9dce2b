"""Which checkpoint files on disk can be trusted, and which one to resume from.

"Newest good" means the highest ``global_step`` among the files ``torch.load`` can open (ties:
the later modification time), not the newest modification time: ``cp -r`` or a restore from a
backup gives every file a new time. ``ckpt_path=last`` resolves the same way over the
``last*.ckpt`` files, and falls back to the newest good checkpoint of the directory when every
``last*.ckpt`` is unreadable. ``tidy`` runs once a run holds its directory: it removes the
temporary files a kill mid-write leaves and sets an unreadable ``last*.ckpt`` aside, so the run
writes ``last.ckpt`` again instead of ``last-v1.ckpt`` beside the broken one.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

log = logging.getLogger(__name__)

# Set by `RLVRModule.on_save_checkpoint` on a checkpoint that must not be written (or loaded).
UNSAFE_KEY = "rlvr_unsafe"
# `AtomicCheckpointIO`'s temporary files (`.<name>.<random>.tmp`) and `check_writable`'s probes.
LEFTOVER_PATTERNS = (".*.ckpt.*.tmp", ".write-test-*")
# Lightning's `save_last` names: last.ckpt, last-v1.ckpt, ...
LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")
BROKEN_SUFFIX = ".unreadable"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which file to use."""


def checkpoint_dirs(trainer: pl.Trainer) -> list[Path]:
    """Directories the trainer's checkpoint callbacks write to (resolved after ``setup``)."""
    dirs = []
    for cb in trainer.callbacks:
        if isinstance(cb, ModelCheckpoint | OnExceptionCheckpoint) and cb.dirpath:
            dirs.append(Path(cb.dirpath))
    return list(dict.fromkeys(dirs))


def checkpoint_step(path: Path) -> int | None:
    """The ``global_step`` of a loadable checkpoint at ``path``; None when it is unreadable,
    empty, truncated or marked unusable (tensors are not read: mmap)."""
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception:
        return None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or UNSAFE_KEY in ckpt:
        return None
    return int(ckpt.get("global_step", 0))


def readable(path: Path) -> bool:
    """Whether ``path`` is a checkpoint ``torch.load`` can open and that was not refused."""
    return checkpoint_step(path) is not None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def best_of(files: Iterable[Path]) -> Path | None:
    """The loadable file among ``files`` with the highest global step (ties: newest mtime)."""
    steps = {p: checkpoint_step(p) for p in dict.fromkeys(files)}
    good = [p for p, step in steps.items() if step is not None]
    return max(good, key=lambda p: (steps[p], _mtime(p)), default=None)


def _ckpt_files(dirs: Iterable[Path]) -> set[Path]:
    return {p.resolve() for d in dirs if d.is_dir() for p in d.glob("*.ckpt") if p.is_file()}


def newest_good(dirs: Iterable[Path], exclude: Path | None = None) -> Path | None:
    """The loadable ``*.ckpt`` in ``dirs`` (other than ``exclude``) with the highest step."""
    files = _ckpt_files(dirs)
    files.discard(exclude.resolve() if exclude else None)
    return best_of(files)


def describe_newest(dirs: Iterable[Path], exclude: Path | None = None) -> str:
    good = newest_good(dirs, exclude)
    return f"the newest good checkpoint is {good}" if good else "no good checkpoint was found"


def check_loadable(path: str | Path) -> None:
    """Raise ``CheckpointError`` naming ``path`` and the newest good sibling if it is unreadable."""
    path = Path(path)
    if path.is_file() and not readable(path):
        size = path.stat().st_size
        raise CheckpointError(
            f"Checkpoint {path} ({size} bytes) is empty, truncated or was refused when written; "
            f"{describe_newest([path.parent], exclude=path)} (pass it with --ckpt_path)."
        )


def resolve_last(trainer: pl.Trainer) -> str | None:
    """What ``ckpt_path="last"`` resumes from: the ``last*.ckpt`` of the trainer's checkpoint
    callbacks with the highest step; when all are unreadable, the newest good checkpoint in
    their directories (with a warning); None when there is no ``last*.ckpt`` at all."""
    found: set[Path] = set()
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            found |= {Path(p) for p in callback._find_last_checkpoints(trainer)}
    found = {p for p in found if p.is_file()}
    if not found:
        return None
    best = best_of(found)
    if best is None:
        best = newest_good({p.parent for p in found})
        names = ", ".join(sorted(str(p) for p in found))
        if best is None:
            raise CheckpointError(
                f"ckpt_path=last: {names} cannot be read and no other good checkpoint was found "
                "beside it; start without --ckpt_path (from step 0) or pass a good file."
            )
        log.warning("ckpt_path=last: %s cannot be read; resuming from %s.", names, best)
    return str(best)


def tidy(directory: Path) -> None:
    """Remove leftover temporary files in ``directory`` and set unreadable ``last*.ckpt`` aside
    (renamed to ``<name>.unreadable``: the bytes are kept). Call it only while holding the
    directory's run lock: another run's temporary file would be in the middle of a write."""
    removed = []
    for pattern in LEFTOVER_PATTERNS:
        for path in directory.glob(pattern):
            try:
                path.unlink()
                removed.append(path.name)
            except OSError as err:
                log.warning("Could not remove the leftover temporary file %s: %s", path, err)
    if removed:
        log.info("Removed %d leftover temporary file(s) in %s.", len(removed), directory)
    for path in sorted(directory.glob("last*.ckpt")):
        if LAST_NAME.match(path.name) and path.is_file() and not readable(path):
            aside = path.with_name(path.name + BROKEN_SUFFIX)
            os.replace(path, aside)
            log.warning(
                "%s (%d bytes) cannot be read; moved it to %s so this run writes %s again. %s.",
                path,
                aside.stat().st_size,
                aside.name,
                path.name,
                describe_newest([directory]).capitalize(),
            )
