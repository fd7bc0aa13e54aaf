"""GLM-4.5V's tagged arguments to a forced call held to the function's schema
(engine/runtime/glm_arguments.py): what it takes and refuses, that what it takes parses back
(tool_calls.glm_tool_call) into arguments that follow the schema, and that it has no dead ends."""
import json
import random

import pytest
import torch

from localchat.engine.runtime.glm_arguments import glm_arguments_grammar
from localchat.engine.runtime.json_schema import compile_schema
from localchat.engine.runtime.tool_calls import glm_tool_call, tool_schemas
from test_json_schema import latin1, random_schema, random_value, valid

BOOKING = {"type": "object", "properties": {
    "restaurant": {"type": "string", "minLength": 2, "maxLength": 8}, "people": {"type": "integer"},
    "time": {"type": "string", "enum": ["18:00", "19:30"]}, "note": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["restaurant", "people"]}


def grammar_of(schema):
    return glm_arguments_grammar(compile_schema(schema).root, schema)


def tagged(args: dict, schema: dict) -> str:
    """The arguments as GLM's chat template writes them after `<tool_call>NAME\\n`."""
    props = schema.get("properties", {})
    pairs = [f"<arg_key>{k}</arg_key>\n<arg_value>"
             f"{v if props.get(k, {}).get('type') == 'string' else json.dumps(v, ensure_ascii=False)}</arg_value>"
             for k, v in args.items()]
    return "\n".join(pairs) + ("\n" if pairs else "") + "</tool_call>"


def reads(grammar, text):
    state = grammar.advance(grammar.start, latin1(text))
    return state is not None, state is not None and grammar.is_complete(state)


@pytest.mark.parametrize("args", [
    {"restaurant": "Chez <b>", "people": 4},
    {"restaurant": "Noma", "people": 2, "time": "19:30", "note": "window\nplease </arg", "tags": ["quiet"]},
    {"restaurant": "Köln", "people": -1, "tags": []},
])
def test_arguments_that_follow_the_schema_parse_back(args):
    text = tagged(args, BOOKING)
    assert reads(grammar_of(BOOKING), text) == (True, True)
    call = glm_tool_call("book\n" + text.removesuffix("</tool_call>"), tool_schemas(
        ({"type": "function", "function": {"name": "book", "parameters": BOOKING}},)))
    assert json.loads(call.arguments) == args


@pytest.mark.parametrize("text", [
    "</tool_call>",                                                            # required arguments missing
    "<arg_key>people</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",      # out of order, restaurant missing
    "<arg_key>restaurant</arg_key>\n<arg_value>X</arg_value>",                # shorter than minLength
    "<arg_key>restaurant</arg_key>\n<arg_value>\nNoma</arg_value>",
    "<arg_key>restaurant</arg_key>\n<arg_value>Noma\n</arg_value>",
    "<arg_key>restaurant</arg_key>\n<arg_value>Trattoria Roma</arg_value>",   # longer than maxLength
    "<arg_key>restaurant</arg_key>\n<arg_value>Noma</arg_value>\n<arg_key>people</arg_key>\n<arg_value>2.5",
    "<arg_key>restaurant</arg_key>\n<arg_value>Noma</arg_value>\n<arg_key>people</arg_key>\n<arg_value>2"
    "</arg_value>\n<arg_key>time</arg_key>\n<arg_value>20:00",
    "<arg_key>restaurant</arg_key>\n<arg_value>Noma</arg_value>\n<arg_key>people</arg_key>\n<arg_value>2"
    "</arg_value>\n<arg_key>price</arg_key>",                                 # not listed
    "<arg_key>restaurant</arg_key>\n<arg_value>Noma</arg_value>\n<arg_key>people</arg_key>\n<arg_value>2"
    "</arg_value>\n</tool_call>x",
])
def test_arguments_that_break_the_schema_stop_where_they_break(text):
    """(and a text value with a line break at either end, which the parser would strip)"""
    assert reads(grammar_of(BOOKING), text) == (False, False)


def test_random_schemas_take_their_arguments_and_never_dead_end():
    rng = random.Random(int(torch.randint(2**31, ())))
    alphabet = [chr(c) for c in range(256)] + ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "</tool_call>"]
    for _ in range(60):
        inner = random_schema(rng, 1)
        names = rng.sample(["a", "b c", "é"], rng.randint(1, 3))
        schema = {"type": "object", "properties": {n: rng.choice([inner, {"type": "string", "minLength": 0, "maxLength": 4}])
                                                   for n in names},
                  "required": [n for n in names if rng.random() < 0.5]}
        grammar = grammar_of(schema)
        args = {n: random_value(rng, s) for n, s in schema["properties"].items()
                if n in schema["required"] or rng.random() < 0.5}
        if any(isinstance(v, str) and (v.startswith("\n") or v.endswith("\n")) for v in args.values()):
            continue  # the parser strips those line breaks, so the grammar writes no such value
        text = tagged(args, schema)
        assert reads(grammar, text) == (True, True), (schema, text)
        call = glm_tool_call("f\n" + text.removesuffix("</tool_call>"), tool_schemas(
            ({"type": "function", "function": {"name": "f", "parameters": schema}},)))
        assert valid(schema, json.loads(call.arguments)), (schema, text, call.arguments)
        # a random walk over what fits never finds no way on
        state = grammar.start
        for _ in range(150):
            if grammar.is_complete(state):
                break
            fitting = [s for s in (grammar.advance(state, c) for c in alphabet) if s is not None]
            assert fitting, schema
            state = rng.choice(fitting)
