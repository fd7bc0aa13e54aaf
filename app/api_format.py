"""`response_format` on /v1/chat/completions: {"type": "text"} (the default) or {"type":
"json_object"}, JSON mode, in which the engine chooses every token so that the answer is one valid
JSON object (ChatRequest.response_format; engine/runtime/constrained.py).

{"type": "json_schema", ...} is refused: the engine does not enforce a schema, and an answer that
claims to follow one without being held to it would be worse than a clear refusal. JSON mode takes
no tools (the answer must be one JSON object, and a function call is not one) and no stop strings
(they would cut the object short).
"""
from __future__ import annotations

from typing import Literal

from localchat.app.api_errors import ApiError

SCHEMA_REFUSAL = ("response_format {\"type\": \"json_schema\"} is not supported: localchat does not enforce a "
                  "JSON schema. Use {\"type\": \"json_object\"}, which guarantees one valid JSON object (describe "
                  "the fields you want in the prompt; they are not checked), or force a function call whose "
                  "parameters are your schema: 'tools' with that function and 'tool_choice' naming it.")


def parse_response_format(body: dict, tools: tuple[dict, ...]) -> Literal["text", "json_object"]:
    """The answer's format from `response_format`, checked against the request's `tools` (those the
    model is shown) and `stop`."""
    fmt = body.get("response_format")
    if fmt is None:
        return "text"
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        raise ApiError(400, SCHEMA_REFUSAL, param="response_format")
    if kind not in ("text", "json_object"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"} or {\"type\": \"json_object\"} "
                            f"(got {fmt!r}).", param="response_format")
    if kind == "json_object" and tools:
        raise ApiError(400, "response_format json_object cannot be combined with 'tools': the answer must be one "
                            "JSON object, and a function call is not one. Leave the tools out (or send "
                            "tool_choice \"none\"), or, to get the call's arguments as the object, force a call "
                            "with tool_choice instead of JSON mode.", param="response_format")
    if kind == "json_object" and body.get("stop"):
        raise ApiError(400, "response_format json_object cannot be combined with 'stop': the answer ends when its "
                            "object closes, and a stop string would cut the object short. Leave 'stop' out.",
                       param="stop")
    return kind
