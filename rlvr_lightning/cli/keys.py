"""The fix line for a key or a name the parser does not know: where it belongs.

- a key from before the option groups, or one of TRL's ``GRPOConfig`` names, is named by its
  place here (``options.moved_message``: :data:`options.MOVED` and :data:`options.TRL_NAMES`);
- a misspelled key gets the closest key of its section (``sampling.gruop_size`` ->
  ``group_size``) and the section's keys;
- a bare name where an import path is expected (``[boxed_accuracy]``) gets the import path of
  the package that has it (``rlvr_lightning.rewards.boxed_accuracy``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re

_UNRECOGNIZED = re.compile(r"unrecognized arguments:(.*)", re.IGNORECASE)
_FLAG = re.compile(r"--([\w.]+)")
_NOT_ACCEPTED = re.compile(
    r"(?:(?:Group|Subcommand) '([\w.]+)' does not accept option '([\w.]+)')|"
    r"(?:(?:Option|Key) '?\"?([\w.]+?)'?\"? is not (?:accepted|expected))"
)
_BARE_NAME = re.compile(r"Expected a dot import path string: (\w+)$", re.M)
# Where a bare name may live, first match wins: rewards before callbacks (a reward is the
# bare name users write most, `rewards: {functions: [boxed_accuracy]}`).
_PACKAGES = ("rlvr_lightning.rewards", "rlvr_lightning.callbacks", "lightning.pytorch.callbacks")
MAX_LISTED = 12  # keys of a section the fix line lists


def unknown_keys(parser_keys: list[str], text: str) -> list[list[str]]:
    """The unknown keys an error message names, each as its path without ``init_args``
    (``["model", "sampling", "gruop_size"]``; ``["num_generations"]`` at the top level)."""
    found: list[str] = []
    for match in _UNRECOGNIZED.finditer(text):
        found += _FLAG.findall(match.group(1))
    paths = [[*parser_keys, *key.split(".")] for key in found]
    for match in _NOT_ACCEPTED.finditer(text):
        group, option, alone = match.groups()
        if option is None:
            paths.append([*parser_keys, *alone.split(".")])
        else:
            inside = [] if match.group(0).startswith("Subcommand") else group.split(".")
            paths.append([*parser_keys, *inside, *option.split(".")])
    return [[p for p in path if p != "init_args"] for path in paths]


def section_keys(section: list[str]) -> list[str]:
    """The keys a section takes (``["model", "sampling"]`` -> the ``Sampling`` fields); empty
    where this function does not know the section."""
    from lightning.pytorch import Trainer

    from rlvr_lightning.data import RLVRDataModule
    from rlvr_lightning.module import RLVRModule
    from rlvr_lightning.options import GROUPS
    from rlvr_lightning.types import Sampling

    classes = {"trainer": Trainer, "model": RLVRModule, "data": RLVRDataModule}
    if len(section) == 1 and section[0] in classes:
        return [p for p in inspect.signature(classes[section[0]].__init__).parameters][1:]
    if len(section) == 2 and section[0] == "model":
        if section[1] in ("sampling", "val_sampling"):
            return [f.name for f in dataclasses.fields(Sampling)]
        if section[1] in GROUPS:
            return [f.name for f in dataclasses.fields(GROUPS[section[1]])]
    return []


def key_fix(parser_keys: list[str], text: str) -> str | None:
    """The fix line for the first unknown key of ``text`` this module can place."""
    from rlvr_lightning.options import moved_message

    for path in unknown_keys(parser_keys, text):
        name, section = path[-1], path[:-1]
        if message := moved_message(name, under_model=section[:1] == ["model"]):
            return message
        known = section_keys(section)
        if not known:
            continue
        where = ".".join(section[:1] + ["init_args"] * (section[0] != "trainer") + section[1:])
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        listed = ", ".join(known[:MAX_LISTED]) + (", ..." if len(known) > MAX_LISTED else "")
        guess = f"did you mean `{close[0]}`? " if close else ""
        return f"`{where}` has no key `{name}`: {guess}Its keys: {listed}."
    return None


def import_path_fix(text: str, key_path: str) -> str | None:
    """The import path for a bare name (``boxed_accuracy``) given where one is expected."""
    match = _BARE_NAME.search(text)
    if match is None:
        return None
    name = match.group(1)
    for package in _PACKAGES:
        if hasattr(importlib.import_module(package), name):
            return f"name it by its import path: {package}.{name}."
    if "rewards" in key_path or key_path.endswith(".fn"):
        return (
            f"name the function by its import path, e.g. my_rewards.{name} (with my_rewards.py "
            "in the folder you run from, or on PYTHONPATH)."
        )
    return (
        f"name the class by its import path, e.g. rlvr_lightning.callbacks.{name} "
        f"(or lightning.pytorch.callbacks.{name})."
    )
