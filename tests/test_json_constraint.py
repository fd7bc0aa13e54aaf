"""The JSON object automaton (engine/runtime/json_constraint.py): what it accepts and where it
refuses, against hand-picked documents and against json.loads on random documents, whole, in
random pieces and with random corruptions."""
import json
import random

import pytest

from localchat.engine.runtime.json_constraint import (
    START_STATE, JsonObjectValidator, advance, between_tokens, is_complete,
)

VALID = [
    '{}',
    ' \t\r\n{ } \n',
    '{"a": 1}',
    '{"": ""}',
    '{"nested": {"list": [1, [2, [3, {}]], []], "deep": {"deeper": {"deepest": null}}}}',
    '{"escapes": "\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\uD83D\\uDE00 \\u0000 \\uABCD \\uabcd"}',
    '{"unicode": "Grüße, 世界 🙂", "ключ": "значение", "\u00a0": "\u007f\u0080\u2028"}',
    '{"numbers": [0, -0, 1, -1, 10, 123456789, 0.0, -0.5, 1.5, 1e5, 1E5, 1e-5, 1e+5, 1.5E+3, -2.25e-10, 0e0, 0E-0]}',
    '{"literals": [true, false, null], "t": true, "f": false, "n": null}',
    '{"a":1,"b":[true,false],"c":{"d":"e"}}',
    '{\n  "pretty": [\n    1,\n    2\n  ],\n\t"tabs": {}\n}\n',
    '{"dup": 1, "dup": 2}',
    '{"a": [{}, {"b": []}, [[]]]}',
]

# (text, index of the first character that cannot continue a JSON object)
INVALID_AT = [
    ('{"a": 01}', 7),  # a leading zero
    ('{"a": -01}', 8),
    ('{"a": 00}', 7),
    ('{"a": 1,}', 8),  # trailing commas
    ('{"a": [1, 2,]}', 12),
    ("{'a': 1}", 1),  # single quotes
    ('{"a": \'b\'}', 6),
    ('{"a": yes}', 6),  # bare words
    ('{"a": tru }', 9),
    ('{"a": nul}', 9),
    ('{"a": True}', 6),
    ('{"a": NaN}', 6),
    ('{"a": Infinity}', 6),
    ('{"a": "x\ny"}', 8),  # raw control characters in strings
    ('{"a": "x\ty"}', 8),
    ('{"a": "\x00"}', 7),
    ('{"a": "\\x"}', 8),  # unknown escapes
    ('{"a": "\\u12G4"}', 11),
    ('{"a": "\\U0041"}', 8),
    ('[1, 2]', 0),  # the top level must be an object
    ('"text"', 0),
    ('42', 0),
    (' null', 1),
    ('\u00a0{}', 0),  # only JSON's four whitespace characters
    ('{"a": 1.}', 8),  # numbers: each part needs its digits
    ('{"a": 1e}', 8),
    ('{"a": 1.5e+}', 11),
    ('{"a": -}', 7),
    ('{"a": .5}', 6),
    ('{"a": +1}', 6),
    ('{"a": 1.e5}', 8),
    ('{"a" 1}', 5),  # structure
    ('{"a": 1 2}', 8),
    ('{"a": 1 "b": 2}', 8),
    ('{,}', 1),
    ('{"a"}', 4),
    ('{"a":}', 5),
    ('{1: 2}', 1),
    ('{"a": [1}', 8),
    ('{"a": {]}', 7),
    ('{"a": 1}}', 8),  # after the object: whitespace only
    ('{} {}', 3),
    ('{"a": 1}x', 8),
]


def test_accepts_valid_objects_and_knows_when_they_are_complete():
    for text in VALID:
        assert json.loads(text) is not None  # the samples themselves are JSON
        state = advance(START_STATE, text)
        assert state is not None and is_complete(state), text


@pytest.mark.parametrize("text,bad", INVALID_AT)
def test_rejects_at_the_exact_character(text, bad):
    state = advance(START_STATE, text[:bad])
    assert state is not None, f"{text[:bad]!r} is a valid start"
    assert advance(state, text[bad]) is None
    assert advance(START_STATE, text) is None
    assert not _is_json_object(text)


def test_completion_comes_with_the_closing_brace_only():
    text = ' {"a": [1, {"b": "}"}], "c": 2.5e3} \n'
    closing = text.rindex("}")
    for end in range(len(text) + 1):
        state = advance(START_STATE, text[:end])
        assert state is not None and is_complete(state) == (end > closing), text[:end]
    # a number is not finished before what ends it; the object needs its brace
    assert not is_complete(advance(START_STATE, '{"a": 12'))
    assert between_tokens(advance(START_STATE, '{"a": 12 '))
    assert not between_tokens(advance(START_STATE, '{"a": "12 '))


