"""The engine's public request and stream types: what app/ (UI, API, CLI) sends and receives.

Nothing here knows about tensors; app/ imports only this module and `engine.py`.
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Iterator, Literal, Protocol, Union

from PIL import Image, ImageOps

from ..spec import SamplingDefaults
from .json_schema import JsonSchema


@dataclass(frozen=True)
class TextPart:
    text: str


def upright_rgb(img: Image.Image) -> Image.Image:
    """A decoded image as the user saw it, in 8-bit RGB: turned as its EXIF orientation says (phone
    cameras store the sensor's rows and a tag; browsers apply it, Pillow does not), and anything
    transparent laid over white (dropping the alpha channel would show the colour stored under
    transparent pixels, usually black: black text on a transparent PNG would vanish)."""
    img = ImageOps.exif_transpose(img)
    if img.mode.startswith("I;16") or (img.mode == "I" and img.getextrema()[1] > 255):
        # 16-bit samples (scans, depth maps) at 8 bits, as a browser shows them; Pillow's own
        # conversion clips them, so all but the darkest pixels would turn white
        img = img.convert("I").point(lambda v: v / 257)
    if "A" in img.getbands() or "transparency" in img.info:
        img = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)), img.convert("RGBA"))
    return img.convert("RGB")


@dataclass(frozen=True)
class ImagePart:
    """An image as the user gave it; `sha256` of the encoded bytes keys the prefix cache and history."""

    image: Image.Image
    sha256: str

    @classmethod
    def from_bytes(cls, data: bytes) -> "ImagePart":
        img = Image.open(io.BytesIO(data))
        img.load()
        return cls(upright_rgb(img), hashlib.sha256(data).hexdigest())

    @classmethod
    def from_path(cls, path: str) -> "ImagePart":
        with open(path, "rb") as f:
            return cls.from_bytes(f.read())


Part = Union[TextPart, ImagePart]


@dataclass(frozen=True)
class ToolCall:
    """A function call the model asked for: `arguments` is a JSON object as text, as OpenAI's API
    carries it; `id` names the call so its result (a "tool" message) can refer to it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """role: "system" | "user" | "assistant" | "tool". `reasoning` is an assistant turn's thinking
    text, `tool_calls` the calls it made; a "tool" message is one call's result (its text), naming
    the call by `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: tuple[Part, ...]
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    @classmethod
    def text(cls, role: str, text: str) -> "Message":
        return cls(role, (TextPart(text),))


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. presence_penalty
    and frequency_penalty (OpenAI's, 0: off) count the generated tokens only; repetition_penalty
    (1.0: off) the whole context. logprobs: None returns no log-probabilities; 0 returns each
    generated token's own (Delta.logprobs); N > 0 also the N most likely tokens at its position.
    They are the model's distribution (log_softmax of the raw logits), before the penalties,
    temperature and filters above change it for sampling. logit_bias: (token id, bias) pairs
    added to those tokens' logits before the choice (OpenAI's, -100 to 100: -100 bans a token,
    100 all but forces it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 1024
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ForcedCall:
    """The answer must be a function call: to `function`, or to whichever of the request's tools
    the model picks when None (OpenAI's tool_choice {"type": "function", "function": {"name"}}
    and "required"). The engine writes the start of the call after the generation prompt; the
    arguments of a call to a named function follow its parameters' schema
    (constrained.forced_arguments_grammar); those of a call the model names follow it when the
    function is marked strict (constrained.strict_calls), else they are its own."""

    function: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """thinking: GLM thinking on/off. reasoning_effort: gpt-oss "low" | "medium" | "high".
    overflow: a conversation that does not fit the context (with room for the answer) is refused
    ("error", as OpenAI-compatible servers do) or has its oldest turns left out ("drop_oldest",
    engine/runtime/context_fit.py); dropped_hint: with "drop_oldest", how many messages after the
    system prompt an earlier answer of the same conversation left out (Final.dropped_messages),
    so the cut stays put and the prefix cache keeps serving the rest. tools: functions the model may
    call, each as OpenAI's {"type": "function", "function": {"name", "description", "parameters"
    (JSON schema)}}; the chat template shows them to the model and its calls come back as
    Delta.tool_calls. forced_call: None lets the model decide whether to call; a ForcedCall makes
    the answer start with a call to one of `tools`, with no thinking (GLM) or analysis (gpt-oss)
    before it. response_format: "text" (free text), "json_object" (JSON mode): every token is
    chosen so that the answer is one JSON object, which ends the answer when it closes (finish
    reason "stop"; "length" when cut off first), or "json_schema": the same, the object held to
    `response_schema` (a compiled json_schema.JsonSchema); in both the model answers at once, with
    no thinking (GLM) or analysis (gpt-oss), and takes no tools and no stop strings
    (engine/runtime/constrained.py)."""

    messages: tuple[Message, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: bool = True
    reasoning_effort: str = "medium"
    overflow: Literal["error", "drop_oldest"] = "error"
    dropped_hint: int = 0
    tools: tuple[dict, ...] = ()
    forced_call: ForcedCall | None = None
    response_format: Literal["text", "json_object", "json_schema"] = "text"
    response_schema: JsonSchema | None = None

    def __post_init__(self):
        if (self.response_format == "json_schema") != (self.response_schema is not None):
            raise ValueError("response_format 'json_schema' goes with a response_schema, and only it")


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model (natural log). token: the token's text on its
    own (the tokenizer's decode of that one id; U+FFFD where the token is only part of a multi-byte
    character); bytes: its exact UTF-8 bytes, so that the bytes of consecutive tokens join into
    the text (None: unknown); id: its vocabulary id (None when a remote server sent it). top: for
    a generated token, the most likely tokens at its position, most likely first (as many as
    SamplingParams.logprobs asks); empty for those alternatives themselves."""

    id: int | None
    token: str
    logprob: float
    bytes: tuple[int, ...] | None = None
    top: tuple["TokenLogprob", ...] = ()


