"""OpenAI-compatible `/v1/models`, `/v1/chat/completions` and `/v1/responses` (api_responses.py)
over the in-process engine.

Wire format follows the OpenAI Chat Completions reference (https://platform.openai.com/docs/api-reference/chat):
`chat.completion` objects, `chat.completion.chunk` SSE events ending in `data: [DONE]`, and
errors as {"error": {"message", "type", "param", "code"}}. Reasoning goes in `reasoning_content`
beside `content`, the field name vLLM and llama.cpp use for reasoning parsers. Function calling
(`tools`, `tool_calls`, `tool` messages) is translated in api_tools.py, `response_format` (JSON
mode) in api_format.py, `logprobs` and `top_logprobs` in api_logprobs.py: one entry per generated
token, reasoning and markup tokens included, streamed in the chunk that releases its text or,
when its text is held back or hidden, in the next chunk sent.
The body is parsed by hand (api_request.py), not by pydantic, so every malformed request gets the
OpenAI error shape.
Model cards carry localchat's own facts (placement, weight and KV-cache memory) under the extra key
"localchat", beside the standard id/object/created/owned_by fields.

A client that goes away aborts its request in the engine: while the answer is collected (plain
requests) or before the first event is sent (streams) the connection is polled; once a stream has
begun, Starlette cancels the event generator when the client disconnects, and a background task
closes the engine stream in every case where the answer did not end by itself.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import asdict, dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from localchat.app.api_logprobs import logprobs_json
from localchat.app.api_errors import ApiError
from localchat.app.api_request import parse_request, unknown_model
from localchat.app.api_responses import (ResponseBuilder, ResponseStore, chat_body, keep, response_events,
                                        responses_error)
from localchat.app.api_tools import tool_call_json
from localchat.app.ui_images import ImageLimits
from localchat.engine.runtime.request import ChatEngine, Final, ModelInfo, RequestStream, TokenLogprob

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there


def key_error(request: Request, api_key: str | None) -> ApiError | None:
    """The 401 for a /v1 request without `Authorization: Bearer <api_key>` (None: it may pass)."""
    if api_key is None:
        return None
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), api_key.encode()):
        return None
    return ApiError(401, "Missing or wrong API key. Send the key localchat was started with "
                         "as 'Authorization: Bearer <key>'.", code="invalid_api_key")


def create_api(engine: ChatEngine, *, api_key: str | None = None,
               limits: ImageLimits = ImageLimits()) -> APIRouter:
    """Routes under /v1. With `api_key` set every request needs `Authorization: Bearer <api_key>`."""
    router = APIRouter(prefix="/v1")
    started = int(time.time())
    stored = ResponseStore()  # answered /v1/responses, for previous_response_id

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
                raise unknown_model(model_id, info)
        except ApiError as e:
            return e.response()
        return _model_card(info, started)

    async def read(request: Request) -> tuple[object, ModelInfo]:
        """(the request's JSON body, the model's info); raises ApiError."""
        check_key(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "The request body is not valid JSON.")
        return body, await run_in_threadpool(engine.info)

    async def start(fields: object, info: ModelInfo, overflow: str | None = None):
        """(the parsed request, its engine streams: one per choice) for a Chat Completions body;
        `overflow` overrides the ChatRequest's. Raises ApiError."""
        parsed = await run_in_threadpool(parse_request, fields, info, limits)
        if overflow is not None:
            parsed = replace(parsed, chat=replace(parsed.chat, overflow=overflow))
        # Building the prompt (tokenizer, image processor) happens inside submit: keep it off the event loop.
        streams = []
        try:
            for chat in parsed.choices():
                streams.append(await run_in_threadpool(engine.submit, chat))
        except ValueError as e:  # the engine refuses what it cannot run, e.g. a prompt over the context
            for stream in streams:
                stream.close()
            raise _refusal(str(e))
        return parsed, streams

    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        try:
            body, info = await read(request)
            parsed, streams = await start(body, info)
        except ApiError as e:
            return e.response()
        cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        if parsed.stream:
            return await _streamed(request, streams, _failure, lambda sources: _sse(
                sources, cid, created, info.name, parsed.include_usage, parsed.logprobs))
        answers = await _unless_gone(request, streams, run_in_threadpool(lambda: [_collect(s) for s in streams]))
        if answers is _GONE:
            return Response(status_code=499)  # nobody reads it; the request was aborted
        failed = next((a.final for a in answers if a.final.finish_reason == "error"), None)
        if failed is not None:
            return _failure(failed).response()
        finals = [a.final for a in answers]
        return {"id": cid, "object": "chat.completion", "created": created, "model": info.name,
                "choices": [_choice(i, a, parsed.logprobs) for i, a in enumerate(answers)],
                "usage": _usage(*finals), "timings": _timings(finals[0])}

    @router.post("/responses")
    async def responses(request: Request):
        try:
            body, info = await read(request)
            fields, conversation = chat_body(body, stored)
            # truncation "auto": a conversation over the context goes on without its oldest items
            overflow = "drop_oldest" if body.get("truncation") == "auto" else None
            parsed, (stream,) = await start(fields, info, overflow)  # no 'n' on /v1/responses
        except ApiError as e:
            return responses_error(e).response()
        builder = ResponseBuilder("resp_" + uuid.uuid4().hex, int(time.time()), info.name, body, conversation)
        if parsed.stream:
            return await _streamed(request, [stream], lambda final: responses_error(_failure(final)),
                                   lambda sources: response_events(sources[0], builder, stored))
        items = await _unless_gone(request, [stream], run_in_threadpool(_items, stream))
        if items is _GONE:
            return Response(status_code=499)
        final = items[-1]
        if final.finish_reason == "error":
            return responses_error(_failure(final)).response()
        for item in items[:-1]:
            builder.feed(item)
        builder.finish(final)
        keep(stored, builder, final)
        return builder.response(final)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def not_found(path: str, request: Request):
        if path in ("models", "chat/completions", "responses"):
            allowed = "GET" if path == "models" else "POST"
            return ApiError(405, f"/v1/{path} answers {allowed}, not {request.method}.",
                            code="method_not_allowed").response()
        return ApiError(404, f"localchat does not serve /v1/{path}; it serves /v1/models, /v1/chat/completions "
                             "and /v1/responses.", code="unknown_url").response()

    return router


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


