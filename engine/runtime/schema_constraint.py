"""An answer held to a compiled JSON schema (json_schema.py), checked character by character.

The state is a tuple of parses ("threads"), each a stack of frames, innermost last; a thread is
forked where a value may take more than one shape (anyOf, a list of types) and dropped when the
text stops fitting it, so the state stays small (usually one thread: the first character of a
value settles most choices). Frames are immutable tuples and checking a continuation never
changes the state it starts from, as in json_constraint.py. An empty stack is a document whose
top-level value has ended (an object for an answer; any value for a tagged GLM argument,
glm_arguments.py); only whitespace may follow it.

Text is read as in json_constraint.py: one character per byte of the token's UTF-8 text
(Latin-1), so keys and enum texts (kept in the same view by json_schema.py) match byte by byte.
Unlike there, a string's bytes must form well-formed UTF-8 (a token that ends inside a character
leaves the rest to the next), so that a string's length in characters is known as it is written.
"""
from __future__ import annotations

import functools
import re

from .json_schema import (ANY_ARRAY, ANY_LITERAL, ANY_NUMBER, ANY_OBJECT, ANY_STRING, AnyValueNode, ArrayNode,
                          JsonSchema, LiteralsNode, Node, NumberNode, ObjectNode, StringNode, concrete)

# Frame kinds. VALUE: (VALUE, node) a value of node comes next. OBJECT: (OBJECT, node, next,
# phase), next the first listed property that may still come. KEY: (KEY, node, next, read) a
# listed key being written, `read` its text so far (opening quote included). ARRAY: (ARRAY, node,
# count, phase). STRING: (STRING, min, max, count, escape), escape "" between characters, the
# escape read so far ("\\", "u", "u0", ...; "H" first right after a high surrogate's escape), or
# inside a multi-byte character (bytes to come, lowest, highest next byte). NUMBER: (NUMBER,
# integer, mode). LITERALS: (LITERALS, texts, read).
VALUE, OBJECT, KEY, ARRAY, STRING, NUMBER, LITERALS = range(7)
OPEN, COMMA, COLON, AFTER = range(4)  # phases: after "{" / "[", after ",", after a key, after a value
# Number modes: after "-", after a leading 0, in the integer, after ".", in the fraction, after
# "e", after the exponent's sign, in the exponent.
MINUS, ZERO, INTEGER, POINT, FRACTION, EXP_MARK, EXP_SIGN, EXPONENT = range(8)

_WHITESPACE = frozenset(" \t\n\r")
_WHITESPACE_RUN = re.compile(r"[ \t\n\r]+")
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f\x80-\xff]+')
_SKIPS_WHITESPACE = frozenset((VALUE, OBJECT, ARRAY))
# A UTF-8 character's first byte -> (bytes to follow, lowest and highest next byte): well-formed
# sequences only (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF).
_UTF8_LEAD = {
    **{chr(b): (1, "\x80", "\xbf") for b in range(0xC2, 0xE0)},
    "\xe0": (2, "\xa0", "\xbf"), "\xed": (2, "\x80", "\x9f"),
    **{chr(b): (2, "\x80", "\xbf") for b in (*range(0xE1, 0xED), 0xEE, 0xEF)},
    "\xf0": (3, "\x90", "\xbf"), "\xf4": (3, "\x80", "\x8f"),
    **{chr(b): (3, "\x80", "\xbf") for b in range(0xF1, 0xF4)},
}
_DIGITS = "0123456789"
_HEX = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_NUMBER_MAY_END = frozenset((ZERO, INTEGER, FRACTION, EXPONENT))
_FRACTION_OR_EXPONENT = {".": POINT, "e": EXP_MARK, "E": EXP_MARK}
_NUMBER_NEXT = {
    MINUS: {"0": ZERO, **dict.fromkeys("123456789", INTEGER)},
    ZERO: _FRACTION_OR_EXPONENT,
    INTEGER: {**dict.fromkeys(_DIGITS, INTEGER), **_FRACTION_OR_EXPONENT},
    POINT: dict.fromkeys(_DIGITS, FRACTION),
    FRACTION: {**dict.fromkeys(_DIGITS, FRACTION), "e": EXP_MARK, "E": EXP_MARK},
    EXP_MARK: {"+": EXP_SIGN, "-": EXP_SIGN, **dict.fromkeys(_DIGITS, EXPONENT)},
    EXP_SIGN: dict.fromkeys(_DIGITS, EXPONENT),
    EXPONENT: dict.fromkeys(_DIGITS, EXPONENT),
}
_INTEGER_NEXT = {MINUS: _NUMBER_NEXT[MINUS], ZERO: {}, INTEGER: dict.fromkeys(_DIGITS, INTEGER)}
_ANY_BY_FIRST = {"{": ANY_OBJECT, "[": ANY_ARRAY, '"': ANY_STRING, "t": ANY_LITERAL, "f": ANY_LITERAL,
                 "n": ANY_LITERAL, **dict.fromkeys("-" + _DIGITS, ANY_NUMBER)}

