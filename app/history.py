"""Conversations on disk: SQLite (WAL) for text and settings, image files named by content hash.

Layout under the data dir (platformdirs user data dir unless `data_dir` is given):
    history.sqlite3            conversations, messages, message_images, images, schema_version
    images/<aa>/<sha256>.<ext> the image bytes exactly as sent to the engine

Durability: every write is its own committed transaction. In WAL mode with synchronous=NORMAL a
committed transaction survives the process being killed (it only risks the last commits on an OS
crash or power loss; see https://www.sqlite.org/wal.html "Durability"), so a kill -9 during
generation loses at most the answer being generated, and only the part after its last checkpoint.
"""
from __future__ import annotations

import base64
import hashlib
import io
import json
import sqlite3
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import platformdirs
from PIL import Image

from .defaults import ANSWER_TOKENS


SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    settings TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    text TEXT NOT NULL DEFAULT '',
    reasoning TEXT NOT NULL DEFAULT '',
    stats TEXT NOT NULL DEFAULT '{}',
    status TEXT NOT NULL DEFAULT 'done',
    created REAL NOT NULL,
    UNIQUE (conversation_id, position)
);
CREATE TABLE IF NOT EXISTS images (
    sha256 TEXT PRIMARY KEY,
    ext TEXT NOT NULL,
    size INTEGER NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS message_images (
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    sha256 TEXT NOT NULL REFERENCES images(sha256),
    PRIMARY KEY (message_id, idx)
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, position);
CREATE INDEX IF NOT EXISTS message_images_by_sha ON message_images(sha256);
"""

# Message status values. "partial": being generated (checkpointed text); at the next open a
# leftover "partial" row means the process died mid-answer and becomes "interrupted".
DONE, PARTIAL, STOPPED, INTERRUPTED, ERROR = "done", "partial", "stopped", "interrupted", "error"

_FRESH_IMAGE_S = 120.0
_IMAGE_EXT = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif", "BMP": "bmp"}


@dataclass
class ChatSettings:
    """Per-conversation settings; `reasoning_effort` is used by gpt-oss, `thinking` by GLM."""

    system_prompt: str = ""
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = ANSWER_TOKENS
    seed: int | None = None
    thinking: bool = True
    reasoning_effort: str = "medium"

    @classmethod
    def recommended(cls, sampling) -> "ChatSettings":
        """A new chat's settings: the model's recommended sampling (ModelInfo.sampling) where it
        has one, these defaults elsewhere."""
        known = {k: v for k, v in asdict(sampling).items() if v is not None and k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def from_dict(cls, d: dict) -> "ChatSettings":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class StoredMessage:
    id: int
    position: int
    role: str
    text: str
    reasoning: str
    images: list[str]  # sha256 of each image, in order
    stats: dict
    status: str
    created: float


@dataclass
class Conversation:
    id: str
    title: str
    created: float
    updated: float
    settings: ChatSettings
    messages: list[StoredMessage] = field(default_factory=list)


def default_data_dir() -> Path:
    return Path(platformdirs.user_data_dir("localchat", appauthor=False))


class History:
    """Thread-safe store shared by every browser tab; one connection guarded by a lock."""

    def __init__(self, data_dir: str | Path | None = None):
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.images_dir = self.data_dir / "images"
        self.images_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.data_dir / "history.sqlite3"
        self._lock = threading.RLock()
        # isolation_level=None: autocommit; multi-statement writes use explicit BEGIN/COMMIT.
        self._db = sqlite3.connect(self.db_path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._migrate()
        self._users, first_user = self._join_users()
        if first_user:
            self._db.execute("UPDATE messages SET status=? WHERE status=?", (INTERRUPTED, PARTIAL))

    def _join_users(self):
        """Holds a shared lock on history.lock for as long as this History is open, so that a
        leftover "partial" answer is called interrupted only by the first process to open the data
        dir: another localchat serving from the same dir (a second model, say) may be writing it
        right now. Returns (the lock file, None where file locks are missing; whether this is the
        first opener)."""
        try:
            import fcntl
        except ImportError:  # no POSIX file locks: every opener sweeps, as a single user would
            return None, True
        users = open(self.data_dir / "history.lock", "a+")
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            first = True
        except BlockingIOError:
            first = False
        fcntl.flock(users, fcntl.LOCK_SH)  # from exclusive: at once; else beside the other users
        return users, first

    def close(self) -> None:
        with self._lock:
            self._db.close()
            if self._users is not None:
                self._users.close()  # drops the lock

    def _migrate(self) -> None:
        with self._lock:
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT version FROM schema_version").fetchone()
            if row is None:
                self._db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            elif row["version"] > SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.db_path} was written by a newer localchat (schema {row['version']}, "
                    f"this one knows {SCHEMA_VERSION}); upgrade localchat or use another --data-dir."
                )
            # Later versions: `elif row["version"] < N: ALTER ...; UPDATE schema_version`.

    # ---- conversations -------------------------------------------------------------------

    def create(self, title: str = "New chat", settings: ChatSettings | None = None) -> str:
        cid = uuid.uuid4().hex
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT INTO conversations VALUES (?, ?, ?, ?, ?)",
                (cid, title, now, now, json.dumps(asdict(settings or ChatSettings()))),
            )
        return cid

    def exists(self, cid: str | None) -> bool:
        if not cid:
            return False
        with self._lock:
            return self._db.execute("SELECT 1 FROM conversations WHERE id=?", (cid,)).fetchone() is not None

    def rename(self, cid: str, title: str) -> None:
        title = title.strip() or "Untitled"
        with self._lock:
            self._db.execute("UPDATE conversations SET title=?, updated=? WHERE id=?", (title, time.time(), cid))

    def set_settings(self, cid: str, settings: ChatSettings) -> None:
        with self._lock:
            self._db.execute("UPDATE conversations SET settings=? WHERE id=?", (json.dumps(asdict(settings)), cid))

    def list(self, query: str = "", limit: int = 200) -> list[tuple[str, str, float]]:
        """(id, title, updated), newest first; `query` matches titles and message text, any case."""
        q = query.strip()
        with self._lock:
            if not q:
                rows = self._db.execute(
                    "SELECT id, title, updated FROM conversations ORDER BY updated DESC LIMIT ?", (limit,)
                ).fetchall()
            else:
                pattern = "%" + q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                rows = self._db.execute(
                    "SELECT id, title, updated FROM conversations c WHERE title LIKE ?1 ESCAPE '\\' "
                    "OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id=c.id AND "
                    "(m.text LIKE ?1 ESCAPE '\\')) ORDER BY updated DESC LIMIT ?2",
                    (pattern, limit),
                ).fetchall()
        return [(r["id"], r["title"], r["updated"]) for r in rows]

    def get(self, cid: str) -> Conversation:
        with self._lock:
            c = self._db.execute("SELECT * FROM conversations WHERE id=?", (cid,)).fetchone()
            if c is None:
                raise KeyError(f"no conversation {cid!r}")
            rows = self._db.execute(
                "SELECT * FROM messages WHERE conversation_id=? ORDER BY position", (cid,)
            ).fetchall()
            imgs: dict[int, list[str]] = {}
            for r in self._db.execute(
                "SELECT mi.message_id, mi.sha256 FROM message_images mi JOIN messages m ON m.id=mi.message_id "
                "WHERE m.conversation_id=? ORDER BY mi.message_id, mi.idx",
                (cid,),
            ):
                imgs.setdefault(r["message_id"], []).append(r["sha256"])
        messages = [
            StoredMessage(r["id"], r["position"], r["role"], r["text"], r["reasoning"], imgs.get(r["id"], []),
                          json.loads(r["stats"]), r["status"], r["created"])
            for r in rows
        ]
        return Conversation(c["id"], c["title"], c["created"], c["updated"],
                            ChatSettings.from_dict(json.loads(c["settings"])), messages)

    def delete(self, cid: str) -> None:
        """Delete a conversation, then every image file no other message refers to."""
        with self._lock:
            self._db.execute("DELETE FROM conversations WHERE id=?", (cid,))
            self._collect_images()

    def truncate(self, cid: str, position: int) -> None:
        """Drop messages at `position` and after (edit and retry continue from there)."""
        with self._lock:
            self._db.execute("DELETE FROM messages WHERE conversation_id=? AND position>=?", (cid, position))
            self._touch(cid)
            self._collect_images()

    # ---- messages ------------------------------------------------------------------------

    def add_message(self, cid: str, role: str, text: str, *, images: list[str] = (), reasoning: str = "",
                    stats: dict | None = None, status: str = DONE) -> int:
        """Append a message; `images` are sha256 values returned by `put_image`. Returns its id."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                pos = self._db.execute(
                    "SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id=?", (cid,)
                ).fetchone()[0]
                mid = self._db.execute(
                    "INSERT INTO messages (conversation_id, position, role, text, reasoning, stats, status, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (cid, pos, role, text, reasoning, json.dumps(stats or {}), status, time.time()),
                ).lastrowid
                self._db.executemany(
                    "INSERT INTO message_images VALUES (?, ?, ?)", [(mid, i, s) for i, s in enumerate(images)]
                )
                self._touch(cid)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return mid

    def edit_text(self, message_id: int, text: str) -> None:
        with self._lock:
            self._db.execute("UPDATE messages SET text=? WHERE id=?", (text, message_id))

    def begin_answer(self, cid: str) -> int:
        """Start an assistant answer (status "partial") that `checkpoint` and `finish_answer` update."""
        return self.add_message(cid, "assistant", "", status=PARTIAL)

    def checkpoint(self, message_id: int, text: str, reasoning: str) -> None:
        with self._lock:
            self._db.execute("UPDATE messages SET text=?, reasoning=? WHERE id=?", (text, reasoning, message_id))

    def finish_answer(self, message_id: int, text: str, reasoning: str, stats: dict, status: str = DONE) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE messages SET text=?, reasoning=?, stats=?, status=? WHERE id=?",
                (text, reasoning, json.dumps(stats), status, message_id),
            )

    # ---- images --------------------------------------------------------------------------

    def put_image(self, data: bytes) -> str:
        """Store encoded image bytes once per content hash; returns the sha256 hex digest."""
        sha = hashlib.sha256(data).hexdigest()
        with self._lock:
            if self._db.execute("SELECT 1 FROM images WHERE sha256=?", (sha,)).fetchone():
                if self.image_path(sha).exists():
                    return sha
            with Image.open(io.BytesIO(data)) as img:
                ext, (w, h) = _IMAGE_EXT.get(img.format or "", "img"), img.size
            path = self.images_dir / sha[:2] / f"{sha}.{ext}"
            path.parent.mkdir(exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # atomic: a killed write never leaves a truncated image under its hash
            self._db.execute("INSERT OR REPLACE INTO images VALUES (?, ?, ?, ?, ?)", (sha, ext, len(data), w, h))
        return sha

    def image_path(self, sha: str) -> Path:
        with self._lock:
            row = self._db.execute("SELECT ext FROM images WHERE sha256=?", (sha,)).fetchone()
        if row is None:
            raise KeyError(f"no image {sha}")
        return self.images_dir / sha[:2] / f"{sha}.{row['ext']}"

    def _collect_images(self) -> None:
        rows = self._db.execute(
            "SELECT sha256, ext FROM images WHERE sha256 NOT IN (SELECT sha256 FROM message_images)"
        ).fetchall()
        for r in rows:
            path = self.images_dir / r["sha256"][:2] / f"{r['sha256']}.{r['ext']}"
            # Another tab may have stored this image a moment ago and not yet added its message.
            if path.exists() and time.time() - path.stat().st_mtime < _FRESH_IMAGE_S:
                continue
            path.unlink(missing_ok=True)
            self._db.execute("DELETE FROM images WHERE sha256=?", (r["sha256"],))

    def _touch(self, cid: str) -> None:
        self._db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), cid))

    # ---- export --------------------------------------------------------------------------

    def export_json(self, cid: str, *, embed_images: bool = True) -> str:
        """The whole conversation as JSON; images inline as data: URLs unless `embed_images` is off.

        GLM grounding boxes read as in the chat: "[box N]" in `text`, and `boxes` lists each
        label's [x1, y1, x2, y2] on the model's 0..1000 image grid; `raw_text` keeps the model's
        own box tokens when they differ."""
        from localchat.app.ui_boxes import box_coordinates, label_answer

        conv = self.get(cid)
        messages = []
        for m in conv.messages:
            msg = {"role": m.role, "text": m.text, "reasoning": m.reasoning, "status": m.status,
                   "stats": m.stats, "created": m.created,
                   "images": [self._image_ref(s, embed_images) for s in m.images]}
            if m.role == "assistant":
                text, boxes = label_answer(m.text)
                if text != m.text:
                    msg.update(text=text, raw_text=m.text)
                if boxes:
                    msg["boxes"] = [{"label": f"box {n}", "xyxy_0_1000": box_coordinates(b)}
                                    for n, b in enumerate(boxes, 1)]
            messages.append(msg)
        out = {
            "format": "localchat-conversation", "version": SCHEMA_VERSION, "id": conv.id,
            "title": conv.title, "created": conv.created, "updated": conv.updated,
            "settings": asdict(conv.settings), "messages": messages,
        }
        return json.dumps(out, ensure_ascii=False, indent=2)

    def export_markdown(self, cid: str, *, embed_images: bool = True) -> str:
        """Readable Markdown; reasoning goes into a collapsed <details> block (GitHub renders it).
        Grounding boxes read "[box N]" as in the chat, with their coordinates listed below."""
        from localchat.app.ui_boxes import box_coordinates, label_answer

        conv = self.get(cid)
        lines = [f"# {conv.title}", ""]
        if conv.settings.system_prompt:
            lines += ["> **System:** " + conv.settings.system_prompt.replace("\n", "\n> "), ""]
        for m in conv.messages:
            lines += [f"## {'User' if m.role == 'user' else 'Assistant'}", ""]
            for i, sha in enumerate(m.images):
                ref = self._image_ref(sha, embed_images)
                lines += [f"![image {i + 1}]({ref.get('data_url') or ref['file']})", ""]
            if m.reasoning:
                lines += ["<details><summary>Thinking</summary>", "", m.reasoning, "", "</details>", ""]
            text, boxes = label_answer(m.text) if m.role == "assistant" else (m.text, [])
            lines += [text, ""]
            if boxes:
                lines += ["Boxes, as [x1, y1, x2, y2] on a 0–1000 grid over the image:", ""]
                lines += [f"- box {n}: {box_coordinates(b)}" for n, b in enumerate(boxes, 1)] + [""]
            if m.status not in (DONE,):
                lines += [f"*({m.status})*", ""]
        return "\n".join(lines)

    def _image_ref(self, sha: str, embed: bool) -> dict:
        path = self.image_path(sha)
        ref = {"sha256": sha, "file": path.name}
        if embed:
            mime = "image/jpeg" if path.suffix == ".jpg" else f"image/{path.suffix.lstrip('.')}"
            ref["data_url"] = f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()
        return ref
