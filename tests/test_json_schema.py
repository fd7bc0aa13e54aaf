"""Structured output: JSON schemas compiled (engine/runtime/json_schema.py) and the automaton that
holds an answer to one (engine/runtime/schema_constraint.py), checked against a small validator of
the same keywords written here from the JSON Schema specification, on hand-made and random schemas."""
import json
import random

import pytest
import torch

from localchat.engine.runtime.json_schema import SchemaError, compile_schema
from localchat.engine.runtime.schema_constraint import SchemaGrammar

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer"},
        "height": {"type": ["number", "null"]},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "é"]}, "maxItems": 2},
        "address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "tags": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "extra": {},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value", "children"]}},
    "$ref": "#/$defs/node",
}


def latin1(text: str) -> str:
    """Text as the automaton reads a token's text: one character per UTF-8 byte."""
    return text.encode("utf-8").decode("latin-1")


def accepts(grammar: SchemaGrammar, text: str):
    """(every prefix continues, the whole text is a complete answer)."""
    state = grammar.start
    for i, c in enumerate(latin1(text)):
        state = grammar.advance(state, c)
        if state is None:
            return False, False
    return True, grammar.is_complete(state)


def valid(schema: dict, value, root: dict | None = None) -> bool:
    """A JSON Schema validator for the keywords json_schema.py enforces (its key-order and
    listed-properties-only rules are narrower than validity and are not checked here)."""
    root = root if root is not None else schema
    if schema is True or schema == {}:
        return True
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/") if schema["$ref"] != "#" else []:
            target = target[part]
        return valid(target, value, root)
    if "anyOf" in schema:
        return any(valid(s, value, root) for s in schema["anyOf"])
    if "const" in schema:
        return json.dumps(value) == json.dumps(schema["const"])
    if "enum" in schema:
        return any(json.dumps(value) == json.dumps(v) for v in schema["enum"])
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else None
    if kinds is not None and not any(_is_type(value, k) for k in kinds):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if any(r not in value for r in schema.get("required", [])):
            return False
        for key, v in value.items():
            if key in props:
                if not valid(props[key], v, root):
                    return False
            elif schema.get("additionalProperties", True) is False:
                return False
            elif isinstance(schema.get("additionalProperties"), dict) and not valid(
                    schema["additionalProperties"], v, root):
                return False
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(valid(schema.get("items", True), v, root) for v in value)
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    return True


def _is_type(value, kind: str) -> bool:
    return {"object": isinstance(value, dict), "array": isinstance(value, list), "string": isinstance(value, str),
            "null": value is None, "boolean": isinstance(value, bool),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]


@pytest.mark.parametrize("text,complete", [
    ('{"name": "Ada", "age": 36}', True),
    ('{"name":"Ada","age":-3,"height":1.5e2,"pets":["cat","é"],"address":{"city":"Köln"},'
     '"tags":{"x":true,"y":false},"extra":[1,{"a":null}]}', True),
    ('  {\n  "name" : "A\\"\\u00e9" ,\n  "age" : 0 , "height" : null }\n', True),
    ('{"name":"Ada","age":36,"tags":{}}', True),
    ('{"name":"Ada","age":3', False),  # a prefix: alive, not yet complete
])
def test_answers_that_follow_the_schema_are_read_to_the_end(text, complete):
    grammar = SchemaGrammar(compile_schema(PERSON))
    alive, done = accepts(grammar, text)
    assert alive and done == complete
    if complete:
        assert valid(PERSON, json.loads(text))


@pytest.mark.parametrize("text", [
    '{"age": 36}',                              # a required property left out (and out of order)
    '{"name": "Ada", "age": 36.5}',             # not an integer
    '{"name": "Ada", "age": 1e3}',
    '{"name": "", "age": 1}',                   # shorter than minLength
    '{"name": "AdaLovelace", "age": 1}',        # longer than maxLength
    '{"age": 1, "name": "Ada"}',                # out of the schema's order
    '{"name": "Ada", "age": 1, "name": "B"}',   # twice
    '{"name": "Ada", "age": 1, "color": 3}',    # not listed
    '{"name": "Ada", "age": 1, "pets": ["cow"]}',
    '{"name": "Ada", "age": 1, "pets": ["cat", "dog", "cat"]}',  # more than maxItems
    '{"name": "Ada", "age": 1, "address": {}}',  # its required city
    '{"name": "Ada", "age": 1, "tags": {"x": 1}}',
    '{"name": "Ada", "age": 1, "height": "tall"}',
    '{"name": "Ada", "age": 1}x',
    '["name"]',
    '{"name": "Ada\n", "age": 1}',              # a raw control character
])
def test_answers_that_break_the_schema_stop_where_they_break(text):
    assert accepts(SchemaGrammar(compile_schema(PERSON)), text) == (False, False)


