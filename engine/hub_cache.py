"""The standard Hugging Face cache layout, so that models pulled here are found by `hf`, transformers
and any other tool, and models they pulled are found here.

    <cache>/models--org--name/refs/<revision>            the commit sha a branch/tag points at
    <cache>/models--org--name/blobs/<etag>               file contents (etag: sha256 for LFS files,
                                                         git blob sha1 otherwise)
    <cache>/models--org--name/blobs/<etag>.incomplete    a download in progress (kept for resume)
    <cache>/models--org--name/snapshots/<sha>/<path>     relative symlink to ../../blobs/<etag>
    <cache>/models--org--name/trees/<sha>.json           the repo's file listing at that commit
    <cache>/.locks/models--org--name/<etag>.lock         one writer per blob

(huggingface.co/docs/huggingface_hub/guides/manage-cache; the trees/ listing format is the one
huggingface_hub 2.4 writes: {"format_version": 1, "files": {path: {size, blob_id, lfs_sha256?,
lfs_size?}}}.) The cache root follows HF_HUB_CACHE, then HF_HOME/hub, read at call time.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

TREE_FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".incomplete"


def cache_root() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a repo at a commit. sha256 is set for LFS files (the Hub's LFS oid)."""

    path: str
    size: int
    blob_id: str
    sha256: str | None = None

    @property
    def etag(self) -> str:
        return self.sha256 or self.blob_id

    def to_json(self) -> dict:
        info = {"size": self.size, "blob_id": self.blob_id}
        if self.sha256:
            info.update(lfs_sha256=self.sha256, lfs_size=self.size)
        return info

    @classmethod
    def from_json(cls, path: str, info: dict) -> "RemoteFile":
        return cls(path, int(info.get("lfs_size") or info["size"]), info["blob_id"], info.get("lfs_sha256"))


@dataclass(frozen=True)
class CachedRepo:
    repo_id: str
    root: Path

    @classmethod
    def of(cls, repo_id: str, root: Path | None = None) -> "CachedRepo":
        return cls(repo_id, Path(root) if root else cache_root())

    @property
    def folder(self) -> Path:
        return self.root / ("models--" + self.repo_id.replace("/", "--"))

    def snapshot(self, sha: str) -> Path:
        return self.folder / "snapshots" / sha

    def blob(self, etag: str) -> Path:
        return self.folder / "blobs" / etag

    def partial(self, etag: str) -> Path:
        return self.folder / "blobs" / (etag + PARTIAL_SUFFIX)

    def lock_file(self, etag: str) -> Path:
        return self.root / ".locks" / self.folder.name / (etag + ".lock")

    def read_ref(self, revision: str) -> str | None:
        ref = self.folder / "refs" / revision
        return (ref.read_text().strip() or None) if ref.is_file() else None

    def write_ref(self, revision: str, sha: str) -> None:
        if revision != sha:
            _atomic_write(self.folder / "refs" / revision, sha)

    def read_tree(self, sha: str) -> list[RemoteFile] | None:
        try:
            data = json.loads((self.folder / "trees" / f"{sha}.json").read_text())
            if data.get("format_version") != TREE_FORMAT_VERSION:
                return None
            return [RemoteFile.from_json(p, info) for p, info in data["files"].items()]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_tree(self, sha: str, files: list[RemoteFile]) -> None:
        data = {"format_version": TREE_FORMAT_VERSION, "files": {f.path: f.to_json() for f in sorted(files, key=lambda f: f.path)}}
        _atomic_write(self.folder / "trees" / f"{sha}.json", json.dumps(data, indent=1))

    def has(self, sha: str, f: RemoteFile) -> bool:
        """The snapshot holds the file at the right size (following the symlink to its blob)."""
        try:
            return (self.snapshot(sha) / f.path).stat().st_size == f.size
        except OSError:
            return False

    def link(self, sha: str, f: RemoteFile) -> Path:
        """Point snapshots/<sha>/<path> at the blob (relative symlink, as huggingface_hub does)."""
        dest = self.snapshot(sha) / f.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        blob = self.blob(f.etag)
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        try:
            dest.symlink_to(os.path.relpath(blob, dest.parent))
        except OSError:  # file systems without symlinks: a hard link, else a copy
            try:
                os.link(blob, dest)
            except OSError:
                shutil.copyfile(blob, dest)
        return dest

    def size_on_disk(self) -> int:
        blobs = self.folder / "blobs"
        return sum(p.stat().st_size for p in blobs.iterdir() if p.is_file()) if blobs.is_dir() else 0

    def partial_bytes(self) -> int:
        blobs = self.folder / "blobs"
        return sum(p.stat().st_size for p in blobs.glob("*" + PARTIAL_SUFFIX)) if blobs.is_dir() else 0

    def snapshots(self) -> list[str]:
        snaps = self.folder / "snapshots"
        return sorted(p.name for p in snaps.iterdir() if p.is_dir()) if snaps.is_dir() else []

    def refs(self) -> dict[str, str]:
        refs = self.folder / "refs"
        if not refs.is_dir():
            return {}
        return {str(p.relative_to(refs)): p.read_text().strip() for p in refs.rglob("*") if p.is_file()}

    def remove(self) -> int:
        """Delete the repo from the cache; returns the bytes freed."""
        freed = self.size_on_disk()
        shutil.rmtree(self.folder, ignore_errors=True)
        shutil.rmtree(self.root / ".locks" / self.folder.name, ignore_errors=True)
        return freed


def cached_repos(root: Path | None = None) -> list[CachedRepo]:
    root = Path(root) if root else cache_root()
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.glob("models--*")):
        parts = d.name[len("models--"):].split("--")
        if d.is_dir() and len(parts) >= 2:
            out.append(CachedRepo(parts[0] + "/" + "--".join(parts[1:]), root))
    return out


def human_bytes(n: int) -> str:
    """Decimal units, as disks and the Hub report sizes."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def free_disk_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or would, once created)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
