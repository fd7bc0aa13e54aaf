"""A stand-in for the Hugging Face Hub on 127.0.0.1, answering what huggingface_hub and our own
download loop ask for:

    GET  /api/models/{org}/{name}/revision/{rev}    -> {"id", "sha"}
    GET  /api/models/{org}/{name}/tree/{rev}?...      -> [{"type", "path", "size", "oid", "lfs"?}]
    GET  /{org}/{name}/resolve/{rev}/{path}          -> the bytes, honouring "Range: bytes=N-"

Errors carry the X-Error-Code header the real Hub sends (RepoNotFound, GatedRepo, EntryNotFound).
Faults for tests: `cut[path] = n` drops the connection after byte n (once), `stall[path] = (n, event)`
sends n bytes then waits for the event, `serve_instead[path] = bytes` serves other content than the
listing advertises. Every request is logged with its Range header and the body bytes it was sent.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    files: dict[str, bytes]
    sha: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False

    def is_lfs(self, path: str) -> bool:
        return path.endswith((".safetensors", ".bin"))

    def listing(self) -> list[dict]:
        out = []
        for path, data in sorted(self.files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": git_blob_sha1(data)}
            if self.is_lfs(path):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    auth: bool
    status: int = 0
    body_bytes: int = 0


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    tokens: set[str] = field(default_factory=lambda: {"hf_good_token"})
    cut: dict[str, int] = field(default_factory=dict)
    stall: dict[str, tuple[int, threading.Event]] = field(default_factory=dict)
    serve_instead: dict[str, bytes] = field(default_factory=dict)
    log: list[Logged] = field(default_factory=list)

    def add(self, repo: FakeRepo) -> FakeRepo:
        self.repos[repo.repo_id] = repo
        return repo

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        for _, event in self.stall.values():
            event.set()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def requests_for(self, path: str) -> list[Logged]:
        return [r for r in self.log if r.path.endswith("/" + path) and "/resolve/" in r.path]


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        import sys
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # clients drop connections on purpose
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        url = urlparse(self.path)
        entry = Logged(self.command, unquote(url.path), self.headers.get("Range"),
                       self.headers.get("Authorization") is not None)
        self.hub.log.append(entry)
        parts = unquote(url.path).strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo = self._repo("/".join(parts[2:4]), entry)
            if repo is None:
                return
            body = {"id": repo.repo_id, "sha": repo.sha} if parts[4] == "revision" else repo.listing()
            return self._json(200, body, entry)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]), entry)
            if repo is None:
                return
            if repo.gated and not self._authorized():
                code = 403 if self.headers.get("Authorization") else 401
                return self._error(code, "GatedRepo", f"Access to model {repo.repo_id} is restricted", entry)
            path = "/".join(parts[4:])
            if path not in repo.files:
                return self._error(404, "EntryNotFound", "Entry not found", entry)
            return self._file(repo, path, head, entry)
        self._error(404, None, "Not found", entry)

    def _authorized(self) -> bool:
        auth = self.headers.get("Authorization") or ""
        return auth.removeprefix("Bearer ").strip() in self.hub.tokens

    def _repo(self, repo_id: str, entry: Logged) -> FakeRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", entry)
        return repo

    def _json(self, status: int, body, entry: Logged) -> None:
        data = json.dumps(body).encode()
        entry.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str | None, message: str, entry: Logged) -> None:
        data = json.dumps({"error": message}).encode()
        entry.status = status
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _file(self, repo: FakeRepo, path: str, head: bool, entry: Logged) -> None:
        data = self.hub.serve_instead.get(path, repo.files[path])
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1])
        status = 206 if start else 200
        entry.status = status
        self.send_response(status)
        etag = hashlib.sha256(repo.files[path]).hexdigest() if repo.is_lfs(path) else git_blob_sha1(repo.files[path])
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        body = data[start:]
        if path in self.hub.cut:
            stop = self.hub.cut.pop(path) - start
            return self._send_then_drop(body[:max(0, stop)], entry, None)
        if path in self.hub.stall:
            n, event = self.hub.stall[path]
            return self._send_then_drop(body[:max(0, n - start)], entry, event)
        self.wfile.write(body)
        entry.body_bytes = len(body)

    def _send_then_drop(self, part: bytes, entry: Logged, event: threading.Event | None) -> None:
        self.wfile.write(part)
        self.wfile.flush()
        entry.body_bytes = len(part)
        if event is not None:
            event.wait(timeout=30)
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


from localchat.engine.model_configs import CONFIG_DIR as CONFIGS  # noqa: E402


def tiny_checkpoint(config_name: str = "gpt-oss-20b", seed: int = 0) -> dict[str, bytes]:
    """A small checkpoint with the shape of a real repo: the model's real config.json, two
    safetensors shards (about 3 MB and 1 MB) with an index, tokenizer/template files, and the
    `original/` and `metal/` folders and README a pull must skip."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    shard_a = save({"model.layers.0.mlp.experts.down_proj_blocks": torch.randint(0, 255, (768, 1024), generator=g, dtype=torch.uint8),
                    "model.embed_tokens.weight": torch.randn(512, 2048, generator=g).to(torch.bfloat16)})
    shard_b = save({"lm_head.weight": torch.randn(256, 2048, generator=g).to(torch.bfloat16)})
    names = ("model-00000-of-00001.safetensors", "model-00001-of-00001.safetensors")
    index = {"metadata": {"total_size": len(shard_a) + len(shard_b)},
             "weight_map": {"model.layers.0.mlp.experts.down_proj_blocks": names[0],
                            "model.embed_tokens.weight": names[0], "lm_head.weight": names[1]}}
    return {
        "config.json": (CONFIGS / f"{config_name}.json").read_bytes(),
        "generation_config.json": b'{"eos_token_id": [200002, 199999], "do_sample": true}',
        "tokenizer_config.json": b'{"model_max_length": 131072}',
        "chat_template.jinja": b"{% for m in messages %}{{ m.content }}{% endfor %}",
        names[0]: shard_a,
        names[1]: shard_b,
        "model.safetensors.index.json": json.dumps(index).encode(),
        "original/model.safetensors": b"\0" * 50_000,
        "metal/model.bin": b"\1" * 50_000,
        "README.md": b"# tiny\n",
    }


def isolate_hf_env(monkeypatch, tmp_path, hub: FakeHub | None = None):
    """A fresh HF cache and home, no token, online, pointed at `hub`. Returns the cache root."""
    import huggingface_hub.constants as hfc

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setattr(hfc, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", False)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if hub is not None:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
    return cache
