"""Pushing through huggingface_hub's real client to a loopback FakeHub, and retries."""

import hashlib
from pathlib import Path

import pytest

from rlvr_lightning.cli.main import main
from rlvr_lightning.hub import folder_files, is_retryable, push_folder, with_retries

FAKE_TOKEN = "hf_" + "k7" * 15


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    (folder / "README.md").write_text("---\nlicense: apache-2.0\ntags: [rlvr]\n---\n# card\n")
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (folder / "sub" / "value_head.safetensors").write_bytes(b"\x01\x02\x03")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "skip.lock").write_text("not uploaded")
    return folder


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_push_uploads_every_file_with_the_token(tmp_path, monkeypatch, fake_hub):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    folder = _folder(tmp_path)
    with fake_hub() as hub:
        url = push_folder(folder, "me/adder", private=True, endpoint=hub.url, sleep=pytest.fail)
        received = hub.files("me/adder")
        repo = hub.repos["me/adder"]
    assert url.startswith(hub.url + "/me/adder/commit/")
    assert received == {name: path.read_bytes() for name, path in folder_files(folder).items()}
    assert set(received) == {"README.md", "model.safetensors", "sub/value_head.safetensors"}
    assert repo.private is True
    assert set(hub.authorization) == {f"Bearer {FAKE_TOKEN}"}
    assert ("POST", "/api/models/me/adder/commit/main") in hub.requests


def test_push_to_a_branch_creates_it_and_leaves_main_alone(tmp_path, fake_hub):
    folder = _folder(tmp_path)
    with fake_hub() as hub:
        push_folder(folder, "me/adder", revision="training", endpoint=hub.url)
        push_folder(folder, "me/adder", revision="training", only=["README.md"], endpoint=hub.url)
        repo = hub.repos["me/adder"]
    assert repo.branches["main"] == {}
    assert "model.safetensors" in repo.branches["training"]
    assert [sorted(c["files"]) for c in repo.commits][-1] == ["README.md"]


def test_failing_server_raises_after_retries_and_keeps_local_files(tmp_path, fake_hub):
    folder = _folder(tmp_path)
    before = _digest(folder)
    slept: list[float] = []
    with fake_hub(fail_with=500) as hub, pytest.raises(Exception, match="500"):
        push_folder(
            folder, "me/adder", endpoint=hub.url, attempts=3, backoff_s=0.5, sleep=slept.append
        )
    assert slept == [0.5, 1.0]
    assert _digest(folder) == before


def test_a_transient_failure_is_retried(tmp_path, fake_hub):
    folder = _folder(tmp_path)
    slept: list[float] = []
    with fake_hub(fail_with=503, fail_times=1) as hub:
        push_folder(folder, "me/adder", endpoint=hub.url, sleep=slept.append)
        received = hub.files("me/adder")
    assert slept == [2.0]
    assert "model.safetensors" in received


def test_with_retries_backs_off_exponentially_and_stops_on_permanent_errors():
    calls, slept = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("reset")
        return "ok"

    # attempts=4, backoff 2 s: sleeps 2 s then 4 s before the third call succeeds.
    assert with_retries(flaky, attempts=4, backoff_s=2.0, sleep=slept.append) == "ok"
    assert slept == [2.0, 4.0]

    def denied():
        raise ValueError("bad repo id")

    with pytest.raises(ValueError):
        with_retries(denied, attempts=5, backoff_s=1.0, sleep=pytest.fail)


class _HttpError(Exception):
    def __init__(self, status):
        self.response = type("R", (), {"status_code": status})()


@pytest.mark.parametrize(
    ("status", "expected"), [(500, True), (503, True), (429, True), (401, False), (404, False)]
)
def test_retryable_statuses(status, expected):
    assert is_retryable(_HttpError(status)) is expected


def test_cli_push_uploads_an_export_folder(tmp_path, capsys, fake_hub):
    folder = _folder(tmp_path)
    with fake_hub() as hub:
        main(["push", str(folder), "--repo-id", "me/cli", "--endpoint", hub.url, "--public"])
        received = hub.files("me/cli")
        private = hub.repos["me/cli"].private
    assert received["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert private is False
    assert "Pushed" in capsys.readouterr().out


def test_cli_push_refuses_a_missing_path(tmp_path):
    with pytest.raises(SystemExit, match="neither"):
        main(["push", str(tmp_path / "nothing"), "--repo-id", "me/x"])
