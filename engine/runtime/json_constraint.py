"""One JSON object (RFC 8259), checked character by character while it is being written.

A pushdown automaton: the state is a small immutable tuple (mode, stack, is_key, detail), so
checking a candidate continuation never changes the state it starts from, and keeping the old
state costs nothing. `stack` holds the open containers as a string of "{" and "[" characters;
`is_key` says whether the string being read is an object key; `detail` is how many hex digits a
\\uXXXX escape still needs, or the letters a literal (true, false, null) still needs.

The document is exactly one object, optionally surrounded by whitespace (space, tab, line feed,
carriage return): a top-level array or scalar is refused at its first character. Inside, the
grammar is RFC 8259's: strings with the escapes \\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX and no raw
control characters (U+0000-U+001F), numbers `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`,
true, false, null. Every character costs O(1) work; runs of plain string characters and of
whitespace are skipped with one regular-expression match each.

Any character from U+0080 on is read as "some non-ASCII character", which JSON allows only inside
strings: so the automaton may also read text whose non-ASCII bytes stand one character each (a
token's bytes decoded as Latin-1, constrained.py), with the same verdict as on the real text.
"""
from __future__ import annotations

import re

# Modes: what the next character may be.
(START,          # before the document: whitespace or "{"
 OBJECT_OPEN,    # after "{": whitespace, a key's opening quote or "}"
 KEY,            # after a comma in an object: whitespace or a key's opening quote
 COLON,          # after a key: whitespace or ":"
 VALUE,          # after ":" or a comma in an array: whitespace or a value
 ARRAY_OPEN,     # after "[": whitespace, a value or "]"
 AFTER_VALUE,    # after a value inside a container: whitespace, "," or the container's close
 STRING,         # inside a string
 ESCAPE,         # after a backslash in a string
 HEX,            # inside \uXXXX; detail: digits still needed
 MINUS,          # after a number's "-": a digit
 ZERO,           # after a number's leading 0: ".", an exponent or the number's end
 INTEGER,        # in the integer digits after 1-9
 POINT,          # after ".": a digit
 FRACTION,       # in the fraction's digits
 EXPONENT_MARK,  # after "e" / "E": a sign or a digit
 EXPONENT_SIGN,  # after the exponent's sign: a digit
 EXPONENT,       # in the exponent's digits
 LITERAL,        # inside true / false / null; detail: the letters still needed
 DONE,           # the object is closed: whitespace only
 ) = range(20)

JsonState = tuple  # (mode, stack, is_key, detail)
START_STATE: JsonState = (START, "", False, 0)

_WHITESPACE = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_LITERAL_REST = {"t": "rue", "f": "alse", "n": "ull"}
# Modes in which the number read so far is whole: any other character ends it.
_NUMBER_MAY_END = frozenset((ZERO, INTEGER, FRACTION, EXPONENT))
_NUMBER_NEXT = {  # mode -> {character: mode}; characters not listed end the number or are errors
    MINUS: {"0": ZERO, **dict.fromkeys("123456789", INTEGER)},
    ZERO: {".": POINT, "e": EXPONENT_MARK, "E": EXPONENT_MARK},
    INTEGER: {**dict.fromkeys(_DIGITS, INTEGER), ".": POINT, "e": EXPONENT_MARK, "E": EXPONENT_MARK},
    POINT: dict.fromkeys(_DIGITS, FRACTION),
    FRACTION: {**dict.fromkeys(_DIGITS, FRACTION), "e": EXPONENT_MARK, "E": EXPONENT_MARK},
    EXPONENT_MARK: {"+": EXPONENT_SIGN, "-": EXPONENT_SIGN, **dict.fromkeys(_DIGITS, EXPONENT)},
    EXPONENT_SIGN: dict.fromkeys(_DIGITS, EXPONENT),
    EXPONENT: dict.fromkeys(_DIGITS, EXPONENT),
}
_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_WHITESPACE_RUN = re.compile(r"[ \t\n\r]+")
_SKIPS_WHITESPACE = frozenset((START, OBJECT_OPEN, KEY, COLON, VALUE, ARRAY_OPEN, AFTER_VALUE, DONE))


