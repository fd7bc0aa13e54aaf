"""Fetch one file from `/resolve/` into the cache with an HTTP Range loop.

Bytes go, in order and unbuffered, to `blobs/<etag>.incomplete`, so after a cut, a crash or a killed
process that file is always a valid prefix: the next attempt (same call or a later process) asks
for `Range: bytes=<prefix>-` and never fetches those bytes again. huggingface_hub 2.4 dropped
cross-process resume (each process writes a uniquely named partial), hence this loop. The content
is hashed while it streams (the prefix is re-hashed from disk on resume) and only a file whose
sha256 (LFS) or git blob sha1 matches the Hub's listing is moved into place.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from huggingface_hub.utils import get_session, hf_raise_for_status

from .hub_cache import RemoteFile
from .hub_errors import ChecksumMismatch, DownloadFailed, httpx

HASH_READ_BYTES = 8 << 20
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
MAX_BACKOFF_S = 30.0


@dataclass
class Transfer:
    url: str
    file: RemoteFile
    partial: Path
    blob: Path
    headers: dict
    retries: int = 5
    backoff_s: float = 1.0
    timeout_s: float = 60.0


def hasher(f: RemoteFile):
    if f.sha256:
        return hashlib.sha256()
    # git blob id: sha1 over "blob <size>\0" + content (git-scm.com/book, "Git Objects").
    h = hashlib.sha1()
    h.update(b"blob %d\0" % f.size)
    return h


def _hash_prefix(path: Path, h) -> int:
    n = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_READ_BYTES):
            h.update(chunk)
            n += len(chunk)
    return n


class _Retry(Exception):
    pass


@dataclass
class _Stream:
    offset: int
    hasher: object


def fetch(t: Transfer, on_bytes: Callable[[int], None]) -> None:
    """Download t.file to t.blob, resuming t.partial. on_bytes(n) after every chunk written.

    Raises ChecksumMismatch (partial deleted), DownloadFailed (partial kept for the next run), or
    huggingface_hub's HTTP errors (401/403/404) for the caller to explain."""
    t.partial.parent.mkdir(parents=True, exist_ok=True)
    if t.partial.exists() and t.partial.stat().st_size > t.file.size:
        t.partial.unlink()  # not a prefix of this file
    h = hasher(t.file)
    state = _Stream(_hash_prefix(t.partial, h) if t.partial.exists() else 0, h)
    failures = 0
    while state.offset < t.file.size:
        before = state.offset
        try:
            _stream_once(t, state, on_bytes)
        except (httpx.TransportError, _Retry) as e:
            # Count consecutive attempts that made no progress; a long flaky transfer keeps going.
            failures = 1 if state.offset > before else failures + 1
            if failures > t.retries:
                raise DownloadFailed(
                    f"download of {t.file.path} stopped at {state.offset} of {t.file.size} bytes after "
                    f"{t.retries} retries ({e}); run the same command again to resume from there") from None
            time.sleep(min(MAX_BACKOFF_S, t.backoff_s * 2 ** (failures - 1)))
    digest = state.hasher.hexdigest()
    expected = t.file.sha256 or t.file.blob_id
    if digest != expected:
        t.partial.unlink(missing_ok=True)
        raise ChecksumMismatch(
            f"{t.file.path}: downloaded content does not match the Hub's checksum (expected {expected}, got "
            f"{digest}); the file was deleted and not used. Run the command again to download it afresh")
    t.partial.replace(t.blob)


def _stream_once(t: Transfer, state: _Stream, on_bytes) -> None:
    # identity: Range offsets must count the bytes of the file itself, not of a compressed stream.
    headers = {**t.headers, "Accept-Encoding": "identity"}
    if state.offset:
        headers["Range"] = f"bytes={state.offset}-"
    timeout = httpx.Timeout(t.timeout_s, connect=min(t.timeout_s, 20.0))
    with get_session().stream("GET", t.url, headers=headers, timeout=timeout, follow_redirects=True) as r:
        if r.status_code in RETRY_STATUS:
            raise _Retry(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            r.read()
            hf_raise_for_status(r)
        if state.offset and r.status_code != 206:  # the server ignored Range: start over
            t.partial.unlink(missing_ok=True)
            on_bytes(-state.offset)
            state.offset, state.hasher = 0, hasher(t.file)
        with open(t.partial, "ab") as out:
            # Chunks as they arrive (no re-chunking): a cut loses only bytes that never reached us.
            for chunk in r.iter_bytes():
                if state.offset + len(chunk) > t.file.size:
                    t.partial.unlink(missing_ok=True)
                    raise DownloadFailed(f"{t.file.path}: the server sent more than the listed {t.file.size} bytes")
                out.write(chunk)
                out.flush()  # on disk (in the OS) before it counts: the partial stays a valid prefix
                state.hasher.update(chunk)
                state.offset += len(chunk)
                on_bytes(len(chunk))
    if state.offset < t.file.size:
        raise _Retry(f"connection closed at byte {state.offset}")
