"""Weight-sync integrity: every push of the policy's weights carries its version and a cheap
fingerprint, and the generator checks the weights it is about to sample with against it.

The fingerprint of a parameter is ``sum_i (i + 1) * x[i * stride]`` over ``SAMPLES`` elements
evenly spread through the flattened tensor, in float64: about ``64 * n_params`` reads, well
under a millisecond for a 135M-parameter model. It catches an engine that was never reloaded
(after any optimiser step almost every element moves), a load that missed parameters or
loaded them into the wrong names or order (a swap changes the position weights), and weights
changed after the push without a new version (a callback or a look-ahead that did not put them
back). It misses a change confined to the elements it does not read: sparse updates, e.g. the
embedding rows of tokens never seen, or a corruption of a few elements between the samples.
``SAMPLES`` = 64 is this project's choice.

An engine with its own copy in its own layout (vLLM fuses ``q/k/v_proj`` into ``qkv_proj`` and
``gate/up_proj`` into ``gate_up_proj``, and may hold bf16) is checked with
:func:`module_sums` instead: per module (a parameter's name less its last two parts, e.g.
``model.layers.3.self_attn``), the sum and the sum of squares of every element, in float64, of
the policy's weights cast to the engine's dtype, against the same sums read back from the
engine. Sums do not depend on how a module's tensors are split, named, ordered or packed, so
both layouts agree (to float64 rounding, compared within ``REL_TOL``). They catch a stale or
partly loaded engine and weights changed after the push; they miss tensors of one module loaded
in each other's place (``q_proj`` into ``k``'s rows), which the position-weighted prints catch.
Only modules the engine can show are compared: vLLM's CPU backend repacks linear layers for
oneDNN and leaves their parameters empty, so there the embeddings and norms are checked (they
move with every update, so a stale engine is still caught; a load that missed only linear
layers is not).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

SAMPLES = 64
REL_TOL = 1e-9  # module sums of the same values in another order differ by ~1e-16 relative


class WeightSyncError(RuntimeError):
    """The weights about to generate are not those of the version pushed last."""


def fingerprint(named: Iterable[tuple[str, torch.Tensor]], samples: int = SAMPLES) -> dict:
    """``{name: float}``: the position-weighted sum of ``samples`` strided elements of each
    tensor (all of a smaller one), in float64."""
    out: dict[str, float] = {}
    for name, tensor in named:
        flat = tensor.detach().reshape(-1)  # [numel]
        stride = max(flat.numel() // samples, 1)
        picked = flat[::stride][:samples].double()  # [<= samples]
        weights = torch.arange(1, picked.numel() + 1, dtype=torch.float64, device=picked.device)
        out[name] = float((picked * weights).sum())
    return out


def module_sums(
    named: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None = None,
    only: Iterable[str] | None = None,
) -> dict:
    """``{module: [sum, sum of squares]}`` of every element of the tensors ``named`` (each
    counted once however many names it has), cast to ``dtype`` first, in float64. A module
    with an empty tensor is left out (vLLM's CPU backend repacks linear layers and leaves their
    parameters empty: they cannot be read back); ``only``: these modules alone."""
    out: dict[str, list[float]] = {}
    empty: set[str] = set()
    seen: set[int] = set()
    for name, tensor in named:
        module = name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
        if tensor.numel() == 0:
            empty.add(module)
        if tensor.numel() == 0 or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        values = tensor.detach().to(dtype or tensor.dtype).double()
        sums = out.setdefault(module, [0.0, 0.0])
        sums[0] += float(values.sum())
        sums[1] += float(values.square().sum())
    keep = set(out) - empty if only is None else set(only)
    return {k: v for k, v in out.items() if k in keep}


def _same(a: dict, b: dict) -> bool:
    """Prints equal: exactly, or (module sums) within ``REL_TOL`` of the larger magnitude."""
    if a.keys() != b.keys():
        return False
    return all(_close(a[k], b[k]) for k in a)


def _close(x: object, y: object) -> bool:
    if isinstance(x, list | tuple) and isinstance(y, list | tuple):
        return len(x) == len(y) and all(_close(u, v) for u, v in zip(x, y, strict=True))
    if isinstance(x, float) and isinstance(y, float):
        return x == y or abs(x - y) <= REL_TOL * max(abs(x), abs(y))
    return x == y


@dataclass(frozen=True)
class Push:
    """One push of the policy's weights: its version and fingerprint."""

    version: int
    prints: dict


class WeightSync:
    """The last ``keep`` pushes, so a mismatch names the version the weights do match."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.pushes: OrderedDict[int, Push] = OrderedDict()

    @property
    def version(self) -> int:
        """The version pushed last (0 before any push)."""
        return next(reversed(self.pushes)) if self.pushes else 0

    def push(
        self,
        version: int,
        named: Iterable[tuple[str, torch.Tensor]] = (),
        prints: dict | None = None,
    ) -> Push:
        """Record that the weights ``named`` (or their ready ``prints``) are now ``version``."""
        if self.pushes and version <= self.version:
            raise WeightSyncError(
                f"Policy version {version} pushed after version {self.version}: versions only "
                "grow, one per update."
            )
        pushed = Push(version, fingerprint(named) if prints is None else prints)
        self.pushes[version] = pushed
        while len(self.pushes) > self.keep:
            self.pushes.popitem(last=False)
        return pushed

    def check(
        self, named: Iterable[tuple[str, torch.Tensor]] = (), prints: dict | None = None
    ) -> int:
        """The version the weights ``named`` (or their ``prints``) hold; raises when it is not
        the last pushed."""
        if not self.pushes:
            raise WeightSyncError("No weights were pushed yet: push version 0 before generating.")
        expected = self.pushes[self.version]
        prints = fingerprint(named) if prints is None else prints
        if _same(prints, expected.prints):
            return expected.version
        held = [p.version for p in self.pushes.values() if _same(p.prints, prints)]
        differ = sorted(k for k in expected.prints if not _close(prints.get(k), expected.prints[k]))
        what = f"version {held[-1]}'s" if held else "weights of no version pushed recently"
        raise WeightSyncError(
            f"The generator holds {what}, but version {expected.version} was pushed last "
            f"({len(differ)} of {len(expected.prints)} parameters differ, e.g. "
            f"{(differ or sorted(set(prints) ^ set(expected.prints)) or ['?'])[0]}). Its samples "
            "would be tagged with the wrong version: reload the engine's weights after each "
            "update, and change the policy's weights only inside the update."
        )

    def state_dict(self) -> dict:
        return {"keep": self.keep, "pushes": [[p.version, p.prints] for p in self.pushes.values()]}

    def load_state_dict(self, state: dict) -> None:
        self.keep = state["keep"]
        self.pushes = OrderedDict((v, Push(v, prints)) for v, prints in state["pushes"])
