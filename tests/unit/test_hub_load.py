"""Loading ``org/name[@revision]`` through huggingface_hub from a loopback FakeHub, and errors."""

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlvr_lightning import models
from rlvr_lightning.hub import (
    export_pretrained,
    is_hub_name,
    push_folder,
    resolve_hub_model,
    split_revision,
)
from rlvr_lightning.testing import tiny_policy

IDS = torch.tensor([[5, 6, 7, 8]])  # [1, 4]


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits  # [1, 4, V]


def _publish(hub: Any, tmp_path: Path, seed: int, revision: str | None = None) -> None:
    model, tokenizer = tiny_policy(seed=seed)
    folder = export_pretrained(model, tokenizer, tmp_path / f"export-{seed}")
    push_folder(folder, "me/tiny", revision=revision, endpoint=hub.url)


def test_split_revision_and_hub_names(tmp_path):
    assert split_revision("org/name@v2") == ("org/name", "v2")
    assert split_revision("org/name") == ("org/name", None)
    assert is_hub_name("org/name") and is_hub_name("org/name@0123abc") and is_hub_name("gpt2")
    assert not is_hub_name("embedded:smollm2-135m-instruct")
    assert not is_hub_name("/abs/folder") and not is_hub_name("a/b/c")
    (tmp_path / "org").mkdir()
    assert not is_hub_name(str(tmp_path / "org"))  # an existing folder is a local path


def test_download_by_name_and_by_revision_gives_the_pushed_weights(tmp_path, fake_hub):
    with fake_hub() as hub:
        _publish(hub, tmp_path, seed=0)
        _publish(hub, tmp_path, seed=1, revision="v2")
        main = resolve_hub_model("me/tiny", endpoint=hub.url, cache_dir=tmp_path / "cache")
        v2 = resolve_hub_model("me/tiny@v2", endpoint=hub.url, cache_dir=tmp_path / "cache")
    expected0, expected1 = _logits(tiny_policy(seed=0)[0]), _logits(tiny_policy(seed=1)[0])
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(main)), expected0)
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(v2)), expected1)


def test_offline_uses_the_cache_and_names_the_fix_when_missing(tmp_path, monkeypatch, fake_hub):
    cache = tmp_path / "cache"
    with fake_hub() as hub:
        _publish(hub, tmp_path, seed=0)
        online = resolve_hub_model("me/tiny", endpoint=hub.url, cache_dir=cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the server is gone too
    assert resolve_hub_model("me/tiny", cache_dir=cache) == online
    with pytest.raises(OSError, match="HF_HUB_OFFLINE") as err:
        resolve_hub_model("me/never-downloaded", cache_dir=cache)
    assert "embedded:smollm2-135m-instruct" in str(err.value)


def test_unknown_repository_or_revision_gives_a_clear_error(tmp_path, fake_hub):
    with fake_hub() as hub:
        _publish(hub, tmp_path, seed=0)
        with pytest.raises(OSError, match="No model 'me/missing' on the Hub"):
            resolve_hub_model("me/missing", endpoint=hub.url, cache_dir=tmp_path / "c")
        with pytest.raises(OSError, match="has no revision 'nope'"):
            resolve_hub_model("me/tiny@nope", endpoint=hub.url, cache_dir=tmp_path / "c")


def test_unreachable_hub_says_so(tmp_path, fake_hub):
    with fake_hub() as hub:
        url = hub.url
    # Nothing listens on that loopback port any more.
    with pytest.raises(OSError, match="could not be reached"):
        resolve_hub_model("me/tiny", endpoint=url, cache_dir=tmp_path / "c")


def test_load_policy_by_name_offline_names_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="HF_HUB_OFFLINE is set") as err:
        models.load_policy("rlvr-lightning-tests/not-a-model@main")
    assert "local folder" in str(err.value)
