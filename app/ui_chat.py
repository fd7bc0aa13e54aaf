"""Event handlers of the chat page, kept apart from the layout in ui.py.

Source of truth is History: handlers write there, then re-render the chatbot from it. `send`,
`edit` and `retry` only prepare the stored conversation and return `pending=True`; `generate`
(chained after them) streams the answer. Stop closes the session's engine stream directly, so the
engine aborts within a step even while the generator thread is blocked waiting for a token.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from dataclasses import replace

import gradio as gr

from localchat.app.history import DONE, ERROR, PARTIAL, STOPPED, ChatSettings, History, StoredMessage
from localchat.app.history_import import ImportRejected, import_conversation
from localchat.app.ui_frames import frames
from localchat.app.ui_images import ImageLimits, ImageRejected, check_count, prepare_images
from localchat.app.ui_render import answer_stats, render
from localchat.engine.runtime.request import (
    ChatEngine, ChatRequest, Final, ImagePart, Message, SamplingParams, TextPart,
)

CHECKPOINT_S = 0.5  # partial answers reach the database at least this often
SETTINGS_FIELDS = ("system_prompt", "temperature", "top_p", "top_k", "max_tokens", "seed",
                   "thinking", "reasoning_effort")


def max_answer_tokens(info) -> int:
    """The top of the page's answer-budget slider: the context, at most 32768."""
    return min(32768, info.context_length)


