"""A Chat Completions request body -> the engine's ChatRequest, checked field by field by hand (not
by pydantic), so that every malformed request gets OpenAI's error shape (ApiError) naming the field.
Function calling, JSON mode and log probabilities are read by api_tools.py, api_format.py and
api_logprobs.py."""
from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, replace

from localchat.app.api_errors import ApiError
from localchat.app.api_format import parse_response_format
from localchat.app.api_logprobs import parse_logit_bias, parse_logprobs
from localchat.app.api_tools import parse_tool_calls, parse_tools
from localchat.app.defaults import ANSWER_TOKENS
from localchat.app.ui_images import ImageLimits, ImageRejected, check_count, prepare_images
from localchat.engine.runtime.request import ChatRequest, ImagePart, Message, ModelInfo, SamplingParams, TextPart

MAX_CHOICES = 8  # 'n': answers to one request, all decoded together

DEFAULT_MAX_TOKENS = ANSWER_TOKENS
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<b64>.*)$", re.S)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(frozen=True)
class ParsedRequest:
    """A checked request: the engine's part, and how the answer goes back (streamed, with usage)."""

    chat: ChatRequest
    stream: bool
    include_usage: bool
    n: int = 1

    def choices(self) -> list[ChatRequest]:
        """One engine request per choice; with a seed, choice i samples with seed + i, so the
        choices differ and the same request gives the same choices again."""
        seed = self.chat.sampling.seed
        return [self.chat if i == 0 or seed is None else
                replace(self.chat, sampling=replace(self.chat.sampling, seed=seed + i)) for i in range(self.n)]

    @property
    def logprobs(self) -> bool:
        return self.chat.sampling.logprobs is not None


def parse_request(body: object, info: ModelInfo, limits: ImageLimits) -> ParsedRequest:
    """Turn a Chat Completions body into a ChatRequest, or raise ApiError naming the bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != info.name:
        raise unknown_model(model, info)
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(400, f"'n' must be an integer from 1 to {MAX_CHOICES} (got {n!r}).", param="n")
    logprobs = parse_logprobs(body)
    tools, forced_call = parse_tools(body, info.family)
    response_format, response_schema = parse_response_format(body, tools)
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
        logit_bias=parse_logit_bias(body, info.vocab_size),
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
                       forced_call=forced_call, response_format=response_format,
                       response_schema=response_schema)
    return ParsedRequest(chat, stream, include_usage, n)


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
        images = {j: p for j, p in enumerate(content) if isinstance(p, dict) and p.get("type") == "image_url"}
        try:
            check_count(len(images), limits)
        except ImageRejected as e:
            raise ApiError(400, str(e), param=f"messages[{i}].content", code="too_many_images")
        ready = _image_parts(images, i, role, info, limits)
        for j, p in enumerate(content):
            parts.append(ready[j] if j in ready else _parse_part(p, f"messages[{i}].content[{j}]"))
    elif content is None and role == "assistant":
        pass
    else:
        raise ApiError(400, f"messages[{i}].content must be a string or a list of parts.",
                       param=f"messages[{i}].content")
    reasoning = m.get("reasoning_content") if role == "assistant" else None
    calls = parse_tool_calls(m.get("tool_calls"), f"messages[{i}].tool_calls") if role == "assistant" else ()
    return Message(role, tuple(parts), reasoning if isinstance(reasoning, str) else None, calls,
                   m.get("tool_call_id") if role == "tool" else None)


def _parse_part(p: object, where: str) -> TextPart:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind == "text" and isinstance(p.get("text"), str):
        return TextPart(p["text"])
    raise ApiError(400, f"{where}: part type {kind!r} is not supported; use 'text' or 'image_url'.", param=where)


def _image_parts(images: dict[int, dict], i: int, role: str, info: ModelInfo,
                 limits: ImageLimits) -> dict[int, ImagePart]:
    """Message i's image parts by index, checked, then decoded and prepared side by side."""
    wheres = {j: f"messages[{i}].content[{j}]" for j in images}
    files = [(_image_bytes(p, wheres[j], role, info), wheres[j]) for j, p in images.items()]
    try:
        prepared = prepare_images(files, limits)
    except ImageRejected as e:
        raise ApiError(400, str(e), param=e.name, code="invalid_image")
    return {j: image.part for j, image in zip(images, prepared)}


def _image_bytes(p: dict, where: str, role: str, info: ModelInfo) -> bytes:
    """The encoded image an image_url part carries."""
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
        return base64.b64decode(match["b64"], validate=False)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the base64 image data is malformed.", param=where, code="invalid_image_url")


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


def unknown_model(model: str, info: ModelInfo) -> ApiError:
    return ApiError(404, f"The model {model!r} is not loaded; this server runs {info.name!r} "
                         "(see GET /v1/models).", param="model", code="model_not_found")
