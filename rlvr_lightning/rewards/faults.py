r"""Reward functions that misbehave on purpose, to test and measure isolation and timeouts.

They are defined at module level and marked with ``run_in_process`` so that worker processes can
import them; ``RewardCombiner(isolate=False)`` runs them in threads instead (the old behaviour).
Each announces itself on stderr (``rlvr_lightning.rewards.faults.<name> started in process
<pid>``) so that a test driving the CLI knows when the reward is running. Use them in YAML, e.g.
``rewards: {functions: [rlvr_lightning.rewards.faults.hang]}``.
"""

from __future__ import annotations

import os
import sys
import time

from rlvr_lightning.rewards.isolation import run_in_process
from rlvr_lightning.rewards.math import boxed_accuracy

POWER_TOWER = r"\boxed{9^{9^{9}}}"  # sympy evaluates 9**387420489 when comparing it
# Not a plain number, so the comparison reaches math-verify: against a plain "3" the unevaluated
# power is refused at once (``rewards.math.unevaluated``).
POWER_TOWER_GOLD = r"\sqrt{9}"


def _announce(name: str) -> None:
    print(f"rlvr_lightning.rewards.faults.{name} started in process {os.getpid()}", file=sys.stderr)
    sys.stderr.flush()


@run_in_process
def hang(completions: list[str], **_: object) -> list[float]:
    """Sleeps forever (releasing the GIL)."""
    _announce("hang")
    while True:
        time.sleep(1.0)


@run_in_process
def spin(completions: list[str], **_: object) -> list[float]:
    """Busy-loops forever in Python on a batch holding the completion ``"spin"``, else 1.0."""
    if "spin" not in completions:
        return [1.0] * len(completions)
    _announce("spin")
    while True:
        pass


@run_in_process
def power_tower(completions: list[str], **_: object) -> list[float | None]:
    r"""``boxed_accuracy`` of ``\boxed{9^{9^{9}}}`` against the gold ``\sqrt{9}``, every row."""
    _announce("power_tower")
    n = len(completions)
    return boxed_accuracy([POWER_TOWER] * n, answer=[POWER_TOWER_GOLD] * n)


@run_in_process
def worker_pid(completions: list[str], **_: object) -> list[float]:
    """The id of the process it runs in (exact in float32 below 2**24), for every row."""
    return [float(os.getpid())] * len(completions)


@run_in_process
def nan_values(completions: list[str], **_: object) -> list[float]:
    """NaN for every row."""
    return [float("nan")] * len(completions)


@run_in_process
def crash(completions: list[str], **_: object) -> list[float]:
    """Ends its process at once with exit code 3, as a segfaulting extension would."""
    os._exit(3)


@run_in_process
def allocate_gigabytes(completions: list[str], **_: object) -> list[float]:
    """Asks for 6 GiB at once (a reward holding memory without bound): under the workers'
    address-space budget the allocation fails at once, without touching a page."""
    block = bytearray(6 << 30)
    return [float(len(block) > 0)] * len(completions)
