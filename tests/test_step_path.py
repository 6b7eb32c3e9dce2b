"""A batch's path through ``RLVRModule.training_step``: the package files it enters and the
calls that climb back up a layer (a lower unit calling into a higher one).

Every call event between two frames of the package is traced (``sys.setprofile``); the caller
is the nearest package frame below the callee, so a call that passes through Lightning or
torch still counts. Run as a script to print the path:
``.venv/bin/python tests/test_step_path.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_architecture import LAYER  # noqa: E402

from rlvr_lightning.data import RLVRDataModule  # noqa: E402
from rlvr_lightning.testing import quiet_trainer, tiny_module  # noqa: E402

FOLDERS = {ROOT / "rlvr_lightning": "rlvr_lightning", ROOT / "callbacks": "callbacks"}


def _unit(filename: str) -> tuple[str, str] | None:
    """``(file relative to the repository, unit)`` of a package file, else None."""
    path = Path(filename)
    for folder, name in FOLDERS.items():
        if path.is_relative_to(folder):
            rel = path.relative_to(folder)
            if name == "callbacks":
                return f"callbacks/{rel}", "callbacks"
            unit = rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 else rel.stem
            unit = "face" if unit == "__init__" else unit
            return f"rlvr_lightning/{rel}", unit
    return None


def _package_caller(frame) -> tuple[str, str] | None:
    frame = frame.f_back
    while frame is not None:
        if (where := _unit(frame.f_code.co_filename)) is not None:
            return where
        frame = frame.f_back
    return None


def trace_steps(steps: int = 2) -> tuple[list[str], list[tuple[str, str]]]:
    """Fit the tiny module for ``steps`` steps and trace the last ``training_step``: the files
    entered in order (consecutive calls in one file merged) and the climbs
    ``(caller file, callee file)``."""
    stays: list[str] = []
    climbs: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or (callee := _unit(frame.f_code.co_filename)) is None:
            return
        if not stays or stays[-1] != callee[0]:
            stays.append(callee[0])
        caller = _package_caller(frame)
        if caller is not None and LAYER[callee[1]] > LAYER[caller[1]]:
            climbs.append((caller[0], callee[0]))

    torch.manual_seed(0)
    module = tiny_module()
    step = module.training_step

    def traced(batch, batch_idx):
        stays.clear()
        climbs.clear()
        sys.setprofile(profile)
        try:
            return step(batch, batch_idx)
        finally:
            sys.setprofile(None)

    module.training_step = traced
    data = RLVRDataModule(train_size=8, val_size=2, prompts_per_step=2)
    quiet_trainer(max_steps=steps).fit(module, datamodule=data)
    return stays, climbs


def test_a_step_climbs_back_at_most_three_times():
    stays, climbs = trace_steps()
    assert stays[0] == "rlvr_lightning/module.py"
    assert len(climbs) <= 3, climbs


if __name__ == "__main__":
    stays, climbs = trace_steps()
    files = list(dict.fromkeys(stays))
    print(f"{len(files)} files entered in {len(stays)} stays; {len(climbs)} climbs back up")
    print(" -> ".join(stays))
    for caller, callee in climbs:
        print(f"climb: {caller} -> {callee}")
