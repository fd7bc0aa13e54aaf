"""GLM-4.5V's arguments to a forced call, held to the function's `parameters` schema.

After the forced start `<tool_call>NAME\\n` (tool_calls.forced_call_prefix) GLM-4.5V writes its
arguments in its chat template's format, tagged pairs rather than JSON:

    <arg_key>K1</arg_key>\\n<arg_value>V1</arg_value>\\n<arg_key>K2</arg_key>\\n<arg_value>V2</arg_value>\\n</tool_call>

(`</tool_call>` right after the start when there are none). A value is the text itself for a
property whose schema says "type": "string", else its JSON, which is how the output parser
(tool_calls.glm_tool_call) reads them back. This grammar holds that text to the schema: the
listed properties in the schema's order, each at most once and the required ones always, as
json_schema.py holds an object's keys; a text value's length (or, for an enum, its text), up to
its `</arg_value>`; a JSON value to its schema through schema_constraint.SchemaGrammar; the call
ends with `</tool_call>`. An object that lists no properties takes no arguments (fewer is always
valid).

The tags are special tokens of GLM's tokenizer, read as their text (`reads_markup`: constrained.py
then gives those tokens their text). The interface is constrained.py's: start, advance,
is_complete, between_tokens.
"""
from __future__ import annotations

import json

from .json_schema import JsonSchema, LiteralsNode, Node, ObjectNode, StringNode, concrete, latin1
from .schema_constraint import SchemaGrammar

MARKUP = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "</tool_call>")
CLOSE = "</arg_value>"
# State kinds. TAGS: (TAGS, candidates, read): one of `candidates` ((text, what follows it), ...)
# is being written, `read` characters of it so far; what follows is a property index (its value),
# END (nothing: the call is complete) or (AFTER, index) (the arguments after property index).
# RAW: (RAW, index, node, count, matched, edge): property index's text value, `count` characters
# so far, its last `matched` characters a start of CLOSE, `edge` whether it ends in a line break
# (the output parser strips line breaks around a value, so a value neither starts nor ends with
# one). JSON: (JSON, index, the state of the value's SchemaGrammar). DONE: (DONE,).
TAGS, RAW, JSON, DONE = range(4)
END, AFTER = -1, "after"


class GlmArgumentsGrammar:
    reads_markup = True  # the tags are special tokens: constrained.py gives them their text

    def __init__(self, parameters: ObjectNode, as_text: tuple[bool, ...]):
        """as_text[i]: whether property i's value is written as its text (else as JSON)."""
        self.node = parameters
        self.values = [_value_grammar(v, text) for v, text in zip(parameters.values, as_text)]
        self.start = self._next_argument(0, first=True)

    def advance(self, state: tuple, text: str) -> tuple | None:
        for c in text:
            state = self._step(state, c)
            if state is None:
                return None
        return state

    @staticmethod
    def is_complete(state: tuple) -> bool:
        return state[0] == DONE

    def between_tokens(self, state: tuple) -> bool:
        """Only inside a JSON value does whitespace stand between tokens."""
        return state[0] == JSON and self.values[state[1]].between_tokens(state[2])

    def _next_argument(self, start: int, first: bool = False) -> tuple:
        """What may come once property `start - 1` is written: a listed property up to the first
        required one, or the end of the call when none of them is required."""
        node, lead = self.node, "" if first else "\n"
        candidates = [(f"{lead}<arg_key>{latin1(node.names[i])}</arg_key>\n<arg_value>", i)
                      for i in node.next_properties(start)]
        if node.may_close(start):
            candidates.append((f"{lead}</tool_call>", END))
        return TAGS, tuple(candidates), 0

    def _step(self, state: tuple, c: str) -> tuple | None:
        kind = state[0]
        if kind == TAGS:
            _, candidates, read = state
            kept = tuple(x for x in candidates if len(x[0]) > read and x[0][read] == c)
            if not kept:
                return None
            text, following = kept[0]
            if len(kept) > 1 or len(text) > read + 1:  # no text is a prefix of another: each ends in a tag
                return TAGS, kept, read + 1
            if following == END:
                return (DONE,)
            if isinstance(following, tuple):
                return self._next_argument(following[1] + 1)
            return self._value_start(following)
        if kind == RAW:
            return self._raw_step(state, c)
        if kind == JSON:
            _, index, sub = state
            grammar = self.values[index]
            following = grammar.advance(sub, c)
            if following is not None:
                return JSON, index, following
            ended = grammar.advance(sub, " ")  # whether the value may end here
            if c == CLOSE[0] and ended is not None and grammar.is_complete(ended):
                return TAGS, ((CLOSE, (AFTER, index)),), 1
            return None
        return None  # DONE: nothing follows </tool_call>

    def _value_start(self, index: int) -> tuple:
        grammar = self.values[index]
        if isinstance(grammar, SchemaGrammar):
            return JSON, index, grammar.start
        if isinstance(grammar, tuple):  # an enum of strings: one of its texts, then the closing tag
            return TAGS, tuple((text + CLOSE, (AFTER, index)) for text in grammar), 0
        return RAW, index, grammar, 0, 0, False

    def _raw_step(self, state: tuple, c: str) -> tuple | None:
        _, index, node, count, matched, edge = state
        if c == CLOSE[matched]:
            if matched + 1 < len(CLOSE):
                return RAW, index, node, count, matched + 1, edge
            return self._next_argument(index + 1) if count >= node.min_length and not edge else None
        if c == "\n" and count + matched == 0:
            return None  # the parser strips line breaks around a value: it must not start with one
        if matched:  # what looked like the closing tag was text (ASCII: a character each)
            count, edge = count + matched, False
        if c == "<":
            matched = 1  # the text so far still ends as it did
        else:
            matched, edge = 0, c == "\n"
            count += 0 if "\x80" <= c <= "\xbf" else 1  # a UTF-8 continuation byte adds no character
        if node.max_length is not None and count > node.max_length:
            return None
        return RAW, index, node, count, matched, edge


def _value_grammar(node: Node, as_text: bool):
    """How a property's value is written: as text, a StringNode (its lengths) or a tuple of texts
    (an enum of strings); else the SchemaGrammar of its JSON."""
    if not as_text:
        return SchemaGrammar(JsonSchema(node))
    shapes = concrete(node)
    if shapes and all(isinstance(s, LiteralsNode) and all(t.startswith('"') for t in s.texts) for s in shapes):
        return tuple(dict.fromkeys(_unquoted(t) for s in shapes for t in s.texts))
    return shapes[0] if len(shapes) == 1 and isinstance(shapes[0], StringNode) else StringNode()


def _unquoted(written: str) -> str:
    """A JSON string's text (both in the automaton's Latin-1 view of UTF-8 bytes)."""
    return latin1(json.loads(written.encode("latin-1").decode("utf-8")))


def glm_arguments_grammar(root: Node, parameters: dict) -> GlmArgumentsGrammar | None:
    """The grammar for `parameters` (compiled: `root`); None when it is not a single object shape. A
    value is written as its text exactly where the output parser reads it so (tool_calls._glm_value:
    a property whose schema says "type": "string"), as JSON everywhere else."""
    shapes = concrete(root)
    if len(shapes) != 1 or not isinstance(shapes[0], ObjectNode):
        return None
    listed = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
    as_text = tuple(isinstance(listed.get(n), dict) and listed[n].get("type") == "string" for n in shapes[0].names)
    return GlmArgumentsGrammar(shapes[0], as_text)