def test_recursive_refs_and_numbers_end_where_the_next_character_says():
    grammar = SchemaGrammar(compile_schema(TREE))
    text = '{"value":1,"children":[{"value":20,"children":[]},{"value":-3,"children":[{"value":0,"children":[]}]}]}'
    assert accepts(grammar, text) == (True, True)
    assert accepts(grammar, '{"value":01,"children":[]}') == (False, False)
    # a number's end is read from the character after it, even across tokens
    state = grammar.advance(grammar.start, '{"value":1')
    assert grammar.advance(state, "0") and grammar.advance(state, " ,") and grammar.advance(state, "}") is None
    assert not grammar.between_tokens(state) and grammar.between_tokens(grammar.advance(state, " "))


def test_enum_texts_that_start_alike_and_literals_across_tokens():
    schema = {"type": "object", "properties": {"n": {"enum": [1, 10, "1", None, True, {"a": [1]}]}}, "required": ["n"]}
    grammar = SchemaGrammar(compile_schema(schema))
    for n in ("1", "10", '"1"', "null", "true", '{"a":[1]}', '{ "a" : [ 1 ] } '):
        assert accepts(grammar, '{"n":' + n + "}") == (True, True), n
    for n in ("100", "2", '"10"', "nul", "false", '{"a":[2]}', '{"a":[1 1]}', '{"a":[1]}}'):
        assert not accepts(grammar, '{"n":' + n + "}")[1], n


@pytest.mark.parametrize("schema,phrase", [
    ({"type": "array"}, "top level must be an object"),
    ({"anyOf": [{"type": "object"}, {"type": "string"}]}, "top level must be an object"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' at #/properties/a is not supported"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}},
     "'pattern' at #/properties/a is not enforced"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}, "'minimum' at #/properties/a"),
    ({"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}, "'oneOf'"),
    ({"type": "object", "properties": {"a": {"type": "string", "x-thing": 1}}}, "unknown keyword 'x-thing'"),
    ({"type": "object", "required": ["a"]}, "names 'a', which 'properties' does not describe"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}}, "no value can match"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "points at nothing"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "only refs inside the schema"),
    ({"type": "object", "properties": {"a": {"type": "decimal"}}}, "not a JSON schema type"),
    ({"type": "object", "properties": {"a": False}}, "no value can match"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "non-empty list"),
])
def test_schemas_that_cannot_be_held_to_are_refused_saying_where(schema, phrase):
    with pytest.raises(SchemaError) as e:
        compile_schema(schema, strict=True)
    assert phrase in str(e.value)


def test_without_strict_unenforced_keywords_are_accepted_and_oneof_reads_as_anyof():
    schema = {"type": "object", "properties": {
        "when": {"type": "string", "format": "date-time"}, "n": {"type": "integer", "minimum": 0},
        "v": {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "x": {"type": "string", "x-note": 1}}}
    for strict in (True,):
        with pytest.raises(SchemaError) as e:
            compile_schema(schema, strict=strict)
        assert e.value.relaxable
    grammar = SchemaGrammar(compile_schema(schema, strict=False))
    assert accepts(grammar, '{"when":"soon","n":-1,"v":3,"x":"y"}') == (True, True)
    assert accepts(grammar, '{"v":"a"}') == (True, True)
    with pytest.raises(SchemaError) as e:  # a shape it cannot express is refused either way
        compile_schema({"type": "object", "properties": {"a": {"not": {}}}}, strict=False)
    assert not e.value.relaxable


# ---- random schemas, answers drawn from them, and what the automaton says of them and of their mutations


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "anyOf", "any"]
    if depth < 3:
        kinds += ["object", "array", "object", "map"]
    kind = rng.choice(kinds)
    if kind == "object":
        names = rng.sample(["a", "b", "ab", "é", "c d", 'q"', "a\\b"], rng.randint(1, 4))
        return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
                "required": [n for n in names if rng.random() < 0.5]}
    if kind == "map":
        return {"type": "object", "additionalProperties": random_schema(rng, depth + 1)}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low, "maxItems": low + rng.randint(0, 2)}
    if kind == "string":
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 3)}
    if kind == "enum":
        return {"enum": rng.sample(["x", "xy", 1, 12, -1.5, True, None, "ü", [1, 2]], rng.randint(1, 4))}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}
    if kind == "any":
        return {}
    return {"type": kind}


