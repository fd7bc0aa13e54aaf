"""A JSON schema compiled into the value shapes that schema_constraint.py holds an answer to.

What is enforced, character by character: `type` (object, array, string, number, integer, boolean,
null, or a list of them), `properties` with `required`, `additionalProperties` (a schema or a
boolean, for objects that list no properties), `items`, `minItems` / `maxItems`, `minLength` /
`maxLength`, `enum`, `const`, `anyOf`, `allOf` of one schema, and `$ref` to `#`, `#/$defs/...` or
`#/definitions/...` (recursion included). Annotations (`title`, `description`, `default`,
`examples`, ...) are ignored.

An object's listed properties are written in the order the schema lists them, each at most once;
a required one cannot be left out and the others may be. Properties the schema does not list are
never written (the answer stays valid: extra properties are only ever allowed, not required). An
object that lists none takes any keys, with values of `additionalProperties` (any value when it is
absent or true).

Keywords that narrow a value in ways the automaton cannot follow character by character (`pattern`,
`format`, numeric bounds, `uniqueItems`, ...) are refused under `strict: true`, since an answer
claimed to follow the schema must follow all of it; without strict they are accepted and not
enforced, and `oneOf` is then read as `anyOf`. Shapes it cannot express at all (`not`,
`if`/`then`/`else`, `prefixItems`, `patternProperties`, ...) are always refused. Every refusal is
a SchemaError naming the keyword and where it stands (a JSON pointer into the schema).

Keys and `enum` / `const` texts are kept as the automaton reads an answer: the UTF-8 bytes of
their JSON text, one character per byte (Latin-1), so a token carrying part of a multi-byte
character matches byte by byte.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

_ANNOTATIONS = frozenset((
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "discriminator"))
# Narrowing keywords not followed: refused under strict, else accepted and not enforced.
_UNENFORCED = frozenset((
    "pattern", "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "minProperties", "maxProperties", "contentEncoding", "contentMediaType"))
# Shapes the automaton cannot express: always refused.
_REFUSED = frozenset((
    "not", "if", "then", "else", "prefixItems", "patternProperties", "propertyNames", "contains",
    "minContains", "maxContains", "dependentRequired", "dependentSchemas", "dependencies",
    "unevaluatedProperties", "unevaluatedItems", "additionalItems", "$dynamicRef", "$anchor"))
_KNOWN = frozenset((
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "minLength", "maxLength", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions"))
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


class SchemaError(ValueError):
    """A schema that cannot be held to; the message names the keyword and its JSON pointer.
    relaxable: whether compiling without strict would accept it (the keyword then not enforced)."""

    def __init__(self, message: str, relaxable: bool = False):
        super().__init__(message)
        self.relaxable = relaxable


class Node:
    """One schema position. Compared by identity: each compiled position is its own node."""
    __slots__ = ()


@dataclass(frozen=True, eq=False)
class ObjectNode(Node):
    """keys[i]: property i's key as written, quotes included (Latin-1 view of its UTF-8 bytes), of
    the property named names[i]; values[i] its schema; required[i] whether it must be written.
    additional: the value schema of an object that lists no properties (any keys), None when such
    an object must stay empty."""
    keys: tuple[str, ...]
    values: tuple[Node, ...]
    required: tuple[bool, ...]
    additional: Node | None
    names: tuple[str, ...] = ()

    def next_properties(self, start: int) -> range:
        """The listed properties that may come next when those before `start` are done: up to the
        first required one from `start` on (which cannot be skipped), else all the rest."""
        for i in range(start, len(self.keys)):
            if self.required[i]:
                return range(start, i + 1)
        return range(start, len(self.keys))

    def may_close(self, start: int) -> bool:
        """Whether the object may end when the properties before `start` are done."""
        return not any(self.required[start:])


@dataclass(frozen=True, eq=False)
class ArrayNode(Node):
    items: Node
    min_items: int = 0
    max_items: int | None = None


@dataclass(frozen=True, eq=False)
class StringNode(Node):
    """Lengths in characters (code points), as JSON schema counts them."""
    min_length: int = 0
    max_length: int | None = None


@dataclass(frozen=True, eq=False)
class NumberNode(Node):
    integer: bool = False


@dataclass(frozen=True, eq=False)
class LiteralsNode(Node):
    """One of a fixed set of JSON texts (enum, const, true / false, null), each as written."""
    texts: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class AnyOfNode(Node):
    options: tuple[Node, ...]


@dataclass(eq=False)
class RefNode(Node):
    """A `$ref`, pointing at its target once that is compiled (the target may contain the ref)."""
    pointer: str
    target: Node | None = None


@dataclass(frozen=True, eq=False)
class AnyValueNode(Node):
    """Any JSON value."""


ANY_VALUE = AnyValueNode()
ANY_OBJECT = ObjectNode((), (), (), ANY_VALUE)
ANY_ARRAY = ArrayNode(ANY_VALUE)
ANY_STRING = StringNode()
ANY_NUMBER = NumberNode()
ANY_LITERAL = LiteralsNode(("true", "false", "null"))


@dataclass(frozen=True, eq=False)
class JsonSchema:
    """A compiled schema. name / strict / source as the request gave them (source is forwarded
    unchanged to a remote server)."""
    root: Node
    name: str = "answer"
    strict: bool = False
    source: dict = field(default_factory=dict)


def latin1(text: str) -> str:
    """`text` in the automaton's view: its UTF-8 bytes, one character each."""
    return text.encode("utf-8").decode("latin-1")


