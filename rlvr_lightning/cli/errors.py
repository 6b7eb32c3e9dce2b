"""One error format for the ``rlvr-lightning`` command: the cause and the fix in a few lines.

jsonargparse wraps a bad value in every Union it passed through (``Does not validate against any
of the Union subtypes``, the subtype list, ``Expected a <class 'NoneType'>``, a ``Given value:``
dump of the whole config); ``summary`` keeps the keys it went through and the innermost message.
The full traceback is printed instead when ``RLVR_TRACEBACK=1`` is set.
"""

from __future__ import annotations

import os
import re
import traceback
from argparse import ArgumentError

from rlvr_lightning.cli import keys

TRACEBACK_ENV = "RLVR_TRACEBACK"
MAX_LINES = 4  # lines of the cause shown; the fix and the traceback hint come after them
MAX_CHARS = 400  # per line: a long value is cut, not wrapped over the screen

_NOISE = re.compile(
    r"Does not validate against any of the Union subtypes|^Subtypes: |^Errors:$|"
    r"^- Expected a <class 'NoneType'>$|^Given value type: |^Given value: |"
    r"^- Problem with given class_path |^Problem with given class_path "
)
_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_WRAPPER = re.compile(r"Does not validate against any of the Union subtypes|^Problem with given")
_CALLABLE = re.compile(r"Type \w+ expects a function or a callable class: (.*)\. Got value: (.*)")

_MODEL_KEYS = "`rlvr-lightning fit --model.help RLVRModule` lists the model keys"
_DATA_KEYS = "`--data.help RLVRDataModule` the data keys"
_FIXES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"--optimizer|--lr_scheduler|'optimizer'|'lr_scheduler'"),
        "the optimiser is AdamW, set by model.init_args.update: lr, weight_decay, warmup_steps "
        "(linear warm-up) and lr_decay (none, linear or cosine, to min_lr_ratio * lr); "
        "--optimizer/--lr_scheduler are not supported.",
    ),
    (
        re.compile(r"No module named '([^']+)'"),
        "put {0}.py in the folder you run from (or on PYTHONPATH) and name the function by its "
        "import path, e.g. {0}.my_reward.",
    ),
    (
        re.compile(r'expected "subcommand"|argument subcommand'),
        "name a command: fit, validate, test, predict, push or export (`rlvr-lightning --help`).",
    ),
    (
        re.compile(r"Expected a str$", re.M),
        "a command-line value with ': ' in it is read as a YAML mapping; quote the text inside "
        "its parent's mapping, e.g. --data.init_args=\"{{instruction: 'Answer: in \\boxed{{}}'}}\" "
        "(or set it in the --config YAML).",
    ),
    (
        re.compile(
            r"not accepted|not expected|does not accept|Unrecognized arguments|Unexpected|"
            r"invalid choice",
            re.IGNORECASE,
        ),
        f"check the spelling and nesting of the key: {_MODEL_KEYS}, {_DATA_KEYS}, "
        "`--print_config` a full YAML.",
    ),
)


def traceback_requested() -> bool:
    """True when ``RLVR_TRACEBACK`` asks for the full traceback instead of the summary."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def _cause_lines(message: str) -> tuple[list[str], list[str]]:
    """The keys a jsonargparse message went through, and its lines without the Union noise."""
    keys = _KEY.findall(message)
    lines = []
    for raw in message.splitlines():
        line = _KEY.sub("", raw).strip().removeprefix(":").strip()
        if not line or _NOISE.search(line):
            continue
        line = _CLASS.sub(r"\1", line.removeprefix("- "))
        if match := _CALLABLE.fullmatch(line):
            line = f"cannot import {match.group(2)}: {match.group(1)}"
        line = line if len(line) <= MAX_CHARS else line[: MAX_CHARS - 3] + "..."
        if line not in lines:  # each Union member repeats the same message
            lines.append(line)
    return keys, lines


def _key_path(keys: list[str]) -> str:
    # `model` -> `rewards` is `model.init_args.rewards` in a YAML file (subclass mode).
    parts = [keys[0], *keys[1:]]
    if keys[0] in ("model", "data") and len(keys) > 1 and keys[1] != "init_args":
        parts.insert(1, "init_args")
    return ".".join(parts)


def _where(err: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame, for errors that are not the user's
    input (a bug or a failing library): the summary then still says where to look."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return None
    frame = frames[-1]
    return f"{os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"


def _own_error(err: BaseException) -> BaseException:
    """The first exception in ``err``'s chain that jsonargparse did not wrap: the one a
    constructor raised (``Model folder ... does not exist``), with its own traceback."""
    cause: BaseException | None = err
    while cause is not None and _WRAPPER.search(str(cause)):
        cause = cause.__cause__ or cause.__context__
    return cause or err


def summary(err: BaseException, command: str = "rlvr-lightning") -> str:
    """A few lines for ``err``: where (the config key), what went wrong, and how to fix it."""
    from_input = isinstance(err, ArgumentError)  # a parse error: the arguments or the YAML
    if not from_input:
        err = _own_error(err)
    keys_seen, lines = _cause_lines(str(err))
    head = f"{command}: error"
    if keys_seen:
        head += f" in {_key_path(keys_seen)}"
    if not lines:
        lines = [type(err).__name__]
    elif not from_input:
        lines[0] = f"{type(err).__name__}: {lines[0]}"
    out = [head, *(f"  {line}" for line in lines[:MAX_LINES])]
    text = "\n".join(out)
    where = _key_path(keys_seen) if keys_seen else ""
    if fix := keys.key_fix(keys_seen, text) or keys.import_path_fix(text, where):
        out.append("  Fix: " + fix)
    else:
        for pattern, fix in _FIXES:
            if match := pattern.search(text):
                out.append("  Fix: " + fix.format(*match.groups()))
                break
    if not from_input and (where := _where(err)):
        out.append(f"  at {where}")
    out.append(f"  (full traceback: {TRACEBACK_ENV}=1 {command} ...)")
    return "\n".join(out)