def random_value(rng: random.Random, schema: dict):
    if schema == {}:
        return rng.choice([None, 3, "s", [1, "é"], {"k": [True]}])
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return random_value(rng, rng.choice(schema["anyOf"]))
    kind = schema["type"]
    if kind == "object" and "properties" in schema:
        return {n: random_value(rng, s) for n, s in schema["properties"].items()
                if n in schema["required"] or rng.random() < 0.5}
    if kind == "object":
        return {rng.choice(["k", "é", "k2"]) + str(i): random_value(rng, schema["additionalProperties"])
                for i in range(rng.randint(0, 2))}
    if kind == "array":
        return [random_value(rng, schema["items"]) for _ in range(rng.randint(schema["minItems"], schema["maxItems"]))]
    if kind == "string":
        return "".join(rng.choice('ab\n"\\é€😀') for _ in range(rng.randint(schema["minLength"], schema["maxLength"])))
    if kind == "integer":
        return rng.randint(-50, 50)
    if kind == "number":
        return rng.choice([0, -7, 2.5, 1e-3, 6.02e23])
    return {"boolean": rng.choice([True, False]), "null": None}[kind]


def test_random_schemas_take_their_answers_and_refuse_broken_ones():
    rng = random.Random(int(torch.randint(2**31, ())))
    checked = 0
    for _ in range(150):
        inner = random_schema(rng, 1)
        schema = {"type": "object", "properties": {"v": inner, "w": {"type": "integer"}}, "required": ["v", "w"]}
        grammar = SchemaGrammar(compile_schema(schema))
        for _ in range(3):
            value = {"v": random_value(rng, inner), "w": rng.randint(0, 9)}
            # keys and enum texts are matched as the schema spells them, so \u escapes only where it has none
            escaped = rng.random() < 0.3 and json.dumps(schema, ensure_ascii=False).isascii()
            text = json.dumps(value, ensure_ascii=escaped, indent=rng.choice([None, 1]))
            assert accepts(grammar, text) == (True, True), (schema, text)
            # a mutated answer the automaton reads to the end must be valid: parse it and check it
            chars = list(text)
            chars[rng.randrange(len(chars))] = rng.choice('{}[]",:0a -e.\\n')
            mutated = "".join(chars)
            if accepts(grammar, mutated)[1]:
                assert valid(schema, json.loads(mutated)), (schema, mutated)
                checked += 1
    assert checked > 0


def test_every_state_on_the_way_has_a_next_character_and_a_way_to_the_end():
    """No state an answer can reach is a dead end: some character continues it, and closing
    characters first (then the rest of a small alphabet) always reach a complete answer."""
    rng = random.Random(int(torch.randint(2**31, ())))
    first = '"}],:'  # a space last: between tokens it may always come and changes nothing
    alphabet = first + "".join(chr(c) for c in range(33, 127) if chr(c) not in first) + "".join(map(chr, range(128, 256))) + " "
    for _ in range(60):
        inner = random_schema(rng, 1)
        schema = {"type": "object", "properties": {"v": inner}, "required": ["v"]}
        grammar = SchemaGrammar(compile_schema(schema))
        text = latin1(json.dumps({"v": random_value(rng, inner)}, ensure_ascii=False))
        state = grammar.advance(grammar.start, text[:rng.randrange(len(text))])
        for _ in range(400):
            if grammar.is_complete(state):
                break
            state = next((s for s in (grammar.advance(state, c) for c in alphabet) if s is not None), None)
            assert state is not None, (schema, text)
        assert grammar.is_complete(state), (schema, text)


def test_random_walks_never_reach_a_dead_end():
    """Characters drawn at random among those that fit, from the start: some character always fits
    (lengths at their limit in the middle of an escape, enum texts, nested refs)."""
    rng = random.Random(int(torch.randint(2**31, ())))
    alphabet = [chr(c) for c in range(256)]
    schemas = [PERSON, TREE, {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 3}},
                              "required": ["s"]}]
    for _ in range(40):
        schemas.append({"type": "object", "properties": {"v": random_schema(rng, 1)}, "required": ["v"]})
    for schema in schemas:
        grammar = SchemaGrammar(compile_schema(schema))
        for _ in range(3):
            state, text = grammar.start, ""
            for _ in range(120):
                if grammar.is_complete(state):
                    break
                # lean towards escapes and the structure, where dead ends would hide
                weights = [12 if c in '\\u"dDcC0123456789{}[],:' else 1 for c in alphabet]
                fitting = [(c, s) for c, s in ((c, grammar.advance(state, c)) for c in alphabet) if s is not None]
                assert fitting, (schema, text)
                c, state = rng.choices(fitting, weights=[weights[ord(c)] for c, _ in fitting])[0]
                text += c
