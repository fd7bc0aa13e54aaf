"""`--backend URL`: a ChatEngine that forwards chats to an OpenAI-compatible server (vLLM, SGLang,
another localchat), so the page runs with no local model.

Wire format: OpenAI Chat Completions streaming (https://platform.openai.com/docs/api-reference/chat):
SSE `data:` lines of `chat.completion.chunk` objects ending in `data: [DONE]`; with
`stream_options.include_usage` a last chunk with empty `choices` carries `usage`. Reasoning
arrives as `delta.reasoning_content` (vLLM's reasoning parsers, SGLang, localchat) or
`delta.reasoning` (newer vLLM). top_k, min_p, repetition_penalty and `chat_template_kwargs`
are extra body fields both vLLM and SGLang accept. Tools, a forced call (as `tool_choice`), tool
calls and tool results are forwarded; the calls streamed back (id and name once, the arguments in
pieces, by index) are handed on whole when the answer ends. `logprobs` / `top_logprobs` are
forwarded, and each chunk's `choices[].logprobs.content` is handed on as it came (without token
ids, which OpenAI's format does not carry). JSON mode is forwarded as `response_format`
{"type": "json_object"}, and a schema as {"type": "json_schema"} with the schema as the request
gave it, which vLLM and SGLang enforce with their own constrained decoding.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import queue
import threading
import time
from typing import Iterator
from urllib.parse import urlsplit

import httpx

from ..engine.runtime.request import (
    ChatRequest, Delta, Final, ForcedCall, ImagePart, Message, ModelInfo, StreamItem, TextPart, Timings, TokenLogprob,
    ToolCall,
)
from ..engine.spec import SamplingDefaults
from .api_tools import tool_call_json

DEFAULT_CONTEXT = 32768  # used when the server does not say (OpenAI's model card has no such field)
_CONTEXT_KEYS = ("max_model_len", "context_length", "max_context_length", "context_window")


class RemoteEngine:
    """ChatEngine over `base_url` (e.g. http://host:8000/v1; a bare http://host:8000 gets /v1).
    `model` picks one of the server's models (default: the first it lists)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None, *,
                 timeout_s: float = 30.0):
        url = base_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--backend {base_url!r} must be an http:// or https:// URL, "
                             "e.g. http://localhost:8000/v1")
        if urlsplit(url).path in ("", "/"):
            url += "/v1"
        self.base_url, self.model = url, model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Connect and first-byte timeout; a long prefill may keep the stream quiet longer, so reads wait more.
        self._timeout = httpx.Timeout(timeout_s, read=max(timeout_s, 600.0))
        self._info: ModelInfo | None = None

    def info(self) -> ModelInfo:
        """From GET /models, asked once. Raises RuntimeError naming the server if it cannot be used."""
        if self._info is None:
            try:
                r = httpx.get(f"{self.base_url}/models", headers=self._headers, timeout=self._timeout)
            except httpx.HTTPError as e:
                raise RuntimeError(f"cannot reach the backend {self.base_url}: {e}") from None
            if r.status_code != 200:
                raise RuntimeError(f"the backend {self.base_url} answered GET /models with HTTP {r.status_code}: "
                                   f"{_error_text(r.text)}")
            cards = [c for c in (r.json().get("data") or []) if isinstance(c, dict) and c.get("id")]
            card = next((c for c in cards if c["id"] == self.model), None) if self.model else (cards or [None])[0]
            if card is None:
                listed = ", ".join(c["id"] for c in cards) or "none"
                raise RuntimeError(f"the backend {self.base_url} does not serve model {self.model!r} "
                                   f"(it lists: {listed})")
            self._info = _model_info(card, self.base_url)
        return self._info

    def submit(self, request: ChatRequest) -> "RemoteStream":
        stream = RemoteStream()
        try:
            body = self._body(request)
        except Exception as e:  # a request we cannot encode ends its own stream, like the local engine
            stream._finish(Final("error", 0, 0, Timings(), error=f"{type(e).__name__}: {e}"))
            return stream
        threading.Thread(target=stream._run, args=(f"{self.base_url}/chat/completions", self._headers, body,
                                                   self._timeout, self.base_url),
                         name="localchat-remote", daemon=True).start()
        return stream

    def _body(self, request: ChatRequest) -> dict:
        sp = request.sampling
        body = {
            "model": self.info().name, "stream": True, "stream_options": {"include_usage": True},
            "messages": [_wire_message(m) for m in request.messages],
            "temperature": sp.temperature, "top_p": sp.top_p, "max_tokens": sp.max_tokens,
            "chat_template_kwargs": {"enable_thinking": request.thinking},
        }
        if self.info().reasoning == "effort":
            body["reasoning_effort"] = request.reasoning_effort
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.seed is not None:
            body["seed"] = sp.seed
        # Sent only when they change something: plain OpenAI servers reject unknown fields.
        if sp.top_k:
            body["top_k"] = sp.top_k
        if sp.min_p:
            body["min_p"] = sp.min_p
        if sp.presence_penalty:
            body["presence_penalty"] = sp.presence_penalty
        if sp.frequency_penalty:
            body["frequency_penalty"] = sp.frequency_penalty
        if sp.repetition_penalty != 1.0:
            body["repetition_penalty"] = sp.repetition_penalty
        if request.tools:
            body["tools"] = list(request.tools)
        if request.forced_call is not None:
            body["tool_choice"] = _wire_tool_choice(request.forced_call)
        if request.response_format == "json_schema":
            schema = request.response_schema
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": schema.name, "schema": schema.source, "strict": schema.strict}}
        elif request.response_format != "text":
            body["response_format"] = {"type": request.response_format}
        if sp.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in sp.logit_bias}
        if sp.logprobs is not None:
            body["logprobs"] = True
            if sp.logprobs:
                body["top_logprobs"] = sp.logprobs
        return body


