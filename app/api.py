"""OpenAI-compatible `/v1/models` and `/v1/chat/completions` over the in-process engine.

Wire format follows the OpenAI Chat Completions reference (https://platform.openai.com/docs/api-reference/chat):
`chat.completion` objects, `chat.completion.chunk` SSE events ending in `data: [DONE]`, and
errors as {"error": {"message", "type", "param", "code"}}. Reasoning goes in `reasoning_content`
beside `content`, the field name vLLM and llama.cpp use for reasoning parsers. Function calling
(`tools`, `tool_calls`, `tool` messages) is translated in api_tools.py, `response_format` (JSON
mode) in api_format.py, `logprobs` and `top_logprobs` in api_logprobs.py: one entry per generated
token, reasoning and markup tokens included, streamed in the chunk that releases its text or,
when its text is held back or hidden, in the next chunk sent.
The body is parsed by hand, not by pydantic, so every malformed request gets the OpenAI error shape.
Model cards carry localchat's own facts (placement, weight and KV-cache memory) under the extra key
"localchat", beside the standard id/object/created/owned_by fields.

A client that goes away aborts its request in the engine: while the answer is collected (plain
requests) or before the first event is sent (streams) the connection is polled; once a stream has
begun, Starlette cancels the event generator when the client disconnects, and a background task
closes the engine stream in every case where the answer did not end by itself.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import re
import time
import uuid
from dataclasses import asdict, dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from localchat.app.api_format import FormatError, parse_response_format
from localchat.app.api_logprobs import LogprobsError, logprobs_json, parse_logprobs
from localchat.app.api_tools import ToolsError, parse_tool_calls, parse_tools, tool_call_json
from localchat.app.defaults import ANSWER_TOKENS
from localchat.app.ui_images import ImageLimits, ImageRejected, check_count, prepare_image
from localchat.engine.runtime.request import (
    ChatEngine, ChatRequest, Delta, Final, Message, ModelInfo, RequestStream, SamplingParams, TextPart, TokenLogprob,
)

DEFAULT_MAX_TOKENS = ANSWER_TOKENS
DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<b64>.*)$", re.S)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(), headers=headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def key_error(request: Request, api_key: str | None) -> ApiError | None:
    """The 401 for a /v1 request without `Authorization: Bearer <api_key>` (None: it may pass)."""
    if api_key is None:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return None
    return ApiError(401, "Missing or wrong API key. Send the key localchat was started with "
                         "as 'Authorization: Bearer <key>'.", code="invalid_api_key")


@dataclass(frozen=True)
class ParsedRequest:
    chat: ChatRequest
    stream: bool
    include_usage: bool

    @property
    def logprobs(self) -> bool:
        return self.chat.sampling.logprobs is not None


def create_api(engine: ChatEngine, *, api_key: str | None = None,
               limits: ImageLimits = ImageLimits()) -> APIRouter:
    """Routes under /v1. With `api_key` set every request needs `Authorization: Bearer <api_key>`."""
    router = APIRouter(prefix="/v1")
    started = int(time.time())

    def check_key(request: Request) -> None:
        failure = key_error(request, api_key)
        if failure is not None:
            raise failure

    @router.get("/models")
    async def list_models(request: Request):
        try:
            check_key(request)
        except ApiError as e:
            return e.response()
        info = engine.info()
        return {"object": "list", "data": [_model_card(info, started)]}

    @router.get("/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        try:
            check_key(request)
            info = engine.info()
            if model_id != info.name:
                raise _unknown_model(model_id, info)
        except ApiError as e:
            return e.response()
        return _model_card(info, started)

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            check_key(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ApiError(400, "The request body is not valid JSON.")
            info = await run_in_threadpool(engine.info)
            parsed = await run_in_threadpool(parse_request, body, info, limits)
            # Building the prompt (tokenizer, image processor) happens inside submit: keep it off the event loop.
            try:
                stream = await run_in_threadpool(engine.submit, parsed.chat)
            except ValueError as e:  # the engine refuses what it cannot run, e.g. a prompt over the context
                raise _refusal(str(e))
        except ApiError as e:
            return e.response()
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        if parsed.stream:
            # The first item decides the status: a refused prompt (its Final comes first) gets an HTTP
            # error, not a 200 stream that carries the error in-band.
            it = iter(stream)
            first = await _unless_gone(request, stream, run_in_threadpool(next, it, None))
            if first is _GONE:
                return Response(status_code=499)
            if isinstance(first, Final) and first.finish_reason == "error":
                return _failure(first).response()
            source = _EventSource(stream, it, first)
            return StreamingResponse(
                _sse(source, cid, created, info.name, parsed.include_usage, parsed.logprobs),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(source.close_unless_finished))
        collected = await _unless_gone(request, stream, run_in_threadpool(_collect, stream))
        if collected is _GONE:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        final = collected.final
        if final.finish_reason == "error":
            return _failure(final).response()
        text, calls = collected.text, collected.calls
        message = {"role": "assistant", "content": text if text or not calls else None}
        if collected.reasoning:
            message["reasoning_content"] = collected.reasoning
        if calls:
            message["tool_calls"] = [tool_call_json(c) for c in calls]
        logprobs = logprobs_json(collected.logprobs) if parsed.logprobs else None
        return {"id": cid, "object": "chat.completion", "created": created, "model": info.name,
                "choices": [{"index": 0, "message": message, "logprobs": logprobs,
                             "finish_reason": _finish(final.finish_reason)}],
                "usage": _usage(final), "timings": _timings(final)}

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_found(path: str, request: Request):
        if path in ("models", "chat/completions"):
            allowed = "GET" if path == "models" else "POST"
            return ApiError(405, f"/v1/{path} answers {allowed}, not {request.method}.",
                            code="method_not_allowed").response()
        return ApiError(404, f"localchat does not serve /v1/{path}; it serves /v1/models and "
                             "/v1/chat/completions.", code="unknown_url").response()

    return router


def parse_request(body: object, info: ModelInfo, limits: ImageLimits) -> ParsedRequest:
    """Turn a Chat Completions body into a ChatRequest, or raise ApiError naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != info.name:
        raise _unknown_model(model, info)
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"localchat answers one choice per request: 'n' must be 1 (got {body['n']!r}); "
                            "send several requests for several answers.", param="n")
    try:
        logprobs = parse_logprobs(body)
    except LogprobsError as e:
        raise ApiError(400, e.message, param=e.param)
    try:
        tools, forced_call = parse_tools(body)
    except ToolsError as e:
        raise ApiError(400, e.message, param=e.param)
    try:
        response_format = parse_response_format(body, tools)
    except FormatError as e:
        raise ApiError(400, e.message, param=e.param)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list.", param="messages")
    messages = tuple(_parse_message(m, i, info, limits) for i, m in enumerate(raw))
    if not any(m.role == "user" for m in messages):
        raise ApiError(400, "'messages' needs at least one user message.", param="messages")

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    if stop is not None and (not isinstance(stop, tuple) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings.", param="stop")
    sampling = SamplingParams(
        # left out: what the checkpoint recommends (as vLLM does), else OpenAI's defaults
        temperature=_number(body, "temperature", _default(info.sampling.temperature, 1.0), 0.0, 2.0),
        # top_p 0 (allowed by OpenAI) keeps only the most likely token; the sampler's filter needs p > 0.
        top_p=max(_number(body, "top_p", _default(info.sampling.top_p, 1.0), 0.0, 1.0), 1e-6),
        top_k=int(_number(body, "top_k", _default(info.sampling.top_k, 0), 0, 1e9, integer=True)),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-9, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        seed=None if body.get("seed") is None else int(_number(body, "seed", 0, -2**63, 2**64, integer=True)),
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else int(
            _number(body, "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens",
                    1, 1, info.context_length, integer=True)),
        stop=stop or (),
        logprobs=logprobs,
    )
    effort = body.get("reasoning_effort", "medium")
    if effort not in ("none", "minimal", "low", "medium", "high"):
        raise ApiError(400, "'reasoning_effort' must be low, medium or high.", param="reasoning_effort")
    kwargs = body.get("chat_template_kwargs") or {}
    # GLM switches thinking off via chat_template_kwargs.enable_thinking (vLLM/SGLang convention,
    # GLM-V README); reasoning_effort "none"/"minimal" is read the same way.
    thinking = bool(kwargs.get("enable_thinking", effort not in ("none", "minimal")))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false.", param="stream")
    include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
    chat = ChatRequest(messages, sampling, thinking=thinking,
                       reasoning_effort=effort if effort in ("low", "medium", "high") else "low", tools=tools,
                       forced_call=forced_call, response_format=response_format)
    return ParsedRequest(chat, stream, include_usage)


def _parse_message(m: object, i: int, info: ModelInfo, limits: ImageLimits) -> Message:
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise ApiError(400, f"messages[{i}] needs a role of system, developer, user, assistant or tool.",
                       param=f"messages[{i}].role")
    role, content = _ROLES[m["role"]], m.get("content")
    if role == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise ApiError(400, f"messages[{i}] (a tool result) needs the tool_call_id of the call it answers.",
                       param=f"messages[{i}].tool_call_id")
    parts: list = []
    if isinstance(content, str):
        parts.append(TextPart(content))
    elif isinstance(content, list):
        images = [p for p in content if isinstance(p, dict) and p.get("type") == "image_url"]
        try:
            check_count(len(images), limits)
        except ImageRejected as e:
            raise ApiError(400, str(e), param=f"messages[{i}].content", code="too_many_images")
        for j, p in enumerate(content):
            parts.append(_parse_part(p, f"messages[{i}].content[{j}]", role, info, limits))
    elif content is None and role == "assistant":
        pass
    else:
        raise ApiError(400, f"messages[{i}].content must be a string or a list of parts.",
                       param=f"messages[{i}].content")
    reasoning = m.get("reasoning_content") if role == "assistant" else None
    try:
        calls = parse_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls") if role == "assistant" else ()
    except ToolsError as e:
        raise ApiError(400, e.message, param=e.param)
    return Message(role, tuple(parts), reasoning if isinstance(reasoning, str) else None, calls,
                   m.get("tool_call_id") if role == "tool" else None)


def _parse_part(p: object, where: str, role: str, info: ModelInfo, limits: ImageLimits):
    kind = p.get("type") if isinstance(p, dict) else None
    if kind == "text" and isinstance(p.get("text"), str):
        return TextPart(p["text"])
    if kind != "image_url":
        raise ApiError(400, f"{where}: part type {kind!r} is not supported; use 'text' or 'image_url'.",
                       param=where)
    if role != "user":
        raise ApiError(400, f"{where}: images are only accepted in user messages.", param=where)
    if not info.supports_images:
        raise ApiError(400, f"{info.name} does not take images; load a vision model such as GLM-4.5V.",
                       param=where)
    ref = p.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str):
        raise ApiError(400, f"{where}.image_url.url must be a string.", param=where)
    if not url.startswith("data:"):
        raise ApiError(400, f"{where}: only data: URLs are accepted for images (localchat works offline and "
                            "fetches nothing); send the image inline as 'data:image/png;base64,...' or "
                            "'data:image/jpeg;base64,...'.", param=where, code="image_url_not_supported")
    match = _DATA_URL.match(url)
    if not match:
        raise ApiError(400, f"{where}: image_url must be a base64 data: URL (data:image/png;base64,...).",
                       param=where, code="invalid_image_url")
    try:
        data = base64.b64decode(match["b64"], validate=False)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the base64 image data is malformed.", param=where, code="invalid_image_url")
    try:
        return prepare_image(data, where, limits).part
    except ImageRejected as e:
        raise ApiError(400, str(e), param=where, code="invalid_image")


