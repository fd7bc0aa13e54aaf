"""A conversation exported as JSON (History.export_json) read back in as a new chat: to move chats
between machines, or restore one from a backup.

Everything is checked before anything is written (the format, each message, each image), so a
file that is refused leaves the history as it was.
"""
from __future__ import annotations

import base64
import binascii
import io
import json

from PIL import Image

from .history import DONE, ERROR, INTERRUPTED, STOPPED, ChatSettings, History

FORMAT = "localchat-conversation"
MAX_BYTES = 512 * 1024 * 1024  # an export with many embedded images is large, but not this large
_STATUSES = {DONE, STOPPED, INTERRUPTED, ERROR}


class ImportRejected(ValueError):
    """The file is not a conversation localchat can read; the message says why."""


def import_conversation(history: History, data: bytes) -> str:
    """Stores the exported conversation in `data` as a new chat; returns its id."""
    if len(data) > MAX_BYTES:
        raise ImportRejected(f"the file is {len(data) >> 20} MB; a conversation export is at most {MAX_BYTES >> 20} MB")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ImportRejected("the file is not JSON; choose a file made by the chat's Export JSON button") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ImportRejected("the file is JSON but not a localchat conversation (Export JSON makes those)")
    raw = doc.get("messages")
    if not isinstance(raw, list):
        raise ImportRejected("the conversation has no list of messages")
    messages = [_message(m, i, history) for i, m in enumerate(raw)]
    settings = ChatSettings.from_dict(doc.get("settings") if isinstance(doc.get("settings"), dict) else {})
    title = doc.get("title") if isinstance(doc.get("title"), str) and doc["title"].strip() else "Imported chat"
    cid = history.create(title=title, settings=settings)
    try:
        for role, text, reasoning, images, stats, status in messages:
            shas = [history.put_image(b) if isinstance(b, bytes) else b for b in images]
            history.add_message(cid, role, text, images=shas, reasoning=reasoning, stats=stats, status=status)
    except BaseException:
        history.delete(cid)
        raise
    return cid


def _message(m: object, i: int, history: History):
    """(role, text, reasoning, images as bytes or stored sha256, stats, status) of message i."""
    where = f"message {i + 1}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise ImportRejected(f"{where} is not a user or assistant message")
    # the model's own text (with its box tokens) where the export relabelled boxes
    text = m.get("raw_text", m.get("text", ""))
    reasoning = m.get("reasoning") or ""
    if not isinstance(text, str) or not isinstance(reasoning, str):
        raise ImportRejected(f"{where} has text that is not a string")
    stats = m.get("stats") if isinstance(m.get("stats"), dict) else {}
    status = m.get("status") if m.get("status") in _STATUSES else DONE
    refs = m.get("images") or []
    if not isinstance(refs, list):
        raise ImportRejected(f"{where} has a malformed image list")
    return m["role"], text, reasoning, [_image(ref, f"{where}, image {j + 1}", history) for j, ref in enumerate(refs)], \
        stats, status


def _image(ref: object, where: str, history: History):
    """The image's bytes from its data: URL, or the sha256 of a copy this history already holds."""
    if not isinstance(ref, dict):
        raise ImportRejected(f"{where} is malformed")
    url = ref.get("data_url")
    if isinstance(url, str) and url.startswith("data:") and ";base64," in url:
        try:
            data = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
            with Image.open(io.BytesIO(data)) as img:
                img.verify()
        except (binascii.Error, ValueError, OSError):
            raise ImportRejected(f"{where} is not a readable image") from None
        return data
    sha = ref.get("sha256")
    try:
        if isinstance(sha, str) and history.image_path(sha).exists():
            return sha
    except KeyError:
        pass
    raise ImportRejected(f"{where} is not in the file (it was exported without images) nor in this history; "
                         "export the chat again with its images")
