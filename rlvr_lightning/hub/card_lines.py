"""The model card's recipe lines: the hardware (with its fast paths), the multi-turn set-up."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch


def multiturn_line(group: Mapping[str, Any] | None) -> str | None:
    """The card's multi-turn line (tools, environment, turns), None for single-turn runs."""
    group = dict(group or {})
    tools = [_callable_name(t) for t in group.get("tools") or []]
    env = group.get("environment")
    turns = int(group.get("max_turns") or 1)
    if not tools and env is None and turns <= 1:
        return None
    parts = [f"up to {turns} model turns per trajectory"]
    if tools:
        parts.append("tools: " + ", ".join(f"`{t}`" for t in tools))
    if env is not None:
        parts.append(f"environment: `{_callable_name(env)}`")
    return "; ".join(parts)


def _callable_name(value: Any) -> str:
    if isinstance(value, str):
        return value.rsplit(".", 1)[-1]
    return getattr(value, "__qualname__", None) or type(value).__name__


def hardware_line(trainer: pl.Trainer) -> str:
    """Devices, precision and (on a CPU) the fast paths chosen by measurement."""
    device = trainer.strategy.root_device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    count = trainer.num_devices * trainer.num_nodes
    line = f"{count} x {name}, precision {trainer.precision}"
    if device.type == "cpu":  # which kernels ran: chosen by measurement on this CPU
        from rlvr_lightning.device import fast_path_summary  # here: the card module stays light

        line += f", fast paths: {fast_path_summary()}"
    return line