def _default(recommended, fallback):
    return fallback if recommended is None else recommended


def _number(body: dict, key: str, default, lo, hi, *, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise ApiError(400, f"'{key}' must be {'an integer' if integer else 'a number'}.", param=key)
    if not lo <= v <= hi:
        raise ApiError(400, f"'{key}' must be between {lo:g} and {hi:g}; got {v}.", param=key)
    return v


def _unknown_model(model: str, info: ModelInfo) -> ApiError:
    return ApiError(404, f"The model {model!r} is not loaded; this server runs {info.name!r} "
                         "(see GET /v1/models).", param="model", code="model_not_found")


def _refusal(message: str) -> ApiError:
    """A prompt the engine will not run. Its messages name the context when that is the reason."""
    context = "context" in message or "no room to answer" in message
    return ApiError(400, message, code="context_length_exceeded" if context else None,
                    param="messages" if context else None)


def _failure(final: Final) -> ApiError:
    """The error for a Final("error"): a refusal before any token (prompt too long) is the
    client's to fix (400); anything else is the server's (500)."""
    message = final.error or "The engine failed while generating."
    if final.completion_tokens == 0 and ("context" in message or "no room to answer" in message):
        return _refusal(message)
    return ApiError(500, message, type="server_error")


def _model_card(info: ModelInfo, created: int) -> dict:
    """The standard fields, the top-level context_length/family/supports_images that other
    localchat instances and vLLM-style clients read, and localchat's memory facts and the model's
    recommended sampling under "localchat" (values the engine does not know are left out)."""
    extra = {"family": info.family, "context_length": info.context_length,
             "supports_images": info.supports_images, "placement": info.placement,
             "weights_bytes": info.weights_bytes or None, "weights_format": info.weights_format,
             "kv_cache_bytes": info.kv_cache_bytes,
             "kv_cache_tokens": info.kv_cache_tokens, "kv_window_tokens": info.kv_window_tokens,
             "sampling": {k: v for k, v in asdict(info.sampling).items() if v is not None} or None}
    return {"id": info.name, "object": "model", "created": created, "owned_by": "localchat",
            "context_length": info.context_length, "family": info.family,
            "supports_images": info.supports_images,
            "localchat": {k: v for k, v in extra.items() if v is not None}}


_GONE = object()


async def _unless_gone(request: Request, stream: RequestStream, work):
    """Awaits `work` (a thread-pool call reading `stream`); if the client disconnects first, closes
    the stream (the engine aborts the request, so `work` ends soon) and returns _GONE."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            stream.close()
            await asyncio.wait({task}, timeout=5)  # let the reader thread see the abort
            return _GONE


@dataclass(frozen=True)
class _Answer:
    """A whole answer read from an engine stream."""

    text: str
    reasoning: str
    calls: list
    logprobs: list[TokenLogprob]
    final: Final


def _collect(stream: RequestStream) -> _Answer:
    text, reasoning, calls, logprobs, final = [], [], [], [], None
    try:
        for item in stream:
            if isinstance(item, Delta):
                text.append(item.text)
                reasoning.append(item.reasoning)
                calls += item.tool_calls
                logprobs += item.logprobs
            else:
                final = item
    finally:
        if final is None:
            stream.close()
    return _Answer("".join(text), "".join(reasoning), calls, logprobs, final)


class _EventSource:
    """One engine stream being sent as SSE: its iterator, the first item (read before the response
    began), and whether the engine's Final arrived."""

    def __init__(self, stream: RequestStream, it, first):
        self.stream, self.it, self.first = stream, it, first
        self.finished = self.closed = False

    async def next(self):
        if self.first is not None:
            item, self.first = self.first, None
            return item
        return await run_in_threadpool(next, self.it, None)

    def close_unless_finished(self) -> None:
        # Also runs as the response's background task, after the client went away: a generator
        # left suspended at a `yield` is only finalised later, so the abort must not wait for it.
        if not self.finished and not self.closed:
            self.closed = True
            self.stream.close()


async def _sse(source: _EventSource, cid: str, created: int, model: str, include_usage: bool,
               logprobs: bool = False):
    """SSE events; leaving early (client gone: Starlette cancels this generator) closes the
    engine stream, which aborts the request. With `logprobs`, each chunk carries the entries of
    the tokens read since the last chunk sent (null when there are none): a token whose text is
    held back or hidden has its entry sent with the next chunk, at the latest the finishing one."""
    pending: list[TokenLogprob] = []

    def event(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
        entries = logprobs_json(pending) if logprobs and pending and not usage else None
        pending.clear()
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                 "choices": [] if usage else [{"index": 0, "delta": delta, "logprobs": entries,
                                               "finish_reason": finish}]}
        if include_usage:  # as OpenAI does: null on every chunk but the last
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    final, calls = None, 0
    try:
        yield event({"role": "assistant", "content": ""})
        while final is None:
            item = await source.next()
            if item is None:
                break
            if isinstance(item, Final):
                final = item
                source.finished = True
                continue
            pending.extend(item.logprobs)
            delta = {}
            if item.reasoning:
                delta["reasoning_content"] = item.reasoning
            if item.text:
                delta["content"] = item.text
            if item.tool_calls:
                # each call whole, in one delta (clients join argument fragments; one is a fragment too)
                delta["tool_calls"] = [tool_call_json(c, calls + k) for k, c in enumerate(item.tool_calls)]
                calls += len(item.tool_calls)
            if delta:
                yield event(delta)
        if final is not None and final.finish_reason == "error":
            yield f"data: {json.dumps(_failure(final).body())}\n\n"
        elif final is not None:
            yield event({}, _finish(final.finish_reason))
            if include_usage:
                yield event({}, usage=_usage(final))
        yield "data: [DONE]\n\n"
    finally:
        source.close_unless_finished()


def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


def _usage(final: Final) -> dict:
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens}


def _timings(final: Final) -> dict:
    t = final.timings
    return {"ttft_s": t.ttft, "image_encode_s": t.image_encode, "prefill_s": t.prefill,
            "first_token_s": t.first_token, "decode_s": t.decode, "decode_tokens_per_s": t.decode_tokens_per_s}
