"""OpenAI's Responses API, `POST /v1/responses`, over the same engine as /v1/chat/completions.

Wire format from the Responses reference (https://platform.openai.com/docs/api-reference/responses):
a request's `instructions`, `input` (a string, or items: messages with input_text / input_image /
output_text parts, `function_call` and `function_call_output` items, `reasoning` items), function
`tools`, `tool_choice`, `text.format`, `reasoning.effort` and `max_output_tokens`; a `response`
object whose `output` holds a `reasoning` item (the model's reasoning, as `reasoning_text`
content), a `message` item (the answer, as `output_text`) and `function_call` items; streamed as
SSE events (`response.created`, `response.output_item.added`, `response.output_text.delta`, ...,
`response.completed` / `response.incomplete` / `response.failed`), each with a `sequence_number`.

The request is translated into the Chat Completions body that api_request.parse_request reads, so
both endpoints check fields, images, tools and formats the same way; errors name the Responses
field. Answered responses are kept in memory (the last STORED of them, unless the request says
`store: false`), so a request may go on from one with `previous_response_id`: its conversation
(input and output, not its instructions, as OpenAI documents) comes before the new input. They are
gone when localchat restarts; `conversation` objects and item references are refused.
"""
from __future__ import annotations

import copy
import json
import threading
import uuid
from collections import OrderedDict

from localchat.app.api_errors import ApiError
from localchat.engine.runtime.request import Delta, Final, Timings

# Chat Completions fields whose errors are reported under the Responses field they came from.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
           "reasoning_effort": "reasoning.effort"}
_PASSED_ON = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "stream", "model")
_STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "cancelled",
           "error": "failed"}


STORED = 64  # responses kept for previous_response_id
STORED_BYTES = 256 << 20  # and at most this much text and image data over all of them


class ResponseStore:
    """The conversations of the last STORED responses, by id, as Chat Completions messages
    (without the instructions, which a following response does not inherit), fewer when their
    text and images (base64 data URLs) would pass `max_bytes`. A conversation that goes on from a
    stored one shares its messages, which count once."""

    def __init__(self, size: int = STORED, max_bytes: int = STORED_BYTES):
        self.size, self.max_bytes = size, max_bytes
        self._conversations: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, rid: str) -> list[dict]:
        with self._lock:
            if rid not in self._conversations:
                raise ApiError(404, f"No response {rid!r} is kept here: localchat keeps the last {self.size} "
                                    "responses in memory (fewer when their images are large) until it restarts, "
                                    "and not those asked with store: false. Send the conversation so far in "
                                    "'input' instead.",
                               param="previous_response_id", code="response_not_found")
            self._conversations.move_to_end(rid)
            return list(self._conversations[rid])

    def put(self, rid: str, conversation: list[dict]) -> None:
        with self._lock:
            self._conversations[rid] = conversation
            while len(self._conversations) > self.size or (
                    len(self._conversations) > 1 and self._bytes() > self.max_bytes):
                self._conversations.popitem(last=False)

    def _bytes(self) -> int:
        """The characters of every distinct message text and image URL kept."""
        seen, total = set(), 0
        for conversation in self._conversations.values():
            for message in conversation:
                if id(message) in seen:
                    continue
                seen.add(id(message))
                content = message.get("content")
                parts = content if isinstance(content, list) else [{"text": content or ""}]
                total += sum(len(p.get("text") or "") + len((p.get("image_url") or {}).get("url") or "")
                             for p in parts if isinstance(p, dict))
        return total