Thread = tuple  # frames, innermost last; () once the top-level value has ended
SchemaState = tuple  # threads


class SchemaGrammar:
    """The automaton for one compiled schema: start, advance, is_complete, between_tokens (the
    interface constrained.py drives, as json_constraint.JSON_OBJECT)."""

    reads_markup = False  # special tokens never continue a JSON text

    def __init__(self, schema: JsonSchema):
        self.schema = schema
        self.start: SchemaState = (((VALUE, schema.root),),)
        self._shapes: dict[Node, list[Node]] = {}

    def advance(self, state: SchemaState, text: str) -> SchemaState | None:
        """The state after `text`, or None when no parse of the schema continues with it."""
        out: list[Thread] = []
        for thread in state:
            self._run(thread, text, 0, out)
        return tuple(dict.fromkeys(out)) or None

    @staticmethod
    def is_complete(state: SchemaState) -> bool:
        return any(not thread for thread in state)

    @staticmethod
    def between_tokens(state: SchemaState) -> bool:
        """Whether the text read so far ends between JSON tokens, where whitespace may come."""
        return all(not thread or thread[-1][0] in _SKIPS_WHITESPACE
                   or (thread[-1][0] == LITERALS and _gap(thread[-1][1][0], thread[-1][2])) for thread in state)

    def _run(self, thread: Thread, text: str, i: int, out: list[Thread]) -> None:
        n = len(text)
        while i < n:
            kind = thread[-1][0] if thread else None
            if (kind is None or kind in _SKIPS_WHITESPACE) and text[i] in _WHITESPACE:
                i = _WHITESPACE_RUN.match(text, i).end()
                continue
            if kind == STRING and not thread[-1][4]:
                run = _PLAIN_RUN.match(text, i)
                if run:
                    frame = _string_run(thread[-1], run.group())
                    if frame is None:
                        return
                    thread, i = thread[:-1] + (frame,), run.end()
                    continue
            following = self._step(thread, text[i])
            if not following:
                return
            for fork in following[1:]:
                self._run(fork, text, i + 1, out)
            thread, i = following[0], i + 1
        out.append(thread)

    def _step(self, thread: Thread, c: str) -> list[Thread]:
        """The threads after one character that is not skipped whitespace or a plain string run."""
        if not thread:
            return []
        top, below = thread[-1], thread[:-1]
        kind = top[0]
        if kind == VALUE:
            return [below + (frame,) for frame in self._value_starts(top[1], c)]
        if kind == OBJECT:
            return _object_step(top, below, c)
        if kind == KEY:
            return _key_step(top, below, c)
        if kind == ARRAY:
            if top[3] == OPEN and c != "]":  # the first item's first character
                node = top[1]
                if node.max_items == 0:
                    return []
                return self._step(below + ((ARRAY, node, 1, AFTER), (VALUE, node.items)), c)
            return _array_step(top, below, c)
        if kind == STRING:
            frame = _string_char(top, c)
            if frame == "closed":
                return [below]
            return [] if frame is None else [below + (frame,)]
        if kind == NUMBER:
            table = _INTEGER_NEXT if top[1] else _NUMBER_NEXT
            mode = table[top[2]].get(c)
            if mode is not None:
                return [below + ((NUMBER, top[1], mode),)]
            return self._ended(below, c) if top[2] in _NUMBER_MAY_END else []
        # LITERALS
        texts, read = top[1], top[2]
        ended = any(len(t) == read for t in texts)
        if c in _WHITESPACE:  # inside an enum's object or array, between its tokens; or after the value
            kept = tuple(t for t in texts if len(t) > read and _gap(t, read))
            return ([below + ((LITERALS, kept, read),)] if kept else []) + (self._ended(below, c) if ended else [])
        kept = tuple(t for t in texts if len(t) > read and t[read] == c)
        if kept:
            return [below + ((LITERALS, kept, read + 1),)]
        return self._ended(below, c) if ended else []

    def _ended(self, below: Thread, c: str) -> list[Thread]:
        """The threads after `c`, which ended the number or literal on top of `below`."""
        if c in _WHITESPACE and (not below or below[-1][0] in _SKIPS_WHITESPACE):
            return [below]
        return self._step(below, c)

    def _value_starts(self, node: Node, c: str) -> list[tuple]:
        """The frames a value of `node` opens with its first character `c`."""
        shapes = self._shapes.get(node)
        if shapes is None:
            shapes = self._shapes[node] = concrete(node)
        frames = []
        for shape in shapes:
            if isinstance(shape, AnyValueNode):
                shape = _ANY_BY_FIRST.get(c)
                if shape is None:
                    continue
            frame = _opened(shape, c)
            if frame is not None and frame not in frames:
                frames.append(frame)
        return frames