async def _streamed(request: Request, streams: list[RequestStream], failure, events) -> Response:
    """The SSE response for engine streams (one per choice): events(sources) the generator of
    their events, failure(final) the ApiError for a refusal. The first items decide the status: a
    refused prompt (its Final comes first) gets an HTTP error, not a 200 stream that carries the
    error in-band."""
    its = [iter(s) for s in streams]
    firsts = await _unless_gone(request, streams, run_in_threadpool(lambda: [next(it, None) for it in its]))
    if firsts is _GONE:
        return Response(status_code=499)
    refused = next((f for f in firsts if isinstance(f, Final) and f.finish_reason == "error"), None)
    if refused is not None:
        for s in streams:
            s.close()
        return failure(refused).response()
    sources = [_EventSource(s, it, first) for s, it, first in zip(streams, its, firsts)]

    def close_unfinished() -> None:
        for source in sources:
            source.close_unless_finished()

    return StreamingResponse(events(sources), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(close_unfinished))


async def _unless_gone(request: Request, streams: list[RequestStream], work):
    """Awaits `work` (a thread-pool call reading `streams`); if the client disconnects first, closes
    the streams (the engine aborts the requests, so `work` ends soon) and returns _GONE."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            for stream in streams:
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


def _items(stream: RequestStream) -> list:
    """Every item of an engine stream, its Final last."""
    items = []
    try:
        items = list(stream)
    finally:
        if not items or not isinstance(items[-1], Final):
            stream.close()
    return items


def _collect(stream: RequestStream) -> _Answer:
    *deltas, final = _items(stream)
    return _Answer("".join(d.text for d in deltas), "".join(d.reasoning for d in deltas),
                   [c for d in deltas for c in d.tool_calls], [e for d in deltas for e in d.logprobs], final)


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


def _choice(index: int, answer: _Answer, logprobs: bool) -> dict:
    text, calls = answer.text, answer.calls
    message = {"role": "assistant", "content": text if text or not calls else None}
    if answer.reasoning:
        message["reasoning_content"] = answer.reasoning
    if calls:
        message["tool_calls"] = [tool_call_json(c) for c in calls]
    return {"index": index, "message": message, "logprobs": logprobs_json(answer.logprobs) if logprobs else None,
            "finish_reason": _finish(answer.final.finish_reason)}


async def _sse(sources: list[_EventSource], cid: str, created: int, model: str, include_usage: bool,
               logprobs: bool = False):
    """SSE events, one source per choice (its chunks carry its index, interleaved as they come);
    leaving early (client gone: Starlette cancels this generator) closes the engine streams, which
    aborts the requests. With `logprobs`, each chunk carries the entries of the tokens its choice
    read since its last chunk (null when there are none): a token whose text is held back or
    hidden has its entry sent with that choice's next chunk, at the latest its finishing one."""
    pending: list[list[TokenLogprob]] = [[] for _ in sources]
    calls = [0] * len(sources)
    finals: list[Final | None] = [None] * len(sources)

    def event(i: int, delta: dict, finish: str | None = None) -> str:
        entries = logprobs_json(pending[i]) if logprobs and pending[i] else None
        pending[i] = []
        return chunk([{"index": i, "delta": delta, "logprobs": entries, "finish_reason": finish}])

    def chunk(choices: list, usage: dict | None = None) -> str:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:  # as OpenAI does: null on every chunk but the last
            out["usage"] = usage
        return f"data: {json.dumps(out, ensure_ascii=False)}\n\n"

    reading: dict[asyncio.Future, int] = {}
    try:
        for i in range(len(sources)):
            yield event(i, {"role": "assistant", "content": ""})
        reading = {asyncio.ensure_future(source.next()): i for i, source in enumerate(sources)}
        failed = None
        while reading and failed is None:
            done, _ = await asyncio.wait(reading, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i, item = reading.pop(task), task.result()
                if item is None:  # the stream ended without its Final
                    continue
                if isinstance(item, Final):
                    finals[i] = item
                    sources[i].finished = True
                    if item.finish_reason == "error":
                        failed = item
                    else:
                        yield event(i, {}, _finish(item.finish_reason))
                    continue
                reading[asyncio.ensure_future(sources[i].next())] = i
                pending[i].extend(item.logprobs)
                delta = {}
                if item.reasoning:
                    delta["reasoning_content"] = item.reasoning
                if item.text:
                    delta["content"] = item.text
                if item.tool_calls:
                    # each call whole, in one delta (clients join argument fragments; one is a fragment too)
                    delta["tool_calls"] = [tool_call_json(c, calls[i] + k) for k, c in enumerate(item.tool_calls)]
                    calls[i] += len(item.tool_calls)
                if delta:
                    yield event(i, delta)
        if failed is not None:
            yield f"data: {json.dumps(_failure(failed).body())}\n\n"
        elif include_usage and all(finals):
            yield chunk([], _usage(*finals))
        yield "data: [DONE]\n\n"
    finally:
        for task in reading:
            task.cancel()
        for source in sources:
            source.close_unless_finished()


def _finish(reason: str) -> str:
    return reason if reason in ("stop", "length", "tool_calls") else "stop"


def _usage(final: Final, *more: Final) -> dict:
    """Usage of one answer, or of several choices of one request (one prompt, their answers)."""
    completion = final.completion_tokens + sum(f.completion_tokens for f in more)
    return {"prompt_tokens": final.prompt_tokens, "completion_tokens": completion,
            "total_tokens": final.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": final.cached_tokens}}


def _timings(final: Final) -> dict:
    t = final.timings
    return {"ttft_s": t.ttft, "image_encode_s": t.image_encode, "prefill_s": t.prefill,
            "first_token_s": t.first_token, "decode_s": t.decode, "decode_tokens_per_s": t.decode_tokens_per_s}
