"""Function calls in each family's output, as ToolCall records.

GLM-4.5V writes a call in its answer as
`<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>` (one pair per
argument; a value is the bare text for a string, JSON otherwise), and may write several before it
ends its turn with `<|observation|>` (the format its chat template teaches; reference notes A.8).
gpt-oss writes a harmony message addressed to the function, `<|channel|>commentary
to=functions.NAME <|constrain|>json<|message|>{JSON arguments}<|call|>` (the recipient may also
follow the role instead: `<|start|>assistant to=functions.NAME<|channel|>commentary ...`), and
stops at `<|call|>` (notes C.5).

A forced call (ChatRequest.forced_call) is the start of such a call written after the generation
prompt (`forced_call_prefix`), so the model can only go on inside it: the function's name when one
is named, else the model writes the name itself. The output parser reads that start first, as if
the model had written it.
"""
from __future__ import annotations

import json
import re
import uuid

from .request import ForcedCall, ToolCall

_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_schemas(tools: tuple[dict, ...]) -> dict[str, dict]:
    """{function name: its parameters' JSON schema properties} of OpenAI-style tool entries."""
    out = {}
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _glm_value(raw: str, schema: dict | None):
    """A GLM argument value: the text itself for a string parameter (or one whose JSON does not
    parse), else its JSON value."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def glm_tool_call(inner: str, schemas: dict[str, dict]) -> ToolCall | None:
    """The call between `<tool_call>` and `</tool_call>`; None when it names no function."""
    head, _, _ = inner.partition("<arg_key>")
    name = head.strip()
    if not name:
        return None
    props = schemas.get(name, {})
    args = {key.strip(): _glm_value(value.strip("\n"), props.get(key.strip())) for key, value in _ARG.findall(inner)}
    return ToolCall(new_call_id(), name, json.dumps(args, ensure_ascii=False))


def harmony_recipient(header: str) -> str | None:
    """The function a harmony message header addresses (`to=functions.NAME`), or None."""
    match = _RECIPIENT.search(header)
    return match.group(1) if match else None


def harmony_tool_call(name: str, body: str) -> ToolCall:
    return ToolCall(new_call_id(), name, body.strip() or "{}")


# Each family's call syntax up to the function's name: where a forced call's answer starts.
_CALL_OPENERS = {"glm4v_moe": "<tool_call>", "gpt_oss": "<|channel|>commentary to=functions."}


def forced_call_prefix(family: str, forced: ForcedCall | None, tools: tuple[dict, ...]) -> str:
    """The start of a call the answer is made to begin with ("" when no call is forced): up to the
    function's name, or up to and including the name and what ends it when one is named. Raises
    ValueError when the call cannot be one of `tools`."""
    if forced is None:
        return ""
    if family not in _CALL_OPENERS:
        raise ValueError(f"forcing a function call is not supported for the {family} family")
    names = tool_schemas(tools)
    if not names:
        raise ValueError("a forced function call needs tools to call: pass them with the request")
    opener = _CALL_OPENERS[family]
    if forced.function is None:
        return opener
    if forced.function not in names:
        raise ValueError(f"the forced function {forced.function!r} is not among the request's tools "
                         f"({', '.join(names)})")
    if family == "glm4v_moe":
        return f"{opener}{forced.function}\n"
    return f"{opener}{forced.function} <|constrain|>json<|message|>"
