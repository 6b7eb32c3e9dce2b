"""The Hugging Face Hub: export a ``from_pretrained`` folder, push it, and load models by name.

- ``export_pretrained`` writes weights (safetensors; LoRA merged into a copy, or the adapter
  alone), config, generation config, the tokenizer with its chat template, and any extra heads.
- ``push_folder`` uploads a folder in one commit through ``huggingface_hub.HfApi`` (to a branch
  or the default branch), retrying transient failures with exponential backoff.
- ``resolve_hub_model`` turns ``org/name`` or ``org/name@revision`` into a local snapshot folder,
  with errors that say how to fix an offline machine or an unknown name.

Model cards are rendered by ``rlvr_lightning.hub.model_card``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from safetensors.torch import load_file, save_file
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

T = TypeVar("T")

# `org/name`, optionally `@revision` (a branch, tag or commit sha). Single names (`gpt2`) are
# legacy Hub ids and allowed too.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(@[\w./-]+)?$")
_RETRYABLE_4XX = {408, 409, 423, 429}
HEADS_SUFFIX = ".safetensors"
DEFAULT_HEADS = ("value_head", "probe_head")


# ---- export ----------------------------------------------------------------------------------


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def _save_adapter(model: nn.Module, path: Path, base_model: str | None) -> None:
    # peft records the base model's location, which for a local or embedded model is a path on
    # this machine, and looks that name up on the Hub while saving. Save without a name (no
    # network), then write the public Hub id (or nothing) into the adapter config.
    configs = model.peft_config
    saved = {name: cfg.base_model_name_or_path for name, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg.base_model_name_or_path = None
        model.save_pretrained(path, safe_serialization=True)
    finally:
        for name, cfg in configs.items():
            cfg.base_model_name_or_path = saved[name]
    for config_file in path.rglob("adapter_config.json"):
        data = json.loads(config_file.read_text())
        data["base_model_name_or_path"] = base_model
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_heads(heads: Mapping[str, nn.Module], dirpath: str | Path) -> list[Path]:
    """Save each head's ``state_dict`` as ``<name>.safetensors`` (class name in the metadata);
    a head with a ``save_pretrained(dirpath, name)`` method (``ProbeHead``: the fitted probe
    and its settings, without the training buffer) writes itself."""
    written = []
    for name, head in heads.items():
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"Head name {name!r} must be a plain file name ([A-Za-z0-9_.-]).")
        if hasattr(head, "save_pretrained"):
            written.extend(head.save_pretrained(dirpath, name))
            continue
        tensors = {k: v.detach().cpu().contiguous().clone() for k, v in head.state_dict().items()}
        target = Path(dirpath) / f"{name}{HEADS_SUFFIX}"
        save_file(tensors, str(target), metadata={"class": type(head).__qualname__})
        written.append(target)
    return written


def load_head(head: nn.Module, dirpath: str | Path, name: str) -> nn.Module:
    """Load ``<name>.safetensors`` of an export into ``head`` (a module of the same shape)."""
    head.load_state_dict(load_file(str(Path(dirpath) / f"{name}{HEADS_SUFFIX}")))
    return head


def module_heads(module: nn.Module) -> dict[str, nn.Module]:
    """The extra heads of a module to export: the attributes named in ``module.hub_heads``.

    Without ``hub_heads`` these are ``value_head`` and ``probe_head`` (``DEFAULT_HEADS``), so a
    value or probe head is exported whenever a module has one; attributes that are missing or
    None are skipped.
    """
    heads = {}
    for name in getattr(module, "hub_heads", DEFAULT_HEADS):
        head = getattr(module, name, None)
        if head is None:
            continue
        if not isinstance(head, nn.Module):
            raise TypeError(f"hub_heads names {name!r}, which is a {type(head).__name__}.")
        heads[name] = head
    return heads


def export_pretrained(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    dirpath: str | Path,
    *,
    adapter_only: bool = False,
    heads: Mapping[str, nn.Module] | None = None,
    base_model: str | None = None,
) -> Path:
    """Save weights (safetensors), config, generation config, tokenizer and heads to ``dirpath``.

    A LoRA policy is merged into a copy of its base model by default, so the folder is a plain
    ``AutoModelForCausalLM`` checkpoint; with ``adapter_only`` the folder holds the adapter for
    ``PeftModel.from_pretrained`` (``base_model`` is recorded as its base). The training model
    is left untouched.
    """
    path = Path(dirpath)
    path.mkdir(parents=True, exist_ok=True)
    if adapter_only and not _is_peft(model):
        raise ValueError("adapter_only=True needs a LoRA policy (set model.lora_rank > 0).")
    if adapter_only:
        _save_adapter(model, path, base_model)
        base = model.get_base_model()
    else:
        base = copy.deepcopy(model).merge_and_unload() if _is_peft(model) else model
        base.save_pretrained(path, safe_serialization=True)
    generation_config = getattr(base, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    save_heads(heads or {}, path)
    _drop_local_name(path / "config.json")
    return path


def _drop_local_name(config_file: Path) -> None:
    # `_name_or_path` may hold a folder on this machine; an exported config should not.
    if not config_file.exists():
        return
    data = json.loads(config_file.read_text())
    if os.path.isabs(str(data.get("_name_or_path", ""))):
        del data["_name_or_path"]
        config_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


# ---- push ------------------------------------------------------------------------------------


def is_retryable(err: BaseException) -> bool:
    """Transient failures (5xx, timeouts, rate limits, connection errors) are worth a retry;
    authentication, permission and not-found errors are not."""
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    if status is None:
        # Connection errors and timeouts (of whichever HTTP client huggingface_hub uses);
        # programming and local file errors are not transient.
        return not isinstance(err, ValueError | TypeError | LookupError | FileNotFoundError)
    return status >= 500 or status in _RETRYABLE_4XX


def with_retries(
    fn: Callable[[], T],
    attempts: int,
    backoff_s: float,
    sleep: Callable[[float], None] = time.sleep,
    retryable: Callable[[BaseException], bool] = is_retryable,
) -> T:
    """Call ``fn`` up to ``attempts`` times, sleeping ``backoff_s * 2**i`` after failure ``i``.

    Example: attempts=3, backoff_s=2 sleeps 2 s then 4 s, and re-raises the third failure.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}.")
    for i in range(attempts):
        try:
            return fn()
        except Exception as err:
            if i == attempts - 1 or not retryable(err):
                raise
            delay = backoff_s * 2**i
            log.warning(
                "Hub request failed (%s); retry %d/%d in %.1f s.", err, i + 1, attempts - 1, delay
            )
            sleep(delay)
    raise AssertionError("unreachable")


