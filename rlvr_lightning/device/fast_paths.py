"""Which CPU fast path runs, chosen by measurement on the model's own shapes, once per machine.

A kernel module registers a *path* (``"linear"``, ``"attention"``, ``"attention.decode"``) with
its reference candidate (what torch/transformers would run) and a measurer that builds the
candidates' work on a model's shapes (:class:`Trial`). The first time a path is asked for in a
dtype (:func:`choice`), every candidate runs on the same random operands; a candidate is kept
only when its values agree with the reference's (largest difference relative to the largest
reference value, ``Trial.tolerance``) and it is at least ``MIN_GAIN`` faster (best of ``REPS``
timed runs after one untimed run); otherwise the reference stays. Nothing is chosen by vendor
name or CPU flag. Paths are asked for lazily, in the dtype the run computes in, so a bf16 run
never times fp32 products (and the reverse).

The decision is cached as JSON in ``$RLVR_LIGHTNING_CACHE/fast_paths.json`` (the embedded
model's cache folder, default ``~/.cache/rlvr-lightning``) under a key of the CPU model and
flags, torch, MKL and oneDNN versions, thread count, path, dtype and shapes: another machine,
library or model measures again. ``RLVR_FAST_PATHS=reference`` turns every choice off (the
reference paths, nothing measured or read), for runs that must reproduce exactly: a chosen fast
path sums in another floating-point order, so two machines (or one machine before and after a
library update) may take different paths and get results that differ in the last bits.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import platform
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

ENV = "RLVR_FAST_PATHS"
MODES = ("measure", "reference")
CACHE_ENV = "RLVR_LIGHTNING_CACHE"  # the same folder as models.embedded.cache_dir()
CACHE_FILE = "fast_paths.json"

# A candidate replaces the reference only when it is at least this much faster: timings on a
# shared machine jitter by a few percent, and a tie should keep torch's own path (this
# project's choice).
MIN_GAIN = 0.05
REPS = 2  # timed runs per candidate (the best counts), after one untimed run
# Short pieces run more often, up to MAX_REPS, until each candidate had this much time: a
# sub-millisecond kernel timed twice on a shared machine can lose both runs to a stall.
PIECE_SECONDS, MAX_REPS = 0.01, 25
# Timings whose median run is over this many times the best are not cached: a busy machine
# (other processes taking the cores) stalls small kernels by 10-100x (this project's choice).
STEADY_RATIO = 2.0
# Load average (beyond the cores this process's threads leave free) over which a measurement
# is used for the run but not cached (``busy_cores``; this project's choice).
BUSY_SLACK = 0.75
FORMAT = 1  # part of the cache key: bump when a measurer changes what it times


@dataclass(frozen=True)
class ModelShapes:
    """What the measurers need of a model: its linear layers' ``(in, out, count)`` (LM head
    excluded) and its attention heads."""

    linears: tuple[tuple[int, int, int], ...]
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: nn.Module) -> ModelShapes | None:
        """The shapes of a transformers decoder (None when its config lacks attention sizes)."""
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(heads, int) or not isinstance(hidden, int):
            return None
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        sizes = Counter(
            (m.in_features, m.out_features)
            for m in model.modules()
            if type(m) is nn.Linear and m is not head
        )
        return cls(
            linears=tuple(sorted((i, o, n) for (i, o), n in sizes.items())),
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or hidden // heads,
        )


Work = Callable[[], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Trial:
    """A path's work on one model's shapes: ``pieces`` of ``(weight, {candidate: work})``, each
    piece's time counted ``weight`` times (e.g. once per layer of that shape)."""

    tolerance: float
    pieces: list[tuple[float, dict[str, Work]]]


Measurer = Callable[[ModelShapes, torch.dtype], Trial]


@dataclass(frozen=True)
class Decision:
    """A path's choice, its reference, each candidate's weighted seconds and relative error,
    and how it was made (``measured in 0.21 s``, ``cached``, ``RLVR_FAST_PATHS=reference``)."""

    choice: str
    reference: str
    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    source: str = ""


_registry: dict[str, tuple[str, Measurer]] = {}
_state: dict[str, object] = {"shapes": None}
_made: dict[str, Decision] = {}
_forced: dict[str, str] = {}


def register(path: str, reference: str, measurer: Measurer) -> None:
    """Make ``path`` choosable: ``reference`` names the candidate kept unless another wins."""
    _registry[path] = (reference, measurer)