@functools.lru_cache(maxsize=4096)
def _gap(text: str, i: int) -> bool:
    """Whether whitespace may stand before text[i] in the compact JSON `text` (an enum's or const's
    object or array): between two of its tokens, not inside a string."""
    if not 0 < i < len(text):
        return False
    inside = escaped = False
    for c in text[:i]:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = inside
        elif c == '"':
            inside = not inside
    return not inside and (text[i - 1] in "{[,:" or text[i] in "}],:")


def _opened(shape: Node, c: str) -> tuple | None:
    if isinstance(shape, ObjectNode):
        return (OBJECT, shape, 0, OPEN) if c == "{" else None
    if isinstance(shape, ArrayNode):
        return (ARRAY, shape, 0, OPEN) if c == "[" else None
    if isinstance(shape, StringNode):
        return (STRING, shape.min_length, shape.max_length, 0, "") if c == '"' else None
    if isinstance(shape, NumberNode):
        mode = _NUMBER_NEXT[MINUS].get(c, MINUS if c == "-" else None)
        return None if mode is None else (NUMBER, shape.integer, mode)
    if isinstance(shape, LiteralsNode):
        texts = tuple(t for t in shape.texts if t[0] == c)
        return (LITERALS, texts, 1) if texts else None
    return None


def _object_step(top: tuple, below: Thread, c: str) -> list[Thread]:
    _, node, start, phase = top
    if phase == COLON:
        if c != ":":
            return []
        value = node.values[start - 1] if node.keys else node.additional
        return [below + ((OBJECT, node, start, AFTER), (VALUE, value))]
    if phase == AFTER:
        if c == ",":
            more = start < len(node.keys) if node.keys else node.additional is not None
            return [below + ((OBJECT, node, start, COMMA),)] if more else []
        return [below] if c == "}" and node.may_close(start) else []
    # OPEN or COMMA: a key, or (OPEN only) the close of an empty object
    if c == "}":
        return [below] if phase == OPEN and node.may_close(start) else []
    if c != '"':
        return []
    if node.keys:
        return [below + ((KEY, node, start, '"'),)] if start < len(node.keys) else []
    if node.additional is None:
        return []
    return [below + ((OBJECT, node, start, COLON), (STRING, 0, None, 0, ""))]


