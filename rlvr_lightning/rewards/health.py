"""Counting what goes wrong in reward functions, and deciding when it must stop the run.

Occasional failures are part of scoring free text (a parser that raises on one odd row): they
score 0.0, are counted in ``reward/<name>/failures`` and warned about once. A function that
fails on every row of a batch, or on most rows over a window of batches, is broken (a column it
expects is absent, ``a in c`` on int answers): training on its zeros teaches nothing, so the run
stops with a ``RewardFailureError`` that names it, the last line of its first traceback and the
fix. NaN values under ``nan_policy="fail"`` are counted but never stop the run: the user asked
for them to score 0.
"""

from __future__ import annotations

import logging
import math
import re
from collections import deque

from rlvr_lightning.rewards.contract import RewardContractError

# The combiner's logger: one name shows or silences every warning about reward functions.
logger = logging.getLogger("rlvr_lightning.rewards.combine")

MIN_ROWS_FOR_ALL_FAILED = 2
"""A batch of one row that raises is not "every row" evidence (this project's choice): such
batches only count toward the window."""

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_FIX = (
    "Fix: make the function return 0.0 (or None where it does not apply) for rows it cannot "
    "score instead of raising, and check the columns it reads and their types (data.columns "
    "maps a column to the name it expects); model.init_args.rewards.max_failure_share: null only "
    "counts failures."
)


class RewardFailureError(RuntimeError):
    """A reward function failed on too many rows: it is broken, not unlucky."""


def last_line(error: str | None) -> str:
    """``Type: message`` of a formatted traceback, with the innermost frame it came from."""
    if not error:
        return "its worker process died"
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    frames = _FRAME.findall(error)
    where = ""
    if frames:
        path, line, function = frames[-1]
        where = f" (at {path.rsplit('/', 1)[-1]}:{line} in {function})"
    return f"{lines[-1]}{where}"


class RewardHealth:
    """Failure and timeout counts of each reward function, and the stop rules.

    Args:
        names: the reward functions' names.
        max_failure_share: stop when, over the last ``failure_window`` batches, more than this
            share of a function's rows failed or timed out, or when it raised on every row of
            one batch (of at least two rows); ``None`` only counts failures.
        failure_window: how many batches (calls of the combiner) the share is measured over;
            it is judged once that many have been scored.
    """

    def __init__(
        self, names: list[str], max_failure_share: float | None = 0.5, failure_window: int = 10
    ) -> None:
        if max_failure_share is not None and not 0.0 <= max_failure_share <= 1.0:
            raise ValueError(
                f"max_failure_share must be in [0, 1] (or None to only count failures); got "
                f"{max_failure_share}."
            )
        if failure_window < 1:
            raise ValueError(f"failure_window must be >= 1 batch; got {failure_window}.")
        self.max_failure_share = max_failure_share
        self.failures = dict.fromkeys(names, 0)
        self.timeouts = dict.fromkeys(names, 0)
        self._window = {name: deque[tuple[int, int]](maxlen=failure_window) for name in names}
        self._first_error: dict[str, str] = {}
        self._warned: set[tuple[str, str]] = set()

    def warn_once(self, name: str, kind: str, message: str, *args: object) -> None:
        if (name, kind) not in self._warned:
            self._warned.add((name, kind))
            logger.warning(message, name, *args)

    def record_rows(self, name: str, failed: int, rows: int, error: str | None) -> None:
        """Count ``failed`` of ``rows`` rows (raised or lost with their worker) and stop the run
        when the function is broken. ``error``: the first row's traceback (None: none, e.g. the
        worker died)."""
        self.failures[name] += failed
        if failed and name not in self._first_error:
            self._first_error[name] = last_line(error)
        if self.max_failure_share is not None:
            if error is not None and failed == rows >= MIN_ROWS_FOR_ALL_FAILED:
                self._stop(name, f"raised on all {rows} rows of a batch: {last_line(error)}", error)
            self._judge(name, failed, rows)
        if failed and error is not None:
            self.warn_once(
                name,
                "failure",
                "Reward function %r raised on %d row(s), which score 0.0; further failures are "
                "counted in reward/%s/failures without a warning. First error:\n%s",
                failed,
                name,
                error,
            )

    def _judge(self, name: str, lost: int, rows: int) -> None:
        """Add a batch to the window; stop when more than the share of its rows were lost."""
        assert self.max_failure_share is not None
        window = self._window[name]
        window.append((lost, rows))
        lost_total, rows_total = map(sum, zip(*window, strict=True))
        if len(window) == window.maxlen and lost_total > self.max_failure_share * rows_total:
            self._stop(
                name,
                f"failed or timed out on {lost_total} of {rows_total} rows over the last "
                f"{len(window)} batches (more than max_failure_share={self.max_failure_share}); "
                f"first error: {self._first_error.get(name, last_line(None))}",
            )

    def _stop(self, name: str, what: str, error: str | None = None) -> None:
        if error is not None:  # the summary keeps one line of it; the log keeps it all
            logger.error("Reward function %r stops the run; its first error:\n%s", name, error)
        raise RewardFailureError(f"Reward function {name!r} {what}.\n{_FIX}")

    def apply_nan_policy(
        self, name: str, values: list[float | None], policy: str
    ) -> list[float | None]:
        """``values`` with NaN and inf scored 0.0 and counted (``policy="fail"``), or raise
        ``RewardContractError`` on the first (``"error"``)."""
        bad = {i for i, v in enumerate(values) if v is not None and not math.isfinite(v)}
        if not bad:
            return values
        if policy == "error":
            raise RewardContractError(
                f"Reward function {name!r} returned {values[min(bad)]} for completion {min(bad)} "
                f"({len(bad)} of {len(values)} rows); expected a finite float, or None where it "
                "does not apply. nan_policy='fail' (RLVRModule: rewards.nan_policy) scores such "
                "rows 0.0 and counts them as failures instead."
            )
        self.failures[name] += len(bad)
        self.warn_once(
            name,
            "nan",
            "Reward function %r returned NaN or inf on %d row(s), which score 0.0 and count as "
            "failures (nan_policy='fail').",
            len(bad),
        )
        return [0.0 if i in bad else v for i, v in enumerate(values)]

    def record_timeout(self, name: str, timeout_s: float | None, fate: str, rows: int) -> None:
        """Count a call on ``rows`` rows that ran out of time; warn once, saying what became of
        it (``fate``). Its rows count toward the window's share: a function that times out on
        most batches is as broken as one that raises."""
        self.timeouts[name] += 1
        self._first_error.setdefault(name, f"ran past timeout_s={timeout_s}")
        self.warn_once(
            name,
            "timeout",
            "Reward function %r exceeded timeout_s=%s on a batch; its rows score 0.0 and %s "
            "Shown once per function; counted in reward/<name>/timeouts.",
            timeout_s,
            fate if fate.endswith(".") else fate + ".",
        )
        if self.max_failure_share is not None:
            self._judge(name, rows, rows)

    def metrics(self) -> dict[str, float]:
        """``reward/{name}/failures`` and ``reward/{name}/timeouts`` since construction."""
        out = {}
        for name in self.failures:
            out[f"reward/{name}/failures"] = float(self.failures[name])
            out[f"reward/{name}/timeouts"] = float(self.timeouts[name])
        return out
