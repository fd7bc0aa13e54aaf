"""Getting a model onto this machine: `ensure_local(model) -> Path` of a checkpoint directory.

A local directory is used as it is. A registry name or Hub repo id is looked up in the standard
Hugging Face cache first: when the cached snapshot of the revision is complete, nothing touches
the network. Otherwise the repo's file listing comes from the Hub (huggingface_hub's HfApi), only
the root HF-format files are fetched (hub_transfer: resumable, verified), and each finished file
is linked into `snapshots/<sha>/`. Offline (`offline=True` or HF_HUB_OFFLINE=1) uses the cache only
and names exactly what is missing.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from filelock import FileLock
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                    RepositoryNotFoundError, RevisionNotFoundError)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, get_token
from huggingface_hub.utils import tqdm as hf_tqdm

from .hub_cache import CachedRepo, RemoteFile, free_disk_bytes, human_bytes
from .hub_transfer import ChecksumMismatch, DownloadFailed, HubError, Transfer, _httpx, _hasher, fetch
from .registry import ModelSource, known_names, resolve

__all__ = ["ensure_local", "sync", "DownloadProgress", "SyncResult", "HubError", "ModelNotFound",
           "AccessDenied", "NotEnoughDisk", "OfflineMissing", "HubUnreachable", "ChecksumMismatch",
           "DownloadFailed", "is_offline", "cached_status"]


class ModelNotFound(HubError):
    pass


class AccessDenied(HubError):
    pass


class NotEnoughDisk(HubError):
    pass


class OfflineMissing(HubError):
    pass


class HubUnreachable(HubError):
    pass


class _Cancelled(Exception):
    pass


@dataclass(frozen=True)
class DownloadProgress:
    """Sent after every chunk: bytes of `file` done/total, and of the whole pull."""

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
    sha = rev if _is_commit(rev) else cache.read_ref(rev)
    if sha and not refresh:
        tree = cache.read_tree(sha)
        if verify and tree is not None:
            _drop_corrupt(cache, sha, [f for f in tree if src.wants(f.path)])
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


def cached_status(model: str) -> tuple[CachedRepo, str | None, list[str]]:
    """(cache entry, sha of main or None, missing file names) without touching the network."""
    src = resolve(model)
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
    import json
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
        h = _hasher(f)
        with open(path, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        if h.hexdigest() != (f.sha256 or f.blob_id):
            bad.append(f.path)
            cache.blob(f.etag).unlink(missing_ok=True)
            path.unlink(missing_ok=True)
    return bad


def _token_in_use(token: str | bool | None) -> str | None:
    if token is False:
        return None
    return token if isinstance(token, str) else get_token()


def _explain(e: Exception, src: ModelSource, endpoint: str, token: str | bool | None) -> HubError:
    """huggingface_hub / transport errors -> one message saying what to do."""
    repo, page = src.repo_id, f"{endpoint}/{src.repo_id}"
    logged_in = _token_in_use(token) is not None
    login = "run `hf auth login` (or set HF_TOKEN) and try again"
    if isinstance(e, GatedRepoError):
        if logged_in:
            return AccessDenied(f"{repo} is gated and your token has no access yet: open {page}, accept the "
                                f"license there with the account of your token, then try again")
        return AccessDenied(f"{repo} is gated: open {page}, sign in and accept the license, then {login}")
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFound(f"{repo} has no revision {src.revision or 'main'!r}")
    if isinstance(e, RepositoryNotFoundError):
        private = "" if logged_in else f"; if it is private or gated, {login}"
        return ModelNotFound(f"model repo {repo!r} was not found on {endpoint}{private}. "
                             f"Known models: {known_names()}")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status in (401, 403):
        return AccessDenied(f"the Hub refused access to {repo} (HTTP {status}): if it is gated, accept the "
                            f"license at {page}; then {login}")
    if isinstance(e, HfHubHTTPError):
        return HubError(f"the Hub answered HTTP {status} for {repo}: {str(e).strip().splitlines()[0]}")
    if isinstance(e, OfflineModeIsEnabled):
        return OfflineMissing(f"offline mode is on (HF_HUB_OFFLINE) and {src.name} is not complete in the cache")
    if isinstance(e, (_httpx.TransportError, OSError)):
        return HubUnreachable(f"cannot reach {endpoint} ({type(e).__name__}: {e}); check the network, or run "
                              f"offline from the cache (--offline) after a completed pull")
    return HubError(f"{repo}: {e}")


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
        raise _explain(e, src, endpoint, token) from None
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
        if any(fu.done() and fu.exception() for fu in futures):
            cancel.set()
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
        raise first if isinstance(first, HubError) else _explain(first, src, endpoint, token)


class _Reporter:
    """One overall terminal bar plus one bar per active file, and the `on_progress` callback."""

    def __init__(self, wanted, todo_paths, cache, on_progress, bar: bool, name: str):
        self._lock = threading.Lock()
        self._sizes = {f.path: f.size for f in wanted}
        self._done = {f.path: (f.size if f.path not in todo_paths else
                               (cache.partial(f.etag).stat().st_size if cache.partial(f.etag).is_file() else 0))
                      for f in wanted}
        self._files_done = sum(1 for f in wanted if f.path not in todo_paths)
        self._callback = on_progress
        self._bar = bar and bool(todo_paths)
        self._bars: dict[str, object] = {}
        self.fetched = 0
        total = sum(self._sizes.values())
        self._overall = hf_tqdm(total=total, initial=sum(self._done.values()), unit="B", unit_scale=True,
                                unit_divisor=1024, desc=f"{name}", disable=None if self._bar else True)

    def add(self, f: RemoteFile, n: int) -> None:
        with self._lock:
            self._done[f.path] += n
            self.fetched += n
            self._overall.update(n)
            if self._bar and f.path not in self._bars:
                self._bars[f.path] = hf_tqdm(total=f.size, initial=self._done[f.path] - n, unit="B", unit_scale=True,
                                             unit_divisor=1024, desc=f"  {f.path}", leave=False, disable=None)
            if f.path in self._bars:
                self._bars[f.path].update(n)
            event = DownloadProgress(f.path, self._done[f.path], f.size, sum(self._done.values()),
                                     sum(self._sizes.values()), self._files_done, len(self._sizes))
        if self._callback:
            self._callback(event)

    def done(self, f: RemoteFile) -> None:
        with self._lock:
            self._files_done += 1
            bar = self._bars.pop(f.path, None)
            if bar is not None:
                bar.close()
            event = DownloadProgress(f.path, f.size, f.size, sum(self._done.values()), sum(self._sizes.values()),
                                     self._files_done, len(self._sizes))
        if self._callback:
            self._callback(event)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()
        self._overall.close()
