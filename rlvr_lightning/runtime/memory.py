"""How much memory the trainer holds, and how much it may hold before the kernel kills it.

The limit is the smallest ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1) on the
path from this process's cgroup to the root, where one is set, else ``MemTotal``; the use is
the process's resident set (``/proc/self/statm``). Linux only: elsewhere both are unknown and
``callbacks.MemoryGuard`` does nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages, ~2**63).
UNLIMITED_V1 = 2**60


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def resident_bytes() -> int | None:
    """This process's resident set size in bytes (None off Linux)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    value = int(text)
    return value if value < UNLIMITED_V1 else None


def cgroup_limits(cgroup_file: Path, root: Path = CGROUP_ROOT) -> list[tuple[int, Path]]:
    """``(bytes, file)`` for every memory limit set on the path from the cgroups named in
    ``cgroup_file`` (``/proc/self/cgroup`` format) up to ``root``."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        directory = base / rel.lstrip("/")
        while True:
            limit = _read_limit(directory / name)
            if limit is not None:
                found.append((limit, directory / name))
            if directory == base or base not in directory.parents:
                break
            directory = directory.parent
    return found


def mem_total(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """``MemTotal`` in bytes."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def machine_limit() -> tuple[int, str] | None:
    """The memory this process may use and where that number comes from; None: unknown."""
    limits = cgroup_limits(Path("/proc/self/cgroup"))
    total = mem_total()
    candidates = [(n, f"cgroup limit {path}") for n, path in limits]
    if total is not None:
        candidates.append((total, "MemTotal of the machine"))
    return min(candidates, default=None)


def knobs(module: Any, datamodule: Any) -> str:
    """The settings that size the trainer's memory, with their values, for a message."""
    sampling = getattr(module, "sampling", None)
    update = getattr(getattr(module, "options", None), "update", None)
    return (
        f"model.init_args.update.micro_batch_size ({getattr(update, 'micro_batch_size', '?')}), "
        f"sampling.max_new_tokens ({getattr(sampling, 'max_new_tokens', '?')}) or "
        f"data.init_args.max_prompt_tokens ({getattr(datamodule, 'max_prompt_tokens', '?')})"
    )
