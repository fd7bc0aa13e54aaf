"""Function calling on /v1/chat/completions: the request's `tools`, `tool_choice`, assistant
`tool_calls` and `tool` messages in, the model's calls out, in the shapes of OpenAI's Chat
Completions reference (https://platform.openai.com/docs/api-reference/chat).

`tool_choice` "auto" (the default) lets the model decide whether to call; "none" hides the tools
from it. "required" and {"type": "function", "function": {"name": NAME}} force a call: the engine
writes the start of a call in the model's own syntax after the generation prompt (up to the name
when one is named), so the model can only go on inside it (ChatRequest.forced_call), and the
model does not think before a forced call. The arguments of a named forced call are then held
token by token to the function's `parameters` schema (in full for a function marked `"strict":
true`, which is refused when its schema cannot be held to), and so are those of a call the model
makes on its own to a strict function (engine/runtime/constrained.strict_calls); other calls'
arguments are the model's own, not checked against the schema.
"""
from __future__ import annotations

import json

from localchat.app.api_errors import ApiError
from localchat.engine.runtime.json_schema import SchemaError, compile_schema
from localchat.engine.runtime.request import ForcedCall, ToolCall

_CHOICE_SHAPES = ("'tool_choice' may be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": NAME}} naming one of 'tools'")


def parse_tools(body: dict, family: str) -> tuple[tuple[dict, ...], ForcedCall | None]:
    """(the tools the model is shown, each {"type": "function", "function": {...}}; the call it
    must make, None when it decides), for a model of `family`. No tools when none are given or
    tool_choice is "none"."""
    if body.get("functions") or body.get("function_call"):
        raise ApiError(400, "'functions' and 'function_call' are the deprecated form: send 'tools' "
                            "[{\"type\": \"function\", \"function\": {...}}] instead.", param="functions")
    tools = _tool_list(body.get("tools"))
    choice = body.get("tool_choice")
    if choice == "none":
        return (), None
    forced = _forced_call(choice, tools)
    _check_strict(tools, forced, family)
    return tools, forced


def _tool_list(tools: object) -> tuple[dict, ...]:
    if tools in (None, []):
        return ()
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of {\"type\": \"function\", \"function\": {...}}.", param="tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                "\"parameters\": {...}}}}.", param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object.",
                           param=f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": fn})
    return tuple(out)


def _check_strict(tools: tuple[dict, ...], forced: ForcedCall | None, family: str) -> None:
    """Where the engine holds a call's arguments to its function's schema (a named forced call:
    engine/runtime/constrained.forced_arguments_grammar), a function marked strict must have one
    it can hold them to in full."""
    if family not in ("gpt_oss", "glm4v_moe") or forced is None or forced.function is None:
        return
    i, fn = next((i, t["function"]) for i, t in enumerate(tools) if t["function"]["name"] == forced.function)
    if fn.get("strict") is not True:
        return
    try:
        compile_schema(fn.get("parameters") or {"type": "object"}, fn["name"], strict=True)
    except SchemaError as e:
        raise ApiError(400, f"tools[{i}] is strict, but its parameters cannot be held to: {e}. Fix the schema, "
                            "or leave out \"strict\": true (what cannot be enforced is then left to the model).",
                       param=f"tools[{i}].function.parameters") from None


def _forced_call(choice: object, tools: tuple[dict, ...]) -> ForcedCall | None:
    """The call tool_choice forces (other than "none"), checked against the tools offered."""
    if choice in (None, "auto"):
        return None
    forced = ForcedCall(_function_named(choice))
    if choice != "required" and forced.function is None:
        raise ApiError(400, f"{_CHOICE_SHAPES}; got {json.dumps(choice)}.", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if not names:
        raise ApiError(400, "'tool_choice' forces a function call, which needs 'tools' to call: add the functions "
                            "to 'tools', or leave 'tool_choice' out.", param="tool_choice")
    if forced.function is not None and forced.function not in names:
        raise ApiError(400, f"'tool_choice' names the function {forced.function!r}, which is not among 'tools' "
                            f"({', '.join(names)}): name one of them, or add it to 'tools'.", param="tool_choice")
    return forced


def _function_named(choice: object) -> str | None:
    """NAME of a {"type": "function", "function": {"name": NAME}} choice; None for other shapes."""
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def parse_tool_calls(raw: object, where: str) -> tuple[ToolCall, ...]:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ApiError(400, f"{where} must be a list.", param=where)
    calls = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}[{j}] needs function.name.", param=f"{where}[{j}]")
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