def written(value) -> str:
    """A JSON value's text as the answer would hold it (compact), in the automaton's Latin-1 view."""
    return latin1(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def concrete(node: Node) -> list[Node]:
    """The nodes a value of `node` may take, through refs and anyOf. A ref or anyOf that reaches
    itself without an object or array in between admits no finite value and is left out."""
    out: list[Node] = []

    def visit(n: Node, seen: frozenset) -> None:
        if isinstance(n, RefNode):
            if n not in seen:
                visit(n.target, seen | {n})
        elif isinstance(n, AnyOfNode):
            if n not in seen:
                for option in n.options:
                    visit(option, seen | {n})
        elif n not in out:
            out.append(n)

    visit(node, frozenset())
    return out


def compile_schema(schema, name: str = "answer", strict: bool = False) -> JsonSchema:
    """Raises SchemaError saying what cannot be held to and where. The top level must be an object."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    root = _Compiler(schema, strict).node(schema, "#")
    shapes = concrete(root)
    if not shapes or not all(isinstance(n, ObjectNode) for n in shapes):
        raise SchemaError("the schema's top level must be an object (\"type\": \"object\"): the answer is one "
                          "JSON object")
    return JsonSchema(root, name, strict, schema)


class _Compiler:
    def __init__(self, document: dict, strict: bool):
        self.document, self.strict = document, strict
        self.refs: dict[str, RefNode] = {}

    def node(self, schema, pointer: str) -> Node:
        if schema is True or schema == {}:
            return ANY_VALUE
        if schema is False:
            raise SchemaError(f"the schema at {pointer} is false: no value can match it")
        if not isinstance(schema, dict):
            raise SchemaError(f"the schema at {pointer} must be an object or a boolean")
        self._check_keywords(schema, pointer)
        if "$ref" in schema:
            if set(schema) - _ANNOTATIONS - {"$ref", "$defs", "definitions"}:
                raise SchemaError(f"{pointer}: keywords beside $ref are not supported; move them into the schema "
                                  "the ref points to")
            return self._ref(schema["$ref"], pointer)
        if "allOf" in schema:
            parts = schema["allOf"]
            if not isinstance(parts, list) or len(parts) != 1 or set(schema) - _ANNOTATIONS - {"allOf", "$defs",
                                                                                                 "definitions"}:
                raise SchemaError(f"{pointer}: allOf is supported only with one schema and nothing beside it")
            return self.node(parts[0], f"{pointer}/allOf/0")
        for union in ("anyOf", "oneOf"):
            if union in schema:
                if union == "oneOf" and self.strict:
                    raise SchemaError(f"'oneOf' at {pointer} is not enforced (an answer could match two of its "
                                      "schemas); use anyOf", relaxable=True)
                options = schema[union]
                if not isinstance(options, list) or not options:
                    raise SchemaError(f"{pointer}/{union} must be a non-empty list of schemas")
                rest = {k: v for k, v in schema.items() if k not in _ANNOTATIONS and k != union
                        and k not in ("$defs", "definitions")}
                return AnyOfNode(tuple(self.node({**rest, **o} if rest and isinstance(o, dict) else o,
                                                 f"{pointer}/{union}/{i}") for i, o in enumerate(options)))
        if "const" in schema:
            return LiteralsNode((written(schema["const"]),))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"{pointer}/enum must be a non-empty list")
            return LiteralsNode(tuple(dict.fromkeys(written(v) for v in values)))
        kind = schema.get("type")
        if kind is None:
            kind = _implied_type(schema)
        if isinstance(kind, list):
            if not kind:
                raise SchemaError(f"{pointer}/type must not be an empty list")
            return AnyOfNode(tuple(self._typed(schema, k, pointer) for k in dict.fromkeys(kind)))
        return self._typed(schema, kind, pointer)

    def _check_keywords(self, schema: dict, pointer: str) -> None:
        for key in schema:
            if key in _REFUSED:
                raise SchemaError(f"'{key}' at {pointer} is not supported: localchat cannot hold an answer to it; "
                                  "remove it")
            if key in _UNENFORCED and self.strict:
                raise SchemaError(f"'{key}' at {pointer} is not enforced by localchat; remove it", relaxable=True)
            if key not in _KNOWN and key not in _ANNOTATIONS and key not in _UNENFORCED and self.strict:
                raise SchemaError(f"unknown keyword '{key}' at {pointer}; remove it", relaxable=True)

    def _typed(self, schema: dict, kind, pointer: str) -> Node:
        if kind == "any":
            return ANY_VALUE
        if kind not in _TYPES:
            raise SchemaError(f"{pointer}/type: {kind!r} is not a JSON schema type (one of {', '.join(_TYPES)})")
        if kind == "object":
            return self._object(schema, pointer)
        if kind == "array":
            items = schema.get("items", True)
            low, high = _bounds(schema, "minItems", "maxItems", pointer)
            return ArrayNode(self.node(items, f"{pointer}/items"), low, high)
        if kind == "string":
            low, high = _bounds(schema, "minLength", "maxLength", pointer)
            return StringNode(low, high) if (low, high) != (0, None) else ANY_STRING
        if kind in ("number", "integer"):
            return NumberNode(kind == "integer")
        return LiteralsNode(("true", "false") if kind == "boolean" else ("null",))

    def _object(self, schema: dict, pointer: str) -> ObjectNode:
        properties = schema.get("properties") or {}
        if not isinstance(properties, dict):
            raise SchemaError(f"{pointer}/properties must be an object")
        required = schema.get("required") or []
        missing = [r for r in required if r not in properties]
        if missing:
            raise SchemaError(f"{pointer}/required names {missing[0]!r}, which 'properties' does not describe; "
                              "describe it under properties")
        if properties:
            names = list(properties)
            return ObjectNode(tuple(written(n) for n in names),
                              tuple(self.node(properties[n], f"{pointer}/properties/{_escape(n)}") for n in names),
                              tuple(n in required for n in names), None, tuple(names))
        extra = schema.get("additionalProperties", True)
        return ObjectNode((), (), (), None if extra is False else self.node(extra, f"{pointer}/additionalProperties"))

    def _ref(self, ref, pointer: str) -> Node:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError(f"$ref {ref!r} at {pointer}: only refs inside the schema (\"#\", \"#/$defs/...\") "
                              "are supported")
        if ref in self.refs:
            return self.refs[ref]
        target = self.document
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"$ref {ref!r} at {pointer} points at nothing in the schema")
            target = target[part]
        node = self.refs[ref] = RefNode(ref)
        node.target = self.node(target, ref)
        return node


def _implied_type(schema: dict):
    """The type a schema without `type` describes by its keywords, or "any"."""
    if "properties" in schema or "additionalProperties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "minItems" in schema or "maxItems" in schema:
        return "array"
    if "minLength" in schema or "maxLength" in schema:
        return "string"
    return "any"


def _bounds(schema: dict, low_key: str, high_key: str, pointer: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key, value in ((low_key, low), (high_key, high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise SchemaError(f"{pointer}/{key} must be a non-negative integer")
    if high is not None and low > high:
        raise SchemaError(f"{pointer}: {low_key} {low} is more than {high_key} {high}; no value can match")
    return low, high


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
