"""``rlvr-lightning fit --help`` that leads with the model and data keys.

LightningCLI's help starts with a usage of every Trainer flag and lists Trainer's ~60 options
before the model's; in subclass mode the model's and data's keys are not listed at all (only
``--model.help CLASS`` names them). Here the usage is one line, the description lists every
model and data key by section (read from the signatures, so it cannot drift), and the model and
data arguments come before the Trainer's (``RLVRCLI.add_core_arguments_to_parser``).
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from typing import Any

from jsonargparse import DefaultHelpFormatter

WIDTH = 88
USAGE = (
    "%(prog)s [-c CONFIG] [--print_config] [--model.init_args.KEY VALUE] "
    "[--data.init_args.KEY VALUE] [--trainer.KEY VALUE] [--ckpt_path PATH] ..."
)


class KeysFirstFormatter(DefaultHelpFormatter):
    """jsonargparse's formatter that keeps the description's own line breaks (it is wrapped
    by :func:`description`); option help is formatted as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line if line else "" for line in text.splitlines())


def _parameters(cls: type) -> list[inspect.Parameter]:
    return list(inspect.signature(cls.__init__).parameters.values())[1:]


def _lines(head: str, names: list[str]) -> list[str]:
    return textwrap.wrap(
        " ".join(names), WIDTH, initial_indent=f"  {head}", subsequent_indent=" " * 6
    )


def section_lines(title: str, cls: type) -> list[str]:
    """``title`` and ``cls``'s keys: plain ones on a few lines, each dataclass-typed argument
    (an option group) on its own line with its fields."""
    plain, groups = [], []
    for p in _parameters(cls):
        if dataclasses.is_dataclass(p.default):
            fields = [f.name for f in dataclasses.fields(p.default)]
            groups.append((p.name, fields))
        else:
            plain.append(p.name)
    out = [*textwrap.wrap(title, WIDTH), *_lines("", plain)]
    for name, fields in groups:
        out += _lines(f"{name}: ", fields)
    return out


def description(command_text: str, model: type, data: type) -> str:
    """The subcommand's description: what it does, then the model and data keys."""
    return "\n".join(
        [
            *textwrap.wrap(command_text, WIDTH),
            "",
            *section_lines(
                "Model keys (YAML model.init_args.KEY, flag --model.init_args.KEY; "
                f"--model.help {model.__name__} describes each):",
                model,
            ),
            "",
            *section_lines(
                f"Data keys (data.init_args.KEY; --data.help {data.__name__} describes each):",
                data,
            ),
            "",
            *textwrap.wrap(
                "Trainer keys (trainer.KEY) follow the model's and data's below. TRL's "
                'names: README "Coming from TRL".',
                WIDTH,
            ),
        ]
    )


def subcommand_kwargs(text: str, model: type, data: type) -> dict[str, Any]:
    """Parser arguments of a Trainer subcommand: the short usage and the key overview (the
    main parser's ``formatter_class``, ``KeysFirstFormatter``, keeps its lines)."""
    return {"usage": USAGE, "description": description(text, model, data)}
