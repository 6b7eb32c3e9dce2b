"""A loopback stand-in for the few Hub endpoints an upload and a download use, for tests.

``FakeHub`` runs ``http.server`` on 127.0.0.1 in a thread. ``huggingface_hub.HfApi`` talks to it
unchanged (``endpoint=hub.url``): repository and branch creation, README metadata validation,
``preupload`` (every file is answered "regular", so contents arrive base64-encoded inside the
NDJSON commit and no LFS/Xet storage is needed), ``commit``, and for downloads the revision
info and ``resolve`` of files. ``fail_with`` makes every request (or only the first
``fail_times``) answer that status, to test failure handling.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse

_REPO_API = re.compile(r"^/api/models/([^/]+/[^/]+)/(preupload|commit|branch|revision|tree)/(.+)$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


@dataclass
class FakeRepo:
    private: bool | None
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    commits: list[dict[str, Any]] = field(default_factory=list)  # {"revision", "summary", "files"}
    heads: dict[str, str] = field(default_factory=dict)  # branch -> commit sha


class FakeHub:
    """The server's state; ``with FakeHub() as hub:`` serves it at ``hub.url``."""

    def __init__(self, fail_with: int | None = None, fail_times: int | None = None) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.authorization: list[str | None] = []
        self.fail_with, self.fail_times = fail_with, fail_times
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id].branches[revision])

    def should_fail(self) -> bool:
        if self.fail_with is None:
            return False
        if self.fail_times is None:
            return True
        self.fail_times -= 1
        if self.fail_times < 0:
            self.fail_with = None
            return False
        return True

    # ---- endpoint logic (called with the lock held) ------------------------------------------

    def create_repo(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        repo_id = f"{body['organization']}/{body['name']}"
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": self._url(repo_id)}
        self.repos[repo_id] = FakeRepo(private=body.get("visibility") == "private")
        return 200, {"url": self._url(repo_id)}

    def create_branch(self, repo: FakeRepo, branch: str) -> tuple[int, dict[str, Any]]:
        if branch in repo.branches:
            return 409, {"error": "Reference already exists"}
        repo.branches[branch] = dict(repo.branches["main"])
        return 200, {}

    def commit(self, repo_id: str, revision: str, lines: list[dict]) -> tuple[int, dict]:
        repo = self.repos[repo_id]
        if revision not in repo.branches:
            return 404, {"error": f"Invalid rev id: {revision}"}
        header = next(line["value"] for line in lines if line["key"] == "header")
        received = {}
        for line in lines:
            if line["key"] == "file":
                received[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] != "header":
                return 400, {"error": f"FakeHub does not support {line['key']!r} operations"}
        repo.branches[revision].update(received)
        sha = hashlib.sha1(f"{repo_id}{len(repo.commits)}".encode()).hexdigest()
        repo.heads[revision] = sha
        repo.commits.append({"revision": revision, "summary": header["summary"], "files": received})
        return 200, {"commitUrl": f"{self._url(repo_id)}/commit/{sha}", "commitOid": sha}

    def revision_info(self, repo_id: str, revision: str) -> tuple[int, dict]:
        repo = self.repos[repo_id]
        revision = self.branch_of(repo, revision)
        if revision not in repo.branches:
            return 404, {"error": f"Invalid rev id: {revision}"}
        files = repo.branches[revision]
        siblings = [{"rfilename": name} for name in sorted(files)]
        sha = repo.heads.get(revision, "0" * 40)
        return 200, {"id": repo_id, "sha": sha, "private": bool(repo.private), "siblings": siblings}

    def branch_of(self, repo: FakeRepo, revision: str) -> str:
        """The branch a branch name or commit sha points to."""
        return next((b for b, sha in repo.heads.items() if revision in (b, sha)), revision)

    def tree(self, repo_id: str, revision: str) -> tuple[int, Any]:
        files = self.repos[repo_id].branches.get(self.branch_of(self.repos[repo_id], revision))
        if files is None:
            return 404, {"error": f"Invalid rev id: {revision}"}
        entries = [
            {"type": "file", "path": n, "size": len(c), "oid": hashlib.sha1(c).hexdigest()}
            for n, c in sorted(files.items())
        ]
        return 200, entries

    def _url(self, repo_id: str) -> str:
        return f"{self.url}/{repo_id}"


class _HubHandler(BaseHTTPRequestHandler):
    """Routes the upload/download endpoints of huggingface_hub's client to ``hub``."""

    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # keep test output quiet
        pass

    def _reply(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        path = urlparse(self.path).path
        body = self._body() if self.command == "POST" else b""
        with self.hub._lock:
            self.hub.requests.append((self.command, path))
            self.hub.authorization.append(self.headers.get("Authorization"))
            if self.hub.should_fail():
                self._reply(self.hub.fail_with or 500, {"error": "FakeHub failure"})
                return
            status, reply, headers = self._route(path, body)
        if isinstance(reply, dict) and "Invalid rev id" in str(reply.get("error")):
            headers = {**headers, "X-Error-Code": "RevisionNotFound"}
        self._reply(status, reply, headers)

    def _route(self, path: str, body: bytes) -> tuple[int, Any, dict[str, str]]:
        if path == "/api/repos/create":
            return (*self.hub.create_repo(json.loads(body)), {})
        if path == "/api/validate-yaml":
            return 200, {}, {}
        match = _REPO_API.match(path) or _RESOLVE.match(path)
        if match is None:
            return 404, {"error": f"FakeHub has no route {path}"}, {}
        repo_id = match.group(1)
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            missing = {"X-Error-Code": "RepoNotFound"}
            return 404, {"error": "Repository not found"}, missing
        if _RESOLVE.match(path):
            return self._resolve(repo, unquote(match.group(2)), unquote(match.group(3)))
        action, rest = match.group(2), unquote(match.group(3))
        if action == "branch":
            return (*self.hub.create_branch(repo, rest), {})
        if action == "preupload":
            files = json.loads(body)["files"]
            modes = [
                {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files
            ]
            return 200, {"files": modes}, {}
        if action == "commit":
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            return (*self.hub.commit(repo_id, rest, lines), {})
        if action == "tree":
            return (*self.hub.tree(repo_id, rest), {})
        return (*self.hub.revision_info(repo_id, rest), {})

    def _resolve(self, repo: FakeRepo, rev: str, name: str) -> tuple[int, Any, dict]:
        branch = self.hub.branch_of(repo, rev)
        content = repo.branches.get(branch, {}).get(name)
        if content is None:
            return 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"}
        etag = f'"{hashlib.sha1(content).hexdigest()}"'
        commit = repo.heads.get(branch, "0" * 40)
        return 200, content, {"ETag": etag, "X-Repo-Commit": commit}

    def do_POST(self) -> None:
        self._handle()

    def do_GET(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self._handle()


def _handler_for(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_HubHandler,), {"hub": hub})