def test_a_failed_check_leaves_the_state_as_it_was():
    validator = JsonObjectValidator()
    assert validator.feed('{"a": ')
    before = validator.state
    assert not validator.accepts("}") and not validator.feed("]")
    assert validator.state == before
    assert validator.accepts('"x"}') and not validator.complete
    assert validator.feed('"x"}') and validator.complete
    assert validator.feed(" \n") and not validator.feed("x") and validator.complete


def test_non_ascii_stands_only_inside_strings():
    # the engine reads a token's bytes one character each (Latin-1): a piece of a multi-byte
    # character is a character from U+0080 on, as the whole one is
    piece = "\u00e2"
    assert advance(START_STATE, '{"a": "' + piece) is not None
    assert advance(START_STATE, '{"a": ' + piece) is None
    assert advance(START_STATE, piece) is None


def test_random_objects_in_random_pieces():
    rng = random.Random(7)
    for _ in range(300):
        text = _random_document(rng)
        assert _is_json_object(text)
        validator = JsonObjectValidator()
        pieces = _pieces(text, rng)
        for n, piece in enumerate(pieces):
            assert validator.feed(piece), (text, pieces[:n + 1])
        assert validator.complete, text


def test_random_corruptions_agree_with_json_loads():
    rng = random.Random(11)
    disagreements = []
    checked = rejected = 0
    for _ in range(600):
        valid = _random_document(rng)
        for _ in range(4):
            text = _corrupt(valid, rng)
            state = advance(START_STATE, text)
            ours = state is not None and is_complete(state)
            theirs = _is_json_object(text)
            checked += 1
            rejected += not theirs
            if ours != theirs:
                disagreements.append(text)
    assert not disagreements, disagreements[:5]
    assert rejected > checked // 3  # the corruptions really break documents


def _is_json_object(text: str) -> bool:
    """Whether json.loads, without its extensions (NaN, Infinity) that JSON itself does not have,
    reads `text` as an object."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    try:
        return isinstance(json.loads(text, parse_constant=refuse), dict)
    except ValueError:
        return False


_STRING_CHARS = ['a', 'b', 'Z', ' ', '"', '\\', '/', '\n', '\t', '\x00', '\x1f', '\x7f', 'é', '世', '🙂', '\u2028',
                 '{', '}', '[', ']', ':', ',', '0', 'e']
_NUMBER_SPELLINGS = ["0", "-0", "7", "-12", "1e5", "1E5", "1e-5", "1.5E+3", "-2.25e-10", "0.0", "3.14159",
                     "123456789012345678901234567890", "0e0", "-0.0E-0"]


def _random_value(rng: random.Random, depth: int):
    kind = rng.choice(["object", "array", "string", "int", "float", "literal"] if depth < 4
                      else ["string", "int", "float", "literal"])
    if kind == "object":
        return {_random_string(rng): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == "array":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "string":
        return _random_string(rng)
    if kind == "int":
        return rng.choice([0, -1, 1, rng.randint(-10**20, 10**20)])
    if kind == "float":
        return rng.choice([0.0, -0.0, 1e-5, 1.5e3, -2.5e-300, 1e300, rng.uniform(-1e6, 1e6)])
    return rng.choice([True, False, None])


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice(_STRING_CHARS) for _ in range(rng.randint(0, 8)))


def _random_document(rng: random.Random) -> str:
    """A random object as json.dumps writes it (compact, spaced or indented; escaped to ASCII or
    not), with some numbers spelled in other valid ways and whitespace around it."""
    obj = {_random_string(rng): _random_value(rng, 1) for _ in range(rng.randint(0, 5))}
    numbers = [rng.choice(_NUMBER_SPELLINGS) for _ in range(rng.randint(0, 3))]
    if numbers:
        obj["numbers"] = "@NUMBERS@"
    text = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 0, 2, "\t"]),
                      separators=rng.choice([None, (",", ":"), (" , ", " : ")]))
    text = text.replace('"@NUMBERS@"', "[" + ", ".join(numbers) + "]")
    return _blank(rng) + text + _blank(rng)


def _blank(rng: random.Random) -> str:
    return "".join(rng.choice(" \t\n\r") for _ in range(rng.choice([0, 0, 1, 3])))


def _pieces(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


_CORRUPTIONS = list('{}[]:,"\\ \t\n0123456789-+.eEtrufalsn\'xu/\x00é') + ["", "01", "1.", ",}", "tru", "\\u12"]


def _corrupt(text: str, rng: random.Random) -> str:
    """One character replaced, deleted or inserted."""
    i = rng.randrange(len(text))
    new = rng.choice(_CORRUPTIONS)
    if rng.random() < 0.3:
        return text[:i] + new + text[i:]
    return text[:i] + new + text[i + 1:]
