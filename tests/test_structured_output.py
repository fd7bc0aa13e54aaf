"""Structured output (response_format "json_schema"): the engine on the tiny checkpoints of both
families answers with one object that follows the request's schema, chosen token by token by the
schema's automaton (engine/runtime/schema_constraint.py) through the same path as JSON mode."""
import json

import pytest
import torch

from localchat.engine.runtime.constrained import JsonAnswer, JsonVocabulary
from localchat.engine.runtime.json_schema import compile_schema
from localchat.engine.runtime.request import ChatRequest, SamplingParams
from localchat.engine.runtime.sampling import Sampler
from localchat.engine.runtime.schema_constraint import SchemaGrammar
from test_json_mode import (FIXTURES, QUESTION, answer_of, engines, json_request, json_tokenizer,  # noqa: F401
                            lean_towards)
from test_json_schema import valid

CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "color": {"enum": ["black", "white", "ginger"]},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        "indoor": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "toys"],
    "additionalProperties": False,
}


def schema_request(schema: dict = CAT, max_tokens: int = 300, **sampling) -> ChatRequest:
    sampling.setdefault("temperature", 0.0)
    return ChatRequest(QUESTION, SamplingParams(max_tokens=max_tokens, **sampling), response_format="json_schema",
                       response_schema=compile_schema(schema, "cat", strict=True))


def test_the_token_choice_follows_the_schema_past_what_the_model_wants():
    tok = json_tokenizer()
    vocab = JsonVocabulary(tok, len(tok), (tok.eos_token_id,), torch.device("cpu")).build()
    answer = JsonAnswer(vocab, SchemaGrammar(compile_schema(CAT)))
    gen = torch.Generator().manual_seed(3)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    text = ""
    quote, close = tok.convert_tokens_to_ids('"'), tok.convert_tokens_to_ids("}")
    for step in range(400):
        logits = torch.randn(vocab.vocab_size, generator=gen) * 2
        logits[[quote, close]] += step * 0.05  # a random model, leaning towards ending what it writes
        token = answer.choose(logits, sampler, None)
        answer.append(token)
        text += vocab.text(token)
        if answer.complete:
            break
    value = json.loads(text.encode("latin-1").decode("utf-8"))
    assert valid(CAT, value) and list(value)[:4] == ["name", "age", "color", "toys"], text


def test_the_prompt_is_the_one_json_mode_writes(engines):
    for name in FIXTURES:
        formatter = engines(name).formatter
        assert formatter.render(schema_request()) == formatter.render(json_request())


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "top_k": 20, "seed": 2}])
def test_answers_follow_the_schema(engines, name, sampling, monkeypatch):
    engine = engines(name)
    lean_towards(engine, monkeypatch, ('"', "}", ",", "]", ":"), 0.3)
    ids, text, final = answer_of(engine, schema_request(**sampling))
    assert final.finish_reason == "stop", (final, text)
    value = json.loads(text)
    assert valid(CAT, value), text
    assert list(value)[:4] == ["name", "age", "color", "toys"]  # the schema's order
    if sampling:  # the seed reproduces the answer
        assert answer_of(engine, schema_request(**sampling))[0] == ids


@pytest.mark.parametrize("name", FIXTURES)
def test_a_recursive_schema_and_a_cut_off_answer(engines, name):
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string", "maxLength": 3}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                              "maxItems": 2}}, "required": ["label", "kids"]}},
        "$ref": "#/$defs/node"}
    grammar = SchemaGrammar(compile_schema(tree))
    for seed in range(3):
        ids, text, final = answer_of(engines(name), schema_request(tree, max_tokens=40, temperature=1.0, seed=seed))
        if final.finish_reason == "stop":
            assert valid(tree, json.loads(text)), text
        else:  # cut off by max_tokens: what was written still follows the schema so far
            assert final.finish_reason == "length" and len(ids) == 40
            assert grammar.advance(grammar.start, text.encode("utf-8").decode("latin-1")) is not None, text


def test_a_schema_request_needs_its_schema():
    with pytest.raises(ValueError, match="response_schema"):
        ChatRequest(QUESTION, response_format="json_schema")
    with pytest.raises(ValueError, match="response_schema"):
        ChatRequest(QUESTION, response_schema=compile_schema(CAT))