def use_shapes(shapes: ModelShapes | None) -> None:
    """Measure paths not yet chosen on these shapes (``prepare_model`` passes its model's; the
    choices made stay for the process)."""
    if shapes is not None:
        _state["shapes"] = shapes


def select(
    reference: str,
    seconds: Mapping[str, float],
    errors: Mapping[str, float],
    tolerance: float,
    min_gain: float = MIN_GAIN,
) -> str:
    """The fastest candidate whose values agree with the reference's (``error <= tolerance``)
    and that beats the reference's time by ``min_gain``; else ``reference``."""
    best = reference
    bar = seconds[reference] * (1 - min_gain)
    for name, spent in seconds.items():
        if name != reference and errors[name] <= tolerance and spent < bar:
            best, bar = name, spent
    return best


def _key(path: str, dtype: torch.dtype) -> str:
    return f"{path}/{str(dtype).removeprefix('torch.')}"


def choice(path: str, dtype: torch.dtype) -> str:
    """The candidate that runs ``path`` in ``dtype``: decided (measured, or read from the
    cache) on the first call, logged once, then fixed for the process."""
    key = _key(path, dtype)
    if key in _forced:
        return _forced[key]
    made = _made.get(key)
    if made is None:
        made = _made[key] = _decide(path, dtype)
        _log(key, made)
    return made.choice


def chosen() -> dict[str, Decision]:
    """The decisions made so far in this process, by ``path/dtype``."""
    return dict(_made)


def summary() -> str:
    """One line for logs and model cards, e.g. ``linear/float32 onednn (measured)``."""
    if not _made:
        return "none chosen"

    def how(source: str) -> str:
        flags = [flag for flag in ("unsteady", "busy") if flag in source]
        return ", ".join([source.split(" in ")[0], *flags])

    return ", ".join(f"{key} {d.choice} ({how(d.source)})" for key, d in _made.items())


@contextmanager
def forced(paths: Mapping[str, str]) -> Iterator[None]:
    """Within: ``choice`` answers ``paths`` (``{"linear/float32": "onednn"}``) without
    measuring; for tests and benchmarks that need one path whatever this machine prefers."""
    saved = dict(_forced)
    _forced.update(paths)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def mode() -> str:
    """``$RLVR_FAST_PATHS``: ``measure`` (default) or ``reference``."""
    value = os.environ.get(ENV, "measure").strip().lower() or "measure"
    if value not in MODES:
        raise ValueError(
            f"{ENV}={value!r} is not a mode; use {ENV}=measure (choose fast paths by measuring, "
            f"the default) or {ENV}=reference (torch's own paths, for exact reproduction)."
        )
    return value


def _decide(path: str, dtype: torch.dtype) -> Decision:
    reference, measurer = _registry[path]
    if mode() == "reference":
        return Decision(reference, reference, source=f"{ENV}=reference")
    shapes = _state["shapes"]
    if not isinstance(shapes, ModelShapes):
        return Decision(reference, reference, source="no model prepared")
    key = cache_key(path, dtype, shapes)
    entry = read_cache().get(key)
    if entry is not None:
        return Decision(**{**entry, "source": "cached"})
    start = time.perf_counter()
    try:
        # First asked inside validation's inference mode, a trial's tensors would be inference
        # tensors, which a forward-and-backward trial cannot use (the attention trial failed
        # so, and SDPA was kept without a measurement, on every fresh machine).
        with torch.inference_mode(False), torch.enable_grad():
            trial = measurer(shapes, dtype)
        if not trial.pieces:
            return Decision(reference, reference, source="nothing to measure")
        seconds, errors, steady = run_trial(trial, reference)
    except (RuntimeError, NotImplementedError) as err:  # a kernel this build or CPU lacks
        return Decision(reference, reference, source=f"measurement failed ({err}): not cached")
    picked = select(reference, seconds, errors, trial.tolerance)
    cost = time.perf_counter() - start
    made = Decision(picked, reference, seconds, errors, f"measured in {cost:.2f} s")
    if not steady:  # e.g. a busy machine: this run uses it, the next one measures again
        return dataclasses.replace(made, source=made.source + ", unsteady: not cached")
    if (busy := busy_cores()) is not None:
        return dataclasses.replace(made, source=made.source + f", {busy}: not cached")
    write_cache(key, made)
    return made


