"""What may appear in a public model card: Hub tokens and local paths never do."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlvr_lightning.hub.transfer import is_hub_name, split_revision

log = logging.getLogger(__name__)

LOCAL_PATH = "<local path>"
REDACTED = "<redacted>"
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{16,}\b")
_STOP = r"\s'\"`<>|()\[\]"  # characters that end an unquoted path
# A path goes on past a single space when the next word holds a separator ("My Documents/x"):
# a folder name with a space then does not leave its tail (and what follows) in the card. A
# last component with a space keeps the words after it; quoted paths are scrubbed whole.
_SPACED = rf"(?: [^{_STOP}/\\]*[/\\][^{_STOP},]*)*"
# An absolute POSIX or Windows path (or one under ~) with at least two components, not part
# of a URL.
_ABS_PATH = re.compile(
    rf"(?<![\w:/.~-])(?:~[/\\]?|[A-Za-z]:\\|/)(?:[^{_STOP}/\\]+[/\\])+[^{_STOP},]*{_SPACED}"
)
# file: URLs (file:///home/..., file://host/..., file:/...) are local paths too.
_FILE_URL = re.compile(rf"\bfile:(?://[^{_STOP}/]*)?/[^{_STOP}]*{_SPACED}", re.IGNORECASE)
# A quoted absolute path or file: URL, spaces and all: the quotes say where it ends (one
# starred part, so an unclosed quote costs linear time; ``_quoted`` wants two components).
_QUOTED = re.compile(r"(['\"`])((?:file:|~|[A-Za-z]:\\|/)[^'\"`\n]*)\1", re.IGNORECASE)
_PUBLIC_BASES = {"embedded:smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def public_base_model(policy: str) -> str | None:
    """The Hub id a policy name stands for, or None (tiny models, local folders)."""
    if policy in _PUBLIC_BASES:
        return _PUBLIC_BASES[policy]
    repo_id = split_revision(policy)[0]  # the card's `base_model` names a repo, not a revision
    return repo_id if is_hub_name(policy) and "/" in repo_id and ":" not in policy else None


def clean_value(value: Any) -> Any:
    """Plain data with every absolute or home-relative path replaced by ``<local path>``, and
    relative paths that exist here by their last part."""
    if isinstance(value, Mapping):
        return {str(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_value(v) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        if os.path.isabs(value) or value.startswith("~") or value.lower().startswith("file:"):
            return LOCAL_PATH
        if ("/" in value or os.sep in value) and os.path.exists(value):
            return Path(value).name  # a relative local path: only its last part says anything
        return _ABS_PATH.sub(LOCAL_PATH, value)
    if value is None or isinstance(value, bool | int | float):
        return value
    return clean_value(repr(value))


def _secrets() -> list[str]:
    found = [os.environ.get(k, "") for k in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")]
    try:
        from huggingface_hub import get_token

        found.append(get_token() or "")
    except Exception:  # a broken login file must not stop an export
        pass
    return [s for s in found if len(s) >= 8]


def _quoted(match: re.Match[str]) -> str:
    """A quoted path of two components or more as ``<local path>`` in its quotes; else as is."""
    quote, inner = match.group(1), match.group(2)
    if re.search(r"[/\\]", inner[1:].removeprefix("//").lstrip("/")) is None:
        return match.group(0)  # "/" or "~" or "file:///x" alone: one component
    return f"{quote}{LOCAL_PATH}{quote}"


def scrub(text: str, roots: Sequence[str | Path] = ()) -> str:
    """Remove Hub tokens and local paths: quoted paths and ``file:`` URLs whole, then ``roots``,
    then any path-like text (spaces included where the next word goes on with a separator)."""
    for secret in _secrets():
        text = text.replace(secret, REDACTED)
    text = _HF_TOKEN.sub(REDACTED, text)
    text = _QUOTED.sub(_quoted, text)
    text = _FILE_URL.sub(LOCAL_PATH, text)
    for root in sorted({str(r) for r in roots if str(r)}, key=len, reverse=True):
        text = text.replace(root, LOCAL_PATH)
    return _ABS_PATH.sub(LOCAL_PATH, text)


def adapter_base_model(policy: str, given: str | None = None) -> str | None:
    """The base model an adapter-only export records (``adapter_config.json``'s
    ``base_model_name_or_path``, which ``AutoPeftModelForCausalLM`` loads): ``given`` (the
    export's ``--base-model``), else the Hub id the policy was named by, else the policy's
    local folder as an absolute path, with a warning that it resolves on this machine only;
    None (with a warning) for a policy built in-process (``tiny:``)."""
    if given:
        return given
    if public := public_base_model(policy):
        return public
    fix = "give the Hub id of the base model: `--base-model org/name` (ExportModel: base_model)"
    if policy and Path(policy).exists():
        log.warning(
            "The adapter records its base model as the local folder %s: it will not resolve on "
            "another machine; %s.",
            Path(policy).resolve(),
            fix,
        )
        return str(Path(policy).resolve())
    log.warning("The adapter records no base model (policy %r has no folder); %s.", policy, fix)
    return None
