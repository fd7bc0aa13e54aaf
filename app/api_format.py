"""`response_format` on /v1/chat/completions: {"type": "text"} (the default), {"type":
"json_object"} (JSON mode: the engine chooses every token so that the answer is one valid JSON
object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (structured output:
the object also follows the schema; engine/runtime/json_schema.py says which keywords are held to,
and a schema that cannot be is refused with the keyword and where it stands). Either JSON format
takes no tools (the answer must be one JSON object, and a function call is not one) and no stop
strings (they would cut the object short).
"""
from __future__ import annotations

from typing import Literal

from localchat.app.api_errors import ApiError
from localchat.engine.runtime.json_schema import JsonSchema, SchemaError, compile_schema

Format = Literal["text", "json_object", "json_schema"]


def parse_response_format(body: dict, tools: tuple[dict, ...]) -> tuple[Format, JsonSchema | None]:
    """The answer's format from `response_format` and, for json_schema, the compiled schema;
    checked against the request's `tools` (those the model is shown) and `stop`."""
    fmt = body.get("response_format")
    if fmt is None:
        return "text", None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}} "
                            f"(got {fmt!r}).", param="response_format")
    if kind == "text":
        return "text", None
    if tools:
        raise ApiError(400, f"response_format {kind} cannot be combined with 'tools': the answer must be one JSON "
                            "object, and a function call is not one. Leave the tools out (or send tool_choice "
                            "\"none\"), or, to get the call's arguments as the object, force a call with "
                            "tool_choice instead.", param="response_format")
    if body.get("stop"):
        raise ApiError(400, f"response_format {kind} cannot be combined with 'stop': the answer ends when its "
                            "object closes, and a stop string would cut the object short. Leave 'stop' out.",
                       param="stop")
    if kind == "json_object":
        return "json_object", None
    return "json_schema", _schema(fmt.get("json_schema"))


def _schema(spec) -> JsonSchema:
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "response_format json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}} "
                            "with the schema as a JSON object.", param="response_format")
    name = spec.get("name", "answer")
    strict = spec.get("strict") or False
    if not isinstance(name, str) or not isinstance(strict, bool):
        raise ApiError(400, "response_format json_schema: 'name' must be a string and 'strict' true or false.",
                       param="response_format")
    try:
        return compile_schema(spec["schema"], name=name, strict=strict)
    except SchemaError as e:
        hint = (", or send \"strict\": false to accept an answer that may not meet it (oneOf then reads as anyOf)"
                if e.relaxable else "")
        raise ApiError(400, f"response_format json_schema: {e}{hint}.", param="response_format") from None
