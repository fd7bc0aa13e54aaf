"""Function calling on /v1/chat/completions: the request's `tools`, `tool_choice`, assistant
`tool_calls` and `tool` messages in, the model's calls out, in the shapes of OpenAI's Chat
Completions reference (https://platform.openai.com/docs/api-reference/chat).

The model decides whether to call (`tool_choice` "auto", the default when tools are given);
"none" hides the tools from it. Forcing a call ("required", or one named function) would need
decoding constrained to the call syntax, which the engine does not do, so it is refused rather
than silently not honoured.
"""
from __future__ import annotations

import json

from localchat.engine.runtime.request import ToolCall


class ToolsError(ValueError):
    """A malformed tools field: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


def parse_tools(body: dict) -> tuple[dict, ...]:
    """The tools the model is shown, each {"type": "function", "function": {...}}; () when none
    are given or tool_choice is "none"."""
    if body.get("functions") or body.get("function_call"):
        raise ToolsError("'functions' and 'function_call' are the deprecated form: send 'tools' "
                         "[{\"type\": \"function\", \"function\": {...}}] instead.", "functions")
    tools = body.get("tools")
    if tools in (None, []):
        return ()
    if not isinstance(tools, list):
        raise ToolsError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}.", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolsError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}}.", f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object.",
                             f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": fn})
    choice = body.get("tool_choice", "auto")
    if choice == "none":
        return ()
    if choice != "auto":
        raise ToolsError("localchat lets the model decide whether to call a tool: 'tool_choice' may be \"auto\" "
                         "or \"none\" (a forced call, \"required\" or a named function, is not supported).",
                         "tool_choice")
    return tuple(out)


def parse_tool_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ToolsError(f"{where} must be a list.", where)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ToolsError(f"{where}[{j}] needs function.name.", f"{where}[{j}]")
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):  # lenient: an object given as such
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = call.get("id")
        calls.append(ToolCall(call_id if isinstance(call_id, str) else f"call_{j}", name, arguments))
    return tuple(calls)


def tool_call_json(call: ToolCall, index: int | None = None) -> dict:
    """A call as the API returns it; `index` only in streamed deltas."""
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}