def chat_body(body: object, store: ResponseStore | None = None) -> tuple[dict, list[dict]]:
    """(the Chat Completions body for a Responses request, its conversation: the messages after the
    instructions, which a stored response keeps); raises ApiError naming the field. With
    `previous_response_id`, the stored conversation comes first."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise ApiError(400, "'truncation' must be \"auto\" or \"disabled\".", param="truncation")
    if body.get("conversation"):
        raise ApiError(400, "localchat keeps no conversation objects: go on from a response with "
                            "'previous_response_id', or send the conversation so far in 'input'.", param="conversation")
    if body.get("background"):
        raise ApiError(400, "localchat answers in the foreground: leave out 'background' (or stream the answer).",
                       param="background")
    if body.get("top_logprobs") or "message.output_text.logprobs" in (body.get("include") or []):
        raise ApiError(400, "Log probabilities are served on /v1/chat/completions ('logprobs', 'top_logprobs'), "
                            "not on /v1/responses.", param="top_logprobs")
    out = {k: body[k] for k in _PASSED_ON if k in body}
    messages = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise ApiError(400, "'instructions' must be a string.", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    before = body.get("previous_response_id")
    if before is not None and not isinstance(before, str):
        raise ApiError(400, "'previous_response_id' must be a response id.", param="previous_response_id")
    conversation = (store.get(before) if before and store is not None else []) + _messages(body.get("input"))
    out["messages"] = messages + conversation
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body)
    if fmt is not None:
        out["response_format"] = _format(fmt)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        out["reasoning_effort"] = reasoning["effort"]
    return out, conversation


def responses_error(e: ApiError) -> ApiError:
    """`e` with its param named as the Responses request names it."""
    if e.param:
        head, dot, rest = e.param.partition(".")
        root, bracket, index = head.partition("[")
        if root == "messages":  # the messages do not line up with the input items (instructions, merged calls)
            e.param = "input"
        elif root in _PARAMS:
            e.param = _PARAMS[root] + bracket + index + dot + rest
    return e


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items.", param="input")
    out: list[dict] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to

    def assistant() -> dict:
        """The assistant message the next output item belongs to: the last one, unless a tool result
        or another turn came after it."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": None})
        if reasoning:
            out[-1]["reasoning_content"] = (out[-1].get("reasoning_content") or "") + "".join(reasoning)
            reasoning.clear()
        return out[-1]

    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ApiError(400, f"input[{i}] must be an object.", param=f"input[{i}]")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            content = _content(item.get("content"), i)
            if role == "assistant":
                message = assistant()
                message["content"] = content if message["content"] is None else _joined(message["content"], content)
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "")}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += [p.get("text", "") for p in parts if isinstance(p, dict)]
        elif kind == "item_reference":
            raise ApiError(400, f"input[{i}] refers to a stored item, and localchat stores none: send the item "
                                "itself.", param=f"input[{i}]")
        else:
            raise ApiError(400, f"input[{i}] is a '{kind}' item; localchat reads message, function_call, "
                                "function_call_output and reasoning items.", param=f"input[{i}].type")
    return out


def _content(content, i: int):
    """A message's content as Chat Completions writes it (a string, or text and image_url parts)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"input[{i}].content must be a string or a list of parts.", param=f"input[{i}].content")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        elif kind == "input_image":
            if not part.get("image_url"):
                raise ApiError(400, f"input[{i}]: localchat keeps no files, so an image must come as a base64 "
                                    "data: URL in 'image_url'.", param=f"input[{i}].content")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ApiError(400, f"input[{i}].content holds a '{kind}' part; localchat reads input_text, "
                                "input_image and output_text parts.", param=f"input[{i}].content")
    return parts


def _joined(before, after):
    def parts(content):
        return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
    return parts(before) + parts(after)


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"name\": ..., \"parameters\": {...}}.",
                       param="tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools[{i}] is a '{kind}' tool; localchat serves function tools only.",
                           param=f"tools[{i}].type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                           "strict") if tool.get(k) is not None}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict):
        raise ApiError(400, f"tool_choice {json.dumps(choice)} is not one localchat serves: use \"auto\", \"none\", "
                            "\"required\" or {\"type\": \"function\", \"name\": NAME}.", param="tool_choice")
    return choice


def _text_format(body: dict):
    """The request's `text.format`, None when it gives none."""
    text = body.get("text")
    return text.get("format") if isinstance(text, dict) else None


def _format(fmt):
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