class RemoteStream:
    """Deltas from the server as they arrive, then one Final. `close()` drops the HTTP stream."""

    def __init__(self):
        self._items: queue.Queue[StreamItem] = queue.Queue()
        self._lock = threading.Lock()
        self._done = False
        self._aborted = threading.Event()
        self._response: httpx.Response | None = None

    def __iter__(self) -> Iterator[StreamItem]:
        while True:
            item = self._items.get()
            yield item
            if isinstance(item, Final):
                return

    def close(self) -> None:
        self._aborted.set()
        self._finish(Final("abort", 0, 0, Timings()))
        response = self._response
        if response is not None:
            try:  # unblocks the reader thread; it then sees the abort and stops
                response.close()
            except Exception:
                pass

    def _finish(self, final: Final) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._items.put(final)

    def _run(self, url: str, headers: dict, body: dict, timeout: httpx.Timeout, server: str) -> None:
        start = time.perf_counter()
        first = last = None
        usage: dict = {}
        finish = "stop"
        pieces = 0
        calls: dict[int, dict] = {}  # streamed tool calls by index: id, name, argument fragments
        try:
            with httpx.Client(timeout=timeout) as client, client.stream("POST", url, json=body, headers=headers) as r:
                self._response = r
                if self._aborted.is_set():
                    return
                if r.status_code != 200:
                    r.read()
                    self._finish(Final("error", 0, 0, Timings(), error=f"the backend {server} answered HTTP "
                                                                      f"{r.status_code}: {_error_text(r.text)}"))
                    return
                for line in r.iter_lines():
                    if self._aborted.is_set():
                        return
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error after the stream began arrives in-band
                        err = chunk["error"]
                        msg = err.get("message") if isinstance(err, dict) else str(err)
                        self._finish(Final("error", 0, 0, Timings(), error=f"the backend {server} failed: {msg}"))
                        return
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or []:
                        d = choice.get("delta") or {}
                        text = d.get("content") or ""
                        reasoning = d.get("reasoning_content") or d.get("reasoning") or ""
                        entries = _token_logprobs(choice.get("logprobs"))
                        if text or reasoning:
                            last = time.perf_counter()
                            first = first or last
                            pieces += 1
                        if text or reasoning or entries:
                            self._items.put(Delta(text=text, reasoning=reasoning, logprobs=entries))
                        _gather_tool_calls(calls, d.get("tool_calls"))
                        if choice.get("finish_reason"):
                            reason = choice["finish_reason"]
                            finish = reason if reason in ("length", "tool_calls") else "stop"
        except Exception as e:  # network failure, or our own close() cutting the read
            if not self._aborted.is_set():
                self._finish(Final("error", 0, 0, Timings(), error=f"the backend {server} failed: "
                                                                  f"{type(e).__name__}: {e}"))
            return
        if self._aborted.is_set():
            return
        if calls:  # whole, once the stream ended: their arguments may come in fragments
            self._items.put(Delta(tool_calls=tuple(
                ToolCall(c["id"] or f"call_{i}", c["name"], "".join(c["arguments"]) or "{}")
                for i, c in sorted(calls.items()))))
            finish = "tool_calls" if finish == "stop" else finish
        end = time.perf_counter()
        completion = int(usage.get("completion_tokens") or pieces)
        decode = (last - first) if first is not None else 0.0
        timings = Timings(first_token=(first - start) if first is not None else end - start, decode=decode,
                          decode_tokens_per_s=(completion - 1) / decode if decode > 0 and completion > 1 else 0.0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self._finish(Final(finish, int(usage.get("prompt_tokens") or 0), completion, timings,
                           cached_tokens=int(cached)))


def _model_info(card: dict, base_url: str) -> ModelInfo:
    """From a model card. Another localchat adds its placement and memory under "localchat"; other
    servers do not say, so those stay unknown (0 / None) and the model panel leaves them out."""
    name = card["id"]
    ours = card.get("localchat") if isinstance(card.get("localchat"), dict) else {}
    context = next((int(card[k]) for k in _CONTEXT_KEYS if isinstance(card.get(k), int) and card[k] > 0),
                   DEFAULT_CONTEXT)
    gpt_oss = card.get("family") == "gpt_oss" or "gpt-oss" in name.lower()
    placement = f"remote ({urlsplit(base_url).netloc})"
    if isinstance(ours.get("placement"), str) and ours["placement"]:
        placement += f" on {ours['placement']}"
    return ModelInfo(name=name, family=card.get("family") or ("gpt_oss" if gpt_oss else "remote"),
                     context_length=context, supports_images=bool(card.get("supports_images", True)),
                     reasoning="effort" if gpt_oss else "thinking", placement=placement,
                     weights_bytes=_count(ours.get("weights_bytes")) or 0,
                     kv_cache_bytes=_count(ours.get("kv_cache_bytes")), kv_cache_tokens=_count(ours.get("kv_cache_tokens")),
                     kv_window_tokens=_count(ours.get("kv_window_tokens")), sampling=_sampling(ours.get("sampling")),
                     weights_format=ours["weights_format"] if isinstance(ours.get("weights_format"), str) else None)


def _sampling(card: object) -> SamplingDefaults:
    """Another localchat's recommended sampling ("localchat" -> "sampling"); unknown elsewhere."""
    if not isinstance(card, dict):
        return SamplingDefaults()

    def number(key: str):
        value = card.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    top_k = number("top_k")
    return SamplingDefaults(temperature=number("temperature"), top_p=number("top_p"),
                            top_k=None if top_k is None else int(top_k))


def _count(value) -> int | None:
    """A positive integer from a card, else None (absent, null or malformed: unknown)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _wire_tool_choice(forced: ForcedCall) -> str | dict:
    """A forced call as OpenAI's tool_choice: "required", or the named function."""
    if forced.function is None:
        return "required"
    return {"type": "function", "function": {"name": forced.function}}


def _gather_tool_calls(calls: dict[int, dict], deltas: object) -> None:
    """Adds one chunk's delta.tool_calls to `calls`: OpenAI streams a call's id and name once and its
    arguments in pieces, all under the call's index."""
    for n, d in enumerate(deltas if isinstance(deltas, list) else []):
        if not isinstance(d, dict):
            continue
        call = calls.setdefault(d.get("index", n), {"id": None, "name": "", "arguments": []})
        fn = d.get("function") or {}
        call["id"] = d.get("id") or call["id"]
        call["name"] = fn.get("name") or call["name"]
        if isinstance(fn.get("arguments"), str):
            call["arguments"].append(fn["arguments"])


def _token_logprobs(logprobs: object) -> tuple[TokenLogprob, ...]:
    """A chunk choice's OpenAI `logprobs` ({"content": [{token, logprob, bytes, top_logprobs}]})
    as entries; malformed ones are left out."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    out = []
    for item in content if isinstance(content, list) else []:
        entry = _token_logprob(item)
        if entry is not None:
            top = item.get("top_logprobs")
            alternatives = (_token_logprob(t) for t in (top if isinstance(top, list) else []))
            out.append(dataclasses.replace(entry, top=tuple(t for t in alternatives if t is not None)))
    return tuple(out)


def _token_logprob(item: object) -> TokenLogprob | None:
    """One {token, logprob, bytes} object, or None when it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("token"), str):
        return None
    logprob, raw = item.get("logprob"), item.get("bytes")
    if isinstance(logprob, bool) or not isinstance(logprob, (int, float)):
        return None
    if not (isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw)):
        raw = None
    return TokenLogprob(None, item["token"], float(logprob), None if raw is None else tuple(raw))


def _wire_message(m: Message) -> dict:
    if all(isinstance(p, TextPart) for p in m.content):
        content: object = "".join(p.text for p in m.content)
    else:
        content = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                   else {"type": "image_url", "image_url": {"url": _data_url(p)}} for p in m.content]
    out = {"role": m.role, "content": content}
    if m.role == "assistant" and m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [tool_call_json(c) for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def _data_url(part: ImagePart) -> str:
    buf = io.BytesIO()
    part.image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _error_text(body: str) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body."""
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return err["message"]
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError):
        pass
    return body.strip()[:300] or "(empty body)"
