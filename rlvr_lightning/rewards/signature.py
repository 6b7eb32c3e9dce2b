"""What a reward function's signature says: its name, the columns it takes and needs, and how
it receives the completions. Pure functions of the function object.
"""

from __future__ import annotations

import inspect
import re

from rlvr_lightning.rewards.contract import RewardFn

BY_NAME = ("prompts", "completion_ids", "completion_length")
"""Inputs that, named first, mean TRL's all-keyword call: the completions are not positional."""
# TRL's annotation of message-list completions (``list[list[dict[str, str]]]``), in the forms an
# annotation takes as an object or as text (``from __future__ import annotations``).
_MESSAGES = re.compile(r"^(?:list|List|Sequence)\[(?:list|List|Sequence)\[(?:dict|Dict|Mapping)\b")


def snake_case(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def default_name(fn: RewardFn) -> str:
    name = getattr(fn, "__name__", None) or getattr(fn, "name", None)
    return str(name) if name else snake_case(type(fn).__name__)


def dedupe(names: list[str]) -> list[str]:
    """Suffix repeated names with ``_2``, ``_3``, ... so every metric key stays distinct."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def completions_parameter(params: list[inspect.Parameter], name: str) -> tuple[str, bool]:
    """The completions parameter's name and whether they go by keyword.

    A parameter named ``completions`` anywhere but first takes them by keyword (TRL's
    ``fn(prompts, completions, **kwargs)``). A function whose first parameter is one of
    ``BY_NAME`` (TRL's ``fn(completion_ids, **kwargs)``) gets them by keyword in its
    ``**kwargs``, as TRL passes everything. Otherwise the first positional parameter does.
    """
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = [p for p in params if p.name == "completions" and p.kind in keyword]
    if named and (named[0] is not params[0] or named[0].kind not in positional):
        return "completions", True
    if not named and params and params[0].name in BY_NAME:
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return "completions", True
        raise ValueError(
            f"Reward function {name!r} takes no completions: its first parameter "
            f"{params[0].name!r} is an input passed by name. Add **kwargs (the completions then "
            "arrive there, as in TRL) or a parameter named `completions`."
        )
    if not params or params[0].kind not in (*positional, inspect.Parameter.VAR_POSITIONAL):
        raise ValueError(
            f"Reward function {name!r} must take the completions as its first positional "
            "argument or as a parameter named `completions`: fn(completions: list[str], "
            "**columns) -> list[float | None]."
        )
    return (params[0].name if params[0].kind in positional else ""), False


def wants_messages(fn: RewardFn) -> bool:
    """Whether ``fn`` annotates its completions as TRL's message lists
    (``list[list[dict[str, str]]]``, as ``trl.rewards.accuracy_reward`` does): it then gets them
    as message lists on plain-text prompts too, so that it runs unchanged on any data.

    >>> def chat(completions: list[list[dict[str, str]]], **kwargs): ...
    >>> def text(completions: list[str], **kwargs): ...
    >>> wants_messages(chat), wants_messages(text)
    (True, False)
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    param = params.get("completions") or next(iter(params.values()), None)
    if param is None or param.annotation is inspect.Parameter.empty:
        return False
    annotation = param.annotation
    text = annotation if isinstance(annotation, str) else repr(annotation)
    text = re.sub(r"\b(?:typing|collections\.abc)\.|\s", "", text)
    return bool(_MESSAGES.match(text))


def inspect_columns(
    fn: RewardFn, name: str
) -> tuple[frozenset[str] | None, tuple[str, ...], str, bool]:
    """Accepted columns (None = all), required columns, the completions parameter's name and
    whether the completions go by keyword."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: hand them everything
        return None, (), "", False
    first, by_name = completions_parameter(params, name)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = [p for p in params if p.kind in keyword and p.name != first]
    required = tuple(p.name for p in named if p.default is inspect.Parameter.empty)
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return (None if takes_all else frozenset(p.name for p in named)), required, first, by_name