def folder_files(folder: str | Path, only: Iterable[str] | None = None) -> dict[str, Path]:
    """``{path in repo: local file}`` for every file under ``folder`` (or just ``only``)."""
    root = Path(folder)
    if only is not None:
        return {name: root / name for name in only if (root / name).is_file()}
    return {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    commit_message: str = "Upload model trained with rlvr-lightning",
    only: Iterable[str] | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    attempts: int = 3,
    backoff_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Upload the files of ``folder`` (or the names in ``only``) to ``repo_id`` in one commit.

    Creates the repository (``private`` applies only then) and the branch ``revision`` when
    missing. The token is ``token``, else ``HF_TOKEN``, else the ``huggingface_hub`` login.
    Returns the commit URL. Local files are only read.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    files = folder_files(folder, only)
    if not files:
        raise FileNotFoundError(f"Nothing to push: no files in {Path(folder).name!r}.")
    api = HfApi(endpoint=endpoint, token=token)

    def attempt() -> str:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision not in (None, "main"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        ops = [CommitOperationAdd(name, str(path)) for name, path in files.items()]
        info = api.create_commit(
            repo_id, operations=ops, commit_message=commit_message, revision=revision
        )
        return str(info.commit_url)

    return with_retries(attempt, attempts, backoff_s, sleep)


# ---- loading by name -------------------------------------------------------------------------


def split_revision(name: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; no ``@`` -> ``(name, None)``."""
    repo_id, _, revision = name.partition("@")
    return repo_id, revision or None


def is_hub_name(name: str) -> bool:
    """True for ``org/name`` or ``org/name@revision`` that is not an existing local path."""
    return bool(_HUB_ID.fullmatch(name)) and not Path(split_revision(name)[0]).exists()


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.is_offline_mode() or env.upper() in {"1", "ON", "YES", "TRUE"}


def resolve_hub_model(
    name: str, *, cache_dir: str | Path | None = None, endpoint: str | None = None
) -> Path:
    """Download (or find in the cache) the snapshot of ``org/name[@revision]``; its folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo_id, revision = split_revision(name)
    offline = _offline()
    fixes = (
        f"No local folder {repo_id!r} exists either. Use a local folder with a saved model, or "
        "the embedded default 'embedded:smollm2-135m-instruct'."
    )
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache_dir,
            endpoint=endpoint,
            local_files_only=offline,
        )
    except GatedRepoError as err:
        raise OSError(
            f"{repo_id!r} is gated: accept its terms on the Hub and log in (`hf auth login` or "
            f"HF_TOKEN). {fixes}"
        ) from err
    except RevisionNotFoundError as err:
        raise OSError(f"{repo_id!r} has no revision {revision!r}. {fixes}") from err
    except RepositoryNotFoundError as err:
        raise OSError(
            f"No model {repo_id!r} on the Hub (or it is private: log in or set HF_TOKEN). "
            f"Check the name. {fixes}"
        ) from err
    except LocalEntryNotFoundError as err:
        why = (
            "HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache. Set "
            "HF_HUB_OFFLINE=0 on a machine with network access to download it once"
            if offline
            else "the Hub could not be reached and it is not in the local cache. Check the "
            "network (or HF_ENDPOINT)"
        )
        raise OSError(f"Cannot load {name!r}: {why}. {fixes}") from err
    return Path(folder)
