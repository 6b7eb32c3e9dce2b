"""Shared by the benchmarks that train through the CLI: one fit in a subprocess, its metrics."""

from __future__ import annotations

import csv
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def fit(
    config: str, root: Path, overrides: list[str], threads: int | None = None
) -> tuple[dict[str, list[float]], float]:
    """``rlvr-lightning fit`` on ``configs/<config>`` with its logs under ``root``.

    Returns every logged metric as a series (rows without it skipped) and the wall time in
    seconds. ``threads`` sets OMP_NUM_THREADS for the run (None: inherited).
    """
    cmd = [
        sys.executable, "-m", "rlvr_lightning.cli.command", "fit",
        "--config", str(ROOT / "configs" / config),
        f"--trainer.default_root_dir={root}", f"--trainer.logger.init_args.save_dir={root}",
        *overrides,
    ]  # fmt: skip
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
    wall = time.perf_counter() - start
    for folder in root.rglob("checkpoints"):  # ~2.6 GB a save of the embedded model
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{config} {overrides} failed:\n{done.stderr[-3000:]}")
    return read_series(root), wall


def read_series(root: Path) -> dict[str, list[float]]:
    """Every column of the run's CSV log as the list of its non-empty values, in order."""
    rows = list(csv.DictReader(next(root.rglob("metrics.csv")).open()))
    series: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if value not in (None, ""):
                series.setdefault(key, []).append(float(value))
    return series


def mean_sd(values: list[float]) -> str:
    """``mean ± sd`` over runs (the value alone for one run)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"