@dataclass(frozen=True)
class Delta:
    """New answer text, new reasoning text and the token ids that produced them; tool_calls: calls
    the model finished writing with these tokens (each whole). logprobs: when the request asked
    (SamplingParams.logprobs), one entry per generated token in generation order, markup and the
    end-of-turn token included; a token's entry may come in a Delta without its id or text (the
    end-of-sequence token's, which is not in token_ids)."""

    text: str = ""
    reasoning: str = ""
    token_ids: tuple[int, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Timings:
    """Seconds. ttft = image_encode + prefill + first_token."""

    image_encode: float = 0.0
    prefill: float = 0.0
    first_token: float = 0.0
    decode: float = 0.0
    decode_tokens_per_s: float = 0.0
    # Submit -> first scheduled step (prompt building, waiting for a batch slot or KV blocks).
    # Not part of ttft, which counts the model's own work.
    queued: float = 0.0

    @property
    def ttft(self) -> float:
        return self.image_encode + self.prefill + self.first_token


@dataclass(frozen=True)
class Final:
    """The last item of every stream. finish_reason: "stop" | "length" | "abort" | "error" |
    "tool_calls" (the model stopped after calling tools, and waits for their results).
    dropped_messages: how many messages after the system prompt were left out to fit the context
    (ChatRequest.overflow "drop_oldest"; 0 otherwise). cached_tokens: how many of the prompt
    tokens were found in the prefix cache (not computed again)."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    prompt_token_ids: tuple[int, ...] = ()
    error: str | None = None
    dropped_messages: int = 0
    cached_tokens: int = 0


StreamItem = Union[Delta, Final]


class RequestStream(Protocol):
    """Iterate for Deltas, then exactly one Final. `close()` aborts the request in the engine."""

    def __iter__(self) -> Iterator[StreamItem]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ModelInfo:
    """placement: where the model runs (devices; with tensor parallelism every rank's device).
    weights_bytes: the weights held over all devices (0: unknown). kv_cache_bytes: the paged KV
    cache allocated over all devices; kv_cache_tokens: how many tokens its pool holds, shared by
    all running conversations (None: unknown, e.g. behind a remote backend); kv_window_tokens:
    with sliding-window layers (gpt-oss), how many tokens their separate pool holds (it keeps
    only each conversation's recent tokens; None: no such layers, or unknown). sampling: what the
    checkpoint recommends (new chats and API requests start from it; unknown fields None).
    weights_format: how the weights are held, in words ("FP8, channel scales", "MXFP4 experts,
    bf16 elsewhere", ...; None: unknown). vocab_size: how many token ids the model scores (None:
    unknown)."""

    name: str
    family: str
    context_length: int
    supports_images: bool
    reasoning: Literal["thinking", "effort"]
    placement: str = "cpu"
    weights_bytes: int = 0
    kv_cache_bytes: int | None = None
    kv_cache_tokens: int | None = None
    kv_window_tokens: int | None = None
    sampling: SamplingDefaults = SamplingDefaults()
    weights_format: str | None = None
    vocab_size: int | None = None


class ChatEngine(Protocol):
    """What app/ needs: the in-process engine and the remote OpenAI-compatible backend both fit."""

    def info(self) -> ModelInfo: ...

    def submit(self, request: ChatRequest) -> RequestStream: ...