def _key_step(top: tuple, below: Thread, c: str) -> list[Thread]:
    _, node, start, read = top
    read += c
    alive = False
    for i in node.next_properties(start):
        key = node.keys[i]
        if key == read:  # a key's text ends with its closing quote, so no other key continues it
            return [below + ((OBJECT, node, i + 1, COLON),)]
        alive = alive or key.startswith(read)
    return [below + ((KEY, node, start, read),)] if alive else []


def _array_step(top: tuple, below: Thread, c: str) -> list[Thread]:
    _, node, count, phase = top
    if phase == AFTER:
        if c == "," and (node.max_items is None or count < node.max_items):
            return [below + ((ARRAY, node, count + 1, AFTER), (VALUE, node.items))]
        return [below] if c == "]" and count >= node.min_items else []
    return [below] if c == "]" and node.min_items == 0 else []  # OPEN


def _string_run(frame: tuple, run: str) -> tuple | None:
    """The string frame after a run of plain ASCII characters, or None when it makes the string too
    long."""
    _, low, high, count, _ = frame
    if high is None and low == 0:
        return frame
    count += len(run)
    return None if high is not None and count > high else (STRING, low, high, count, "")


def _string_char(frame: tuple, c: str):
    """The string frame after `c` (any character but a plain ASCII run's), "closed" when it ends the
    string, None when it cannot come. A character counts at its first byte; right after a high
    surrogate's \\uXXXX ("H"), a low surrogate's escape completes that character and counts nothing."""
    _, low, high, count, escape = frame
    if isinstance(escape, tuple):  # inside a multi-byte character: (bytes still to come, lowest, highest)
        remaining, lowest, highest = escape
        if not lowest <= c <= highest:
            return None
        return STRING, low, high, count, ((remaining - 1, "\x80", "\xbf") if remaining > 1 else "")
    after_high = escape.startswith("H")
    core = escape[1:] if after_high else escape
    if not core:
        if c == '"':
            return "closed" if count >= low else None
        if c == "\\":
            if high is not None and count >= high and not after_high:
                return None  # every escape would make one character more than maxLength allows
            return STRING, low, high, count, escape + "\\"
        if c < " ":
            return None  # a raw control character
        counted, escape = 1, ""
        if c >= "\x80":  # a multi-byte character's first byte
            escape = _UTF8_LEAD.get(c)
            if escape is None:
                return None
    elif core == "\\":
        if c == "u":
            return STRING, low, high, count, escape[:-1] + "u"
        if c not in _SIMPLE_ESCAPES:
            return None
        counted, escape = 1, ""
    else:
        if c not in _HEX:
            return None
        escape, core = escape + c, core + c
        if after_high and high is not None and count >= high and not _low_surrogate_prefix(core[1:]):
            return None  # at maxLength only the low half of the character begun may come
        if len(core) < 5:
            return STRING, low, high, count, escape
        code = int(core[1:], 16)
        if 0xD800 <= code < 0xDC00:
            counted, escape = 1, "H"
        else:
            counted, escape = (0 if after_high and 0xDC00 <= code < 0xE000 else 1), ""
    if high is not None and count + counted > high:
        return None
    return STRING, low, high, (count + counted if (low or high is not None) else 0), escape


def _low_surrogate_prefix(digits: str) -> bool:
    """Whether hex `digits` begin a code in DC00-DFFF."""
    return (not digits or digits[0] in "dD") and (len(digits) < 2 or digits[1] in "cdefCDEF")