def advance(state: JsonState, text: str) -> JsonState | None:
    """The state after `text`, or None when `text` cannot continue a JSON object from `state`
    (`state` itself is never changed)."""
    mode, stack, is_key, detail = state
    i, n = 0, len(text)
    while i < n:
        if mode in _SKIPS_WHITESPACE and text[i] in _WHITESPACE:
            i = _WHITESPACE_RUN.match(text, i).end()
            continue
        if mode == STRING:
            run = _PLAIN_RUN.match(text, i)
            if run:
                i = run.end()
                continue
        c = text[i]
        i += 1
        if mode == STRING:
            if c == '"':
                mode = COLON if is_key else AFTER_VALUE
            elif c == "\\":
                mode = ESCAPE
            else:  # a raw control character
                return None
        elif mode == ESCAPE:
            if c in _SIMPLE_ESCAPES:
                mode = STRING
            elif c == "u":
                mode, detail = HEX, 4
            else:
                return None
        elif mode == HEX:
            if c not in _HEX_DIGITS:
                return None
            detail -= 1
            if detail == 0:
                mode = STRING
        elif mode in _NUMBER_NEXT:
            following = _NUMBER_NEXT[mode].get(c)
            if following is not None:
                mode = following
            elif mode in _NUMBER_MAY_END:
                mode, i = AFTER_VALUE, i - 1  # the number ended: read this character after it
            else:
                return None
        elif mode == LITERAL:
            if c != detail[0]:
                return None
            detail = detail[1:]
            if not detail:
                mode = AFTER_VALUE
        elif mode == START:
            if c != "{":
                return None
            mode, stack = OBJECT_OPEN, "{"
        elif mode == OBJECT_OPEN or mode == KEY:
            if c == '"':
                mode, is_key = STRING, True
            elif c == "}" and mode == OBJECT_OPEN:
                mode, stack = _closed(stack)
            else:
                return None
        elif mode == COLON:
            if c != ":":
                return None
            mode = VALUE
        elif mode == VALUE or mode == ARRAY_OPEN:
            if c == "]" and mode == ARRAY_OPEN:
                mode, stack = _closed(stack)
                continue
            opened = _value_start(c, stack)
            if opened is None:
                return None
            mode, stack, is_key, detail = opened
        elif mode == AFTER_VALUE:
            top = stack[-1]
            if c == ",":
                mode = KEY if top == "{" else VALUE
            elif (c == "}" and top == "{") or (c == "]" and top == "["):
                mode, stack = _closed(stack)
            else:
                return None
        else:  # DONE: only whitespace, which was skipped above
            return None
    return mode, stack, is_key, detail


def _closed(stack: str) -> tuple[int, str]:
    """(mode, stack) after the innermost container closes."""
    stack = stack[:-1]
    return (AFTER_VALUE if stack else DONE), stack


def _value_start(c: str, stack: str) -> JsonState | None:
    """The state after a value's first character `c`, or None when no value starts with it."""
    if c == '"':
        return STRING, stack, False, 0
    if c == "{":
        return OBJECT_OPEN, stack + "{", False, 0
    if c == "[":
        return ARRAY_OPEN, stack + "[", False, 0
    if c == "-":
        return MINUS, stack, False, 0
    if c == "0":
        return ZERO, stack, False, 0
    if c in _DIGITS:
        return INTEGER, stack, False, 0
    if c in _LITERAL_REST:
        return LITERAL, stack, False, _LITERAL_REST[c]
    return None


def is_complete(state: JsonState) -> bool:
    """Whether the object has closed (only whitespace may follow)."""
    return state[0] == DONE


def between_tokens(state: JsonState) -> bool:
    """Whether the text read so far ends between JSON tokens (not inside a string, a number or a
    literal), where whitespace is insignificant."""
    return state[0] in _SKIPS_WHITESPACE


class JsonObjectGrammar:
    """This automaton behind the interface constrained.py drives (start, advance, is_complete,
    between_tokens), which schema_constraint.SchemaGrammar shares."""
    start = START_STATE
    reads_markup = False  # special tokens never continue a JSON text
    advance = staticmethod(advance)
    is_complete = staticmethod(is_complete)
    between_tokens = staticmethod(between_tokens)


JSON_OBJECT = JsonObjectGrammar()


class JsonObjectValidator:
    """The automaton with its current state: `feed` moves on only when the text is a valid
    continuation; `accepts` checks one without moving."""

    def __init__(self, state: JsonState = START_STATE):
        self.state = state

    def accepts(self, text: str) -> bool:
        return advance(self.state, text) is not None

    def feed(self, text: str) -> bool:
        """Moves past `text` and returns True, or returns False and stays where it was."""
        after = advance(self.state, text)
        if after is None:
            return False
        self.state = after
        return True

    @property
    def complete(self) -> bool:
        return is_complete(self.state)