class ResponseBuilder:
    """Turns an engine stream's items into the response's output items, and the stream events that
    build them: `feed` per Delta, `finish` with the Final. An item is open while its text grows
    (reasoning, or the answer's message) and closes when another kind of output begins."""

    def __init__(self, rid: str, created: int, model: str, body: dict, conversation: list[dict]):
        """conversation: the request's, as chat_body made it (what a stored response keeps)."""
        self.rid, self.created, self.model, self.body = rid, created, model, body
        self.conversation = conversation
        self.items: list[dict] = []
        self.open: int | None = None  # index of the reasoning or message item being written
        self.reasoning_tokens = 0

    def response(self, final: Final | None = None) -> dict:
        """The response object: in progress before `final`, then as it ended."""
        body = self.body
        status = "in_progress" if final is None else _STATUS.get(final.finish_reason, "completed")
        fmt = _text_format(body)
        out = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
               "model": self.model, "output": copy.deepcopy(self.items) if final is not None else [],
               "error": None, "incomplete_details": None, "instructions": body.get("instructions"),
               "max_output_tokens": body.get("max_output_tokens"), "metadata": body.get("metadata") or {},
               "parallel_tool_calls": body.get("parallel_tool_calls", True),
               "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True) is not False,
               "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
               "temperature": body.get("temperature"), "top_p": body.get("top_p"),
               "text": {"format": fmt or {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
               "tools": body.get("tools") or [], "truncation": body.get("truncation") or "disabled", "usage": None}
        if final is not None:
            out["usage"] = {"input_tokens": final.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": final.cached_tokens},
                            "output_tokens": final.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                            "total_tokens": final.prompt_tokens + final.completion_tokens}
            if status == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
            if status == "failed":
                out["error"] = {"code": "server_error", "message": final.error or "The engine failed while generating."}
        return out

    def feed(self, delta: Delta) -> list[dict]:
        events = []
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
            if not delta.text and not delta.tool_calls:
                self.reasoning_tokens += len(delta.token_ids)
        if delta.text:
            events += self._write("message", delta.text)
        for call in delta.tool_calls:
            events += self._close()
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call.id, "name": call.name,
                    "arguments": call.arguments, "status": "completed"}
            index = len(self.items)
            self.items.append(item)
            where = {"item_id": item["id"], "output_index": index}
            events += [{"type": "response.output_item.added", "output_index": index,
                        "item": {**item, "arguments": "", "status": "in_progress"}},
                       {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
                       {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments},
                       {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]
        return events

    def answered(self) -> list[dict]:
        """The conversation with this response's output as the assistant's turn, as chat messages."""
        turn = {"role": "assistant", "content": "".join(
            p["text"] for i in self.items if i["type"] == "message" for p in i["content"]) or None}
        reasoning = "".join(p["text"] for i in self.items if i["type"] == "reasoning" for p in i["content"])
        if reasoning:
            turn["reasoning_content"] = reasoning
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = calls
        return self.conversation + [turn]

    def finish(self, final: Final) -> list[dict]:
        """The events that close the open item and end the response."""
        status = _STATUS.get(final.finish_reason, "completed")
        events = self._close("incomplete" if status == "incomplete" else "completed")
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        return events + [{"type": kind, "response": self.response(final)}]

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.items[self.open]["type"] != kind:
            events += self._open(kind)
        item = self.items[self.open]
        item["content"][0]["text"] += text
        delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": delta_type, "item_id": item["id"], "output_index": self.open, "content_index": 0,
                 "delta": text}
        if kind == "message":
            event["logprobs"] = []
        return events + [event]

    def _open(self, kind: str) -> list[dict]:
        events = self._close()
        if kind == "reasoning":
            item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant", "content": [],
                    "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open = len(self.items)
        self.items.append(item)
        events.append({"type": "response.output_item.added", "output_index": self.open, "item": copy.deepcopy(item)})
        item["content"].append(part)
        events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": self.open,
                       "content_index": 0, "part": copy.deepcopy(part)})
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.items[index]
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = {"type": "response.reasoning_text.done", **where, "text": part["text"]}
        else:
            done = {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []}
        item["status"] = status
        return [done, {"type": "response.content_part.done", **where, "part": copy.deepcopy(part)},
                {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)}]


def keep(store: ResponseStore, builder: ResponseBuilder, final: Final) -> None:
    """Stores an answered response unless its request said store: false."""
    if final.finish_reason in ("stop", "tool_calls", "length") and builder.body.get("store", True) is not False:
        store.put(builder.rid, builder.answered())


async def response_events(source, builder: ResponseBuilder, store: ResponseStore):
    """SSE for one streamed response. `source` is the api's event source over the engine stream
    (async `next()`, `finished`, `close_unless_finished()`); leaving early closes it, which aborts
    the request."""
    sequence = 0

    def sse(event: dict) -> str:
        nonlocal sequence
        event = {**event, "sequence_number": sequence}
        sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    try:
        yield sse({"type": "response.created", "response": builder.response()})
        yield sse({"type": "response.in_progress", "response": builder.response()})
        while True:
            item = await source.next()
            if item is None:  # the stream ended without its Final (the engine went away)
                item = Final("error", 0, 0, Timings(), error="The engine stopped before the answer ended.")
            if isinstance(item, Final):
                source.finished = True
                events = builder.finish(item)
                keep(store, builder, item)
                for event in events:
                    yield sse(event)
                break
            for event in builder.feed(item):
                yield sse(event)
    finally:
        source.close_unless_finished()