class ChatController:
    def __init__(self, engine: ChatEngine, history: History, limits: ImageLimits = ImageLimits()):
        self.engine, self.history, self.limits = engine, history, limits
        self.info = engine.info()
        # what a new chat starts from; its answer budget within the slider's range (the context)
        recommended = ChatSettings.recommended(self.info.sampling)
        self.defaults = replace(recommended, max_tokens=min(recommended.max_tokens, max_answer_tokens(self.info)))
        self._active: dict[str, object] = {}  # session hash -> engine stream being generated
        self._lock = threading.Lock()

    # ---- helpers -------------------------------------------------------------------------

    def _rendered(self, cid: str | None) -> list[dict]:
        if not self.history.exists(cid):
            return []
        return render(self.history.get(cid).messages, self.history)[0]

    def conversation_choices(self, query: str = "") -> list[tuple[str, str]]:
        return [(title, cid) for cid, title, _ in self.history.list(query)]

    def _list_update(self, cid: str | None, query: str = ""):
        return gr.Radio(choices=self.conversation_choices(query), value=cid)

    @staticmethod
    def settings_from(values) -> ChatSettings:
        d = dict(zip(SETTINGS_FIELDS, values))
        seed = d["seed"]
        return ChatSettings(system_prompt=d["system_prompt"] or "", temperature=float(d["temperature"]),
                            top_p=float(d["top_p"]), top_k=int(d["top_k"]), max_tokens=int(d["max_tokens"]),
                            seed=None if seed in (None, "") or int(seed) < 0 else int(seed),
                            thinking=bool(d["thinking"]), reasoning_effort=d["reasoning_effort"] or "medium")

    def settings_values(self, s: ChatSettings) -> list:
        """The settings widgets' values; a stored answer budget above the slider's range (a chat
        from a longer context) shows at its top."""
        return [s.system_prompt, s.temperature, s.top_p, s.top_k, min(s.max_tokens, max_answer_tokens(self.info)),
                -1 if s.seed is None else s.seed, s.thinking, s.reasoning_effort]

    def _request(self, cid: str) -> ChatRequest:
        conv = self.history.get(cid)
        s = conv.settings
        msgs = [Message.text("system", s.system_prompt)] if s.system_prompt.strip() else []
        for m in conv.messages:
            if m.role == "user":
                parts = [ImagePart.from_path(str(self.history.image_path(h))) for h in m.images]
                msgs.append(Message("user", tuple(parts) + ((TextPart(m.text),) if m.text else ())))
            elif m.text or m.reasoning:
                msgs.append(Message("assistant", (TextPart(m.text),), m.reasoning or None))
        sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                  max_tokens=s.max_tokens, seed=s.seed)
        # A chat longer than the context goes on without its oldest turns, cut where the last
        # answer's cut was while the rest fits (the prefix cache then keeps serving it).
        earlier = [m.stats["dropped_messages"] for m in conv.messages if "dropped_messages" in m.stats]
        return ChatRequest(tuple(msgs), sampling, thinking=s.thinking, reasoning_effort=s.reasoning_effort,
                           overflow="drop_oldest", dropped_hint=earlier[-1] if earlier else 0)

    # ---- send / edit / retry -------------------------------------------------------------

    def send(self, message: dict | None, cid: str | None, *settings, request: gr.Request = None):
        """Store the user's turn. Returns (chatbot, textbox, conv id, pending, conversation list)."""
        message = message or {}
        text = (message.get("text") or "").strip()
        files = [f if isinstance(f, str) else f.get("path") for f in message.get("files") or []]
        keep = gr.skip()
        if not text and not files:
            return keep, keep, cid, False, keep
        if self._session(request) in self._active:
            gr.Warning("An answer is still being generated: wait for it or press Stop (Esc).")
            return keep, keep, cid, False, keep
        try:
            check_count(len(files), self.limits)
            if files and not self.info.supports_images:
                raise ImageRejected(f"{self.info.name} does not take images; start localchat with a vision model.")
            uploads = []
            for path in files:
                with open(path, "rb") as f:
                    uploads.append((f.read(), os.path.basename(path)))
            prepared = prepare_images(uploads, self.limits)
        except ImageRejected as e:
            # Shown in the chat, not stored; the textbox keeps the message so it can be fixed.
            return self._rendered(cid) + [{"role": "assistant", "content": f"**Image not accepted:** {e}"}], keep, cid, False, keep
        if not self.history.exists(cid):
            cid = self.history.create(title=(text or "Image chat")[:60])
        self.history.set_settings(cid, self.settings_from(settings))
        shas = [self.history.put_image(p.data) for p in prepared]
        notes = [p.note for p in prepared if p.note]
        self.history.add_message(cid, "user", text, images=shas, stats={"notes": notes} if notes else None)
        return self._rendered(cid), gr.MultimodalTextbox(value=None), cid, True, self._list_update(cid)

    def edit(self, cid: str | None, index: int, new_text: str, *settings):
        """Replace the text of the user message at chatbot `index` and drop everything after it."""
        pos = self._position(cid, index)
        conv = self.history.get(cid) if pos is not None else None
        target = next((m for m in conv.messages if m.position == pos), None) if conv else None
        if target is None or target.role != "user":
            gr.Warning("Only your own messages can be edited.")
            return self._rendered(cid), False
        self.history.set_settings(cid, self.settings_from(settings))
        self.history.edit_text(target.id, new_text.strip())
        self.history.truncate(cid, pos + 1)
        return self._rendered(cid), True

    def retry(self, cid: str | None, index: int, *settings):
        """Drop the answer at chatbot `index` (and later turns) and answer its question again."""
        pos = self._position(cid, index)
        if pos is None:
            return self._rendered(cid), False
        users = [m.position for m in self.history.get(cid).messages if m.role == "user" and m.position <= pos]
        if not users:
            return self._rendered(cid), False
        self.history.set_settings(cid, self.settings_from(settings))
        self.history.truncate(cid, users[-1] + 1)
        return self._rendered(cid), True

    def _position(self, cid: str | None, index: int) -> int | None:
        if not self.history.exists(cid):
            return None
        _, positions = render(self.history.get(cid).messages, self.history)
        index = index[0] if isinstance(index, (tuple, list)) else int(index)
        return positions[index] if 0 <= index < len(positions) else None

    # ---- generate / stop -----------------------------------------------------------------

    def generate(self, pending: bool, cid: str | None, request: gr.Request = None):
        """Stream the answer to the stored conversation's last user turn. Yields the chatbot value."""
        if not pending or not self.history.exists(cid):
            yield gr.skip()
            return
        conv = self.history.get(cid)
        if not conv.messages or conv.messages[-1].role != "user":
            yield gr.skip()
            return
        base = render(conv.messages, self.history)[0]
        try:
            stream = self.engine.submit(self._request(cid))
        except ValueError as e:  # e.g. the prompt does not fit the context
            yield base + [{"role": "assistant", "content": f"**Error:** {e}"}]
            return
        session = self._session(request)
        with self._lock:
            self._active[session] = stream
        mid = self.history.begin_answer(cid)
        live = StoredMessage(mid, conv.messages[-1].position + 1, "assistant", "", "", [], {}, PARTIAL, time.time())
        text, reasoning, final = [], [], None
        think_start = think_end = None
        last_ckpt = time.monotonic()
        try:
            for batch in frames(stream):
                now = time.monotonic()
                for item in batch:
                    if isinstance(item, Final):
                        final = item
                        break
                    if item.reasoning:
                        think_start = think_start or now
                        reasoning.append(item.reasoning)
                    if item.text:
                        think_end = think_end or (now if think_start else None)
                        text.append(item.text)
                if final is not None:
                    break
                if now - last_ckpt >= CHECKPOINT_S:
                    self.history.checkpoint(mid, "".join(text), "".join(reasoning))
                    last_ckpt = now
                live = replace(live, text="".join(text), reasoning="".join(reasoning))
                yield base + render([live], self.history)[0]
        finally:
            with self._lock:
                if self._active.get(session) is stream:
                    del self._active[session]
            if final is None:  # generator closed (browser gone) before the engine finished
                stream.close()
            thinking_s = (think_end or time.monotonic()) - think_start if think_start else None
            status = {None: STOPPED, "abort": STOPPED, "error": ERROR}.get(
                final and final.finish_reason, DONE)
            self.history.finish_answer(mid, "".join(text), "".join(reasoning),
                                       answer_stats(final, self.info.context_length, thinking_s), status)
        yield self._rendered(cid)

    def stop(self, request: gr.Request = None) -> None:
        with self._lock:
            stream = self._active.get(self._session(request))
        if stream is not None:
            stream.close()

    @staticmethod
    def _session(request: gr.Request | None) -> str:
        return getattr(request, "session_hash", None) or "default"

    # ---- sidebar -------------------------------------------------------------------------

    def open(self, cid: str | None):
        """Returns (chatbot, conv id, title box, *settings values)."""
        if not self.history.exists(cid):
            return [[], None, ""] + self.settings_values(self.defaults)
        conv = self.history.get(cid)
        return [render(conv.messages, self.history)[0], cid, conv.title] + self.settings_values(conv.settings)

    def new_chat(self):
        return [[], None, "", gr.Radio(value=None)] + self.settings_values(self.defaults)

    def search(self, query: str, cid: str | None):
        return self._list_update(cid, query)

    def rename(self, cid: str | None, title: str, query: str):
        if self.history.exists(cid):
            self.history.rename(cid, title)
        return self._list_update(cid, query)

    def delete(self, cid: str | None, query: str):
        if self.history.exists(cid):
            self.history.delete(cid)
        return [[], None, "", self._list_update(None, query)]

    def import_chat(self, file, query: str = ""):
        """A conversation from an Export JSON file, opened as a new chat. Returns (chatbot, conv id,
        title box, conversation list, *settings values); a refused file leaves everything as it was."""
        path = file if isinstance(file, str) else getattr(file, "name", None) or (file or {}).get("path")
        try:
            with open(path, "rb") as f:
                cid = import_conversation(self.history, f.read())
        except (ImportRejected, OSError, TypeError) as e:
            gr.Warning(f"Could not import that file: {e}")
            return [gr.skip()] * (4 + len(SETTINGS_FIELDS))
        opened = self.open(cid)
        return opened[:3] + [self._list_update(cid, query)] + opened[3:]

    def export(self, cid: str | None, kind: str):
        if not self.history.exists(cid):
            gr.Warning("Open a conversation first.")
            return None
        conv = self.history.get(cid)
        text = self.history.export_json(cid) if kind == "json" else self.history.export_markdown(cid)
        safe = "".join(c if c.isalnum() or c in "-_ " else "_" for c in conv.title).strip() or "chat"
        path = os.path.join(tempfile.mkdtemp(prefix="localchat-export-"), f"{safe}.{'json' if kind == 'json' else 'md'}")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path
