"""Getting a model onto this machine: `ensure_local(model) -> Path` of a checkpoint directory.

A local directory is used as it is. A registry name or Hub repo id is looked up in the standard
Hugging Face cache first: when the cached snapshot of the revision is complete, nothing touches
the network. Otherwise the repo's file listing comes from the Hub (huggingface_hub's HfApi), only
the root HF-format files are fetched (hub_transfer: resumable, verified), and each finished file
is linked into `snapshots/<sha>/`. Offline (`offline=True` or HF_HUB_OFFLINE=1) uses the cache only
and names exactly what is missing.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from filelock import FileLock
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils import tqdm as hf_tqdm

from .hub_cache import CachedRepo, RemoteFile, free_disk_bytes, human_bytes
from .hub_errors import (AccessDenied, ChecksumMismatch, DownloadFailed, HubError, HubUnreachable, ModelNotFound,
                         NotEnoughDisk, OfflineMissing, explain)
from .hub_transfer import Transfer, fetch, hasher
from .registry import ModelSource, resolve

__all__ = ["ensure_local", "sync", "DownloadProgress", "SyncResult", "HubError", "ModelNotFound",
           "AccessDenied", "NotEnoughDisk", "OfflineMissing", "HubUnreachable", "ChecksumMismatch",
           "DownloadFailed", "is_offline", "cached_status"]


class _Cancelled(Exception):
    pass


@dataclass(frozen=True)
class DownloadProgress:
    """Sent about every MiB of a file and when it completes: bytes of `file` done/total, and of the
    whole pull (files already cached count as done)."""

    file: str
    done: int
    total: int
    overall_done: int
    overall_total: int
    files_done: int
    files_total: int


@dataclass
class SyncResult:
    path: Path
    repo_id: str | None = None
    sha: str | None = None
    files: list[str] = field(default_factory=list)
    fetched_bytes: int = 0
    total_bytes: int = 0
    from_cache: bool = False


def is_offline(offline: bool | None = None) -> bool:
    if offline is not None:
        return offline
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def ensure_local(model: str, *, offline: bool | None = None, token: str | bool | None = None,
                 on_progress: Callable[[DownloadProgress], None] | None = None, **kwargs) -> Path:
    """The checkpoint directory of `model`, downloading what is missing. See `sync` for kwargs."""
    return sync(model, offline=offline, token=token, on_progress=on_progress, **kwargs).path


def sync(model: str, *, offline: bool | None = None, token: str | bool | None = None,
         on_progress: Callable[[DownloadProgress], None] | None = None, revision: str | None = None,
         endpoint: str | None = None, refresh: bool = False, verify: bool = False, progress_bar: bool = True,
         max_workers: int = 4, retries: int = 5, backoff_s: float = 1.0) -> SyncResult:
    """refresh: ask the Hub for the revision's current commit even when a complete snapshot is cached.
    verify: re-hash the cached files against the listing and fetch again any that do not match."""
    src = resolve(model)
    if src.local_path is not None:
        return SyncResult(src.local_path, from_cache=True)
    cache = CachedRepo.of(src.repo_id)
    rev = revision or src.revision or "main"
    offline = is_offline(offline)
    refresh = refresh and not offline
    sha = rev if _is_commit(rev) else cache.read_ref(rev)
    if sha and not refresh:
        tree = cache.read_tree(sha)
        if verify and tree is not None:
            _drop_corrupt(cache, sha, [f for f in tree if src.wants(f.path)])
            verify = False  # done: what it dropped is now missing and fetched below
        missing = _missing(cache, sha, src, tree)
        if not missing:
            names = [f.path for f in tree if src.wants(f.path)] if tree else []
            return SyncResult(cache.snapshot(sha), src.repo_id, sha, names, from_cache=True)
        if offline:
            raise OfflineMissing(
                f"offline: the cached {src.name} (snapshot {sha[:12]} in {cache.folder}) is missing "
                f"{len(missing)} file(s): {_names(missing)}. Connect and run `localchat pull {src.name}`")
    elif offline:
        raise OfflineMissing(
            f"offline: {src.name} ({src.repo_id}, revision {rev}) is not in the cache at {cache.root}. "
            f"Connect and run `localchat pull {src.name}`, or point HF_HUB_CACHE/HF_HOME at a cache that has it")
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    sha, tree = _listing(src, rev, endpoint, token)
    cache.write_tree(sha, tree)
    cache.write_ref(rev, sha)
    wanted = [f for f in tree if src.wants(f.path)]
    if not any(f.path.endswith(".safetensors") for f in wanted):
        raise ModelNotFound(f"{src.repo_id} has no .safetensors weights at its root: localchat loads Hugging Face "
                            "format safetensors checkpoints only")
    if verify:
        _drop_corrupt(cache, sha, wanted)
    todo = []
    for f in wanted:
        if cache.has(sha, f):
            continue
        if cache.blob(f.etag).is_file() and cache.blob(f.etag).stat().st_size == f.size:
            cache.link(sha, f)  # same content already cached for another revision
        else:
            todo.append(f)
    _check_disk(src, cache, todo)
    reporter = _Reporter(wanted, {f.path for f in todo}, cache, on_progress, progress_bar, src.name)
    try:
        _download_all(src, cache, sha, todo, endpoint, token, reporter, max_workers, retries, backoff_s)
    finally:
        reporter.close()
    return SyncResult(cache.snapshot(sha), src.repo_id, sha, [f.path for f in wanted],
                      reporter.fetched, sum(f.size for f in wanted), from_cache=not todo)


def cached_status(model: str | ModelSource) -> tuple[CachedRepo, str | None, list[str]]:
    """(cache entry, sha of the revision or None, missing file names), without touching the network."""
    src = model if isinstance(model, ModelSource) else resolve(model)
    if src.local_path is not None:
        raise HubError(f"{src.local_path} is a local directory, not a cached model")
    cache = CachedRepo.of(src.repo_id)
    sha = cache.read_ref(src.revision or "main")
    if sha is None:
        return cache, None, []
    return cache, sha, _missing(cache, sha, src, cache.read_tree(sha))


def _is_commit(rev: str) -> bool:
    return len(rev) == 40 and all(c in "0123456789abcdef" for c in rev)


def _names(paths: list[str], limit: int = 8) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _missing(cache: CachedRepo, sha: str, src: ModelSource, tree: list[RemoteFile] | None) -> list[str]:
    """Files of the snapshot that are absent or of the wrong size. Without a stored listing
    (a cache written by an older huggingface_hub) the config and the shards its index names."""
    if tree is not None:
        return [f.path for f in tree if src.wants(f.path) and not cache.has(sha, f)]
    snap = cache.snapshot(sha)
    missing = [] if (snap / "config.json").is_file() else ["config.json"]
    index = snap / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing += [s for s in shards if not (snap / s).is_file()]
    elif not list(snap.glob("*.safetensors")):
        missing.append("*.safetensors")
    return missing


def _drop_corrupt(cache: CachedRepo, sha: str, files: list[RemoteFile]) -> list[str]:
    bad = []
    for f in files:
        path = cache.snapshot(sha) / f.path
        if not cache.has(sha, f):
            continue
        h = hasher(f)
        with open(path, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        if h.hexdigest() != (f.sha256 or f.blob_id):
            bad.append(f.path)
            cache.blob(f.etag).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
    return bad


def _listing(src: ModelSource, rev: str, endpoint: str, token) -> tuple[str, list[RemoteFile]]:
    api = HfApi(endpoint=endpoint, library_name="localchat")
    try:
        sha = api.repo_info(src.repo_id, revision=rev, token=token).sha
        entries = api.list_repo_tree(src.repo_id, revision=sha, recursive=True, token=token)
        tree = [RemoteFile(e.path, e.lfs.size if e.lfs else e.size, e.blob_id, e.lfs.sha256 if e.lfs else None)
                for e in entries if isinstance(e, RepoFile)]
    except HubError:
        raise
    except Exception as e:
        raise explain(e, src, endpoint, token) from None
    return sha, tree


def _check_disk(src: ModelSource, cache: CachedRepo, todo: list[RemoteFile]) -> None:
    partial = {f.path: cache.partial(f.etag).stat().st_size if cache.partial(f.etag).is_file() else 0 for f in todo}
    need = sum(max(0, f.size - partial[f.path]) for f in todo)
    free = free_disk_bytes(cache.folder)
    if need > free:
        raise NotEnoughDisk(
            f"not enough disk space for {src.name}: {human_bytes(need)} more are needed in {cache.root} but only "
            f"{human_bytes(free)} are free. Free some space (`localchat rm MODEL`), or set HF_HUB_CACHE to a larger disk")


def _download_all(src, cache, sha, todo, endpoint, token, reporter, max_workers, retries, backoff_s) -> None:
    if not todo:
        return
    headers = build_hf_headers(token=token, library_name="localchat")
    cancel = threading.Event()

    def one(f: RemoteFile) -> None:
        if cancel.is_set():
            raise _Cancelled()
        try:
            one_file(f)
        except BaseException:
            cancel.set()  # one failure stops the rest: queued files do not start, running ones stop
            raise

    def one_file(f: RemoteFile) -> None:
        lock = cache.lock_file(f.etag)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(lock)):
            blob = cache.blob(f.etag)
            if not (blob.is_file() and blob.stat().st_size == f.size):  # another process may have finished it
                def on_bytes(n: int) -> None:
                    if cancel.is_set():
                        raise _Cancelled()
                    reporter.add(f, n)
                url = hf_hub_url(src.repo_id, f.path, revision=sha, endpoint=endpoint)
                fetch(Transfer(url, f, cache.partial(f.etag), blob, headers, retries, backoff_s), on_bytes)
            cache.link(sha, f)
        reporter.done(f)

    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo))))
    try:
        futures = [pool.submit(one, f) for f in todo]
        wait(futures, return_when=FIRST_EXCEPTION)
        if cancel.is_set():
            for fu in futures:
                fu.cancel()
        wait(futures)
    except BaseException:
        cancel.set()  # Ctrl-C: workers stop at their next chunk, partials stay for a resume
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    errors = [fu.exception() for fu in futures if not fu.cancelled() and fu.exception()]
    errors = [e for e in errors if not isinstance(e, _Cancelled)]
    if errors:
        first = next((e for e in errors if isinstance(e, (HfHubHTTPError, ChecksumMismatch))), errors[0])
        raise first if isinstance(first, HubError) else explain(first, src, endpoint, token)


class _Reporter:
    """One overall terminal bar plus one bar per active file, and the `on_progress` callback
    (at most one event per EVENT_BYTES of a file, and one when it completes)."""

    EVENT_BYTES = 1 << 20

    def __init__(self, wanted, todo_paths, cache, on_progress, bar: bool, name: str):
        self._lock = threading.Lock()
        self._callback = on_progress
        self._bar = bar and bool(todo_paths)
        self._bars: dict[str, object] = {}
        self._done = {}
        for f in wanted:
            partial = cache.partial(f.etag)
            self._done[f.path] = (partial.stat().st_size if partial.is_file() else 0) if f.path in todo_paths else f.size
        self._pending = dict.fromkeys(self._done, 0)
        self._total = sum(f.size for f in wanted)
        self._overall_done = sum(self._done.values())
        self._files_total = len(wanted)
        self._files_done = self._files_total - len(todo_paths)
        self.fetched = 0
        self._overall = hf_tqdm(total=self._total, initial=self._overall_done, unit="B", unit_scale=True,
                                unit_divisor=1024, desc=name, disable=None if self._bar else True)

    def add(self, f: RemoteFile, n: int) -> None:
        with self._lock:
            self._done[f.path] += n
            self._overall_done += n
            self.fetched += n
            self._overall.update(n)
            if self._bar and f.path not in self._bars:
                self._bars[f.path] = hf_tqdm(total=f.size, initial=self._done[f.path] - n, unit="B", unit_scale=True,
                                             unit_divisor=1024, desc=f"  {f.path}", leave=False, disable=None)
            if f.path in self._bars:
                self._bars[f.path].update(n)
            self._pending[f.path] += n
            if self._callback is None or self._pending[f.path] < self.EVENT_BYTES:
                return
            self._pending[f.path] = 0
            event = self._event(f)
        self._callback(event)

    def done(self, f: RemoteFile) -> None:
        with self._lock:
            self._files_done += 1
            bar = self._bars.pop(f.path, None)
            if bar is not None:
                bar.close()
            event = self._event(f)
        if self._callback:
            self._callback(event)

    def _event(self, f: RemoteFile) -> DownloadProgress:
        return DownloadProgress(f.path, self._done[f.path], f.size, self._overall_done, self._total,
                                self._files_done, self._files_total)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._overall.close()