def busy_cores() -> str | None:
    """Why the machine was too busy for a measurement to stand for it, else None: more
    runnable threads over the last minute (load average) than the cores this process's
    threads leave to others, plus ``BUSY_SLACK``. Measured so, bf16 at 2 threads came out
    1.9x slower than fp32 on a CPU where it is 1.8x faster when quiet (issue 40), steadily
    enough to pass the steadiness check, and the cache kept it for every later run."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cores - torch.get_num_threads() + BUSY_SLACK:
        return None
    return f"busy machine (load average {load:.1f} on {cores} cores)"


def timer(work: Work, name: str) -> float:
    """Seconds one run of candidate ``name``'s ``work`` takes (tests give mock timings)."""
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def run_trial(trial: Trial, reference: str) -> tuple[dict[str, float], dict[str, float], bool]:
    """Each candidate's weighted time, its largest relative difference from ``reference``, and
    whether the timings were steady (every candidate's median run within ``STEADY_RATIO`` of
    its best, in every piece)."""
    names = list(trial.pieces[0][1])
    seconds, errors = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    steady = True
    with torch.inference_mode(False), torch.autocast("cpu", enabled=False):
        for weight, works in trial.pieces:
            outputs = {name: work() for name, work in works.items()}  # untimed first run
            for name in names:
                errors[name] = max(errors[name], _difference(outputs[name], outputs[reference]))
            for name, runs in _timed_runs(works).items():
                seconds[name] += weight * min(runs)
                steady = steady and statistics.median(runs) <= STEADY_RATIO * min(runs)
    return seconds, errors, steady


def _timed_runs(works: Mapping[str, Work]) -> dict[str, list[float]]:
    """Each candidate's timed runs; candidates alternate, in turned order every other rep."""
    names = list(works)
    runs: dict[str, list[float]] = {name: [] for name in names}
    rep = 0
    while rep < REPS or (rep < MAX_REPS and min(map(sum, runs.values())) < PIECE_SECONDS):
        for name in names if rep % 2 == 0 else names[::-1]:
            runs[name].append(timer(works[name], name))
        rep += 1
    return runs


def _difference(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        scale = float(w.detach().abs().max().float()) or 1.0
        diff = float((g.detach().float() - w.detach().float()).abs().max()) / scale
        worst = max(worst, diff if diff == diff else float("inf"))  # NaN: never agrees
    return worst


# ---- the cache ---------------------------------------------------------------------------------


def cache_file() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "rlvr-lightning")) / CACHE_FILE


@functools.cache
def machine() -> dict[str, str]:
    """The CPU model string, a digest of its flags, and the math libraries torch was built with."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    for name, pattern in (("model", r"^model name\s*:\s*(.+)$"), ("flags", r"^flags\s*:\s*(.+)$")):
        found = re.search(pattern, info, re.MULTILINE)
        if found and name == "model":
            model = found.group(1).strip()
        elif found:
            flags = hashlib.sha1(found.group(1).encode()).hexdigest()[:12]
    config = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version (\S+)", config)
    dnn = re.search(r"MKL-DNN v(\S+)", config)
    return {
        "cpu": model,
        "cpu_flags": flags,
        "torch": torch.__version__,
        "mkl": mkl.group(1) if mkl else "none",
        "onednn": dnn.group(1) if dnn else "none",
    }


def cache_key(path: str, dtype: torch.dtype, shapes: ModelShapes) -> str:
    parts = {
        **machine(),
        "threads": torch.get_num_threads(),
        "format": FORMAT,
        "path": _key(path, dtype),
        "shapes": asdict(shapes),
    }
    return json.dumps(parts, sort_keys=True)


def read_cache() -> dict[str, dict]:
    """The cached decisions (an unreadable file counts as empty: it is measured again)."""
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_cache(key: str, made: Decision) -> None:
    """Add one decision; written to a temporary file and renamed, so readers never see half."""
    target = cache_file()
    data = read_cache()
    entry = asdict(made)
    entry.pop("source")
    data[key] = entry
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(data, indent=1))
        os.replace(scratch, target)
    except OSError:
        pass  # a read-only home measures again next time; the run itself is unaffected


def _log(key: str, made: Decision) -> None:
    from lightning.fabric.utilities.rank_zero import rank_zero_info

    times = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in made.seconds.items())
    rank_zero_info(f"rlvr-lightning fast path {key}: {made.choice} ({made.source}; {times})")


def reset() -> None:
    """Forget the decisions of this process (tests)."""
    _made.clear()
    _state["shapes"] = None
