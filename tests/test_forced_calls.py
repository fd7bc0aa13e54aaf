"""Forced function calls (tool_choice "required" or a named function): the prompt ends with the start
of a call in the family's own format, the output parser reads that start before what the model
writes, and the engine streams the call exactly as it streams one the model chose to make."""
import json
import random

import pytest
import torch

from fixtures import open_fixture
from localchat.engine.runtime import constrained
from localchat.engine.runtime import engine_loop as loop_module
from localchat.engine.runtime.engine import Engine
from localchat.engine.runtime.reasoning import reasoning_parser
from localchat.engine.runtime.request import ChatRequest, Delta, Final, ForcedCall, Message, SamplingParams
from localchat.engine.runtime.tool_calls import forced_call_prefix

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = (WEATHER, TIME)
FAMILY = {"glm-bf16": "glm4v_moe", "gpt-oss-mxfp4": "gpt_oss"}
QUESTION = (Message.text("user", "Weather in Paris?"),)

# (fixture, forced call, what the model writes after the forced start, the token that ends its turn)
SCRIPTS = [
    ("glm-bf16", ForcedCall(), "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                               "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "<|observation|>"),
    ("glm-bf16", ForcedCall("get_weather"), "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                                            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     "<|observation|>"),
    ("gpt-oss-mxfp4", ForcedCall(), 'get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}', "<|call|>"),
    ("gpt-oss-mxfp4", ForcedCall("get_weather"), '{"city": "Paris", "days": 3}', "<|call|>"),
]


@pytest.fixture(scope="module")
def engines():
    """One CPU engine per fixture, made when first asked for."""
    made = {}

    def get(name: str) -> Engine:
        if name not in made:
            made[name] = Engine(open_fixture(name), device="cpu", dtype="float32", block_size=4)
        return made[name]

    yield get
    for engine in made.values():
        engine.shutdown()


@pytest.mark.parametrize("name,forced,tail", [
    ("glm-bf16", ForcedCall(), "<|user|>\nWeather in Paris?/nothink<|assistant|>\n<think></think>\n<tool_call>"),
    ("glm-bf16", ForcedCall("get_time"),
     "<|user|>\nWeather in Paris?/nothink<|assistant|>\n<think></think>\n<tool_call>get_time\n"),
    ("gpt-oss-mxfp4", ForcedCall(),
     "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant<|channel|>commentary to=functions."),
    ("gpt-oss-mxfp4", ForcedCall("get_time"), "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
                                              "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"),
])
def test_the_prompt_ends_with_the_start_of_the_call(engines, name, forced, tail):
    formatter = engines(name).formatter
    text = formatter.render(ChatRequest(QUESTION, tools=TOOLS, forced_call=forced))
    assert text.endswith(tail)
    # the template's own prompt (GLM's with thinking off, its think block closed empty), then the start
    unforced = formatter.render(ChatRequest(QUESTION, tools=TOOLS, thinking=False))
    assert text == unforced + formatter.answer_prefix(ChatRequest(QUESTION, tools=TOOLS, forced_call=forced))
    assert text != formatter.render(ChatRequest(QUESTION, tools=TOOLS))
    # the markers are the tokenizer's own tokens, not their spelling
    ids = formatter.build(ChatRequest(QUESTION, tools=TOOLS, forced_call=forced)).input_ids
    last = "<tool_call>" if tail.endswith("<tool_call>") else "<|message|>" if tail.endswith("<|message|>") else None
    if last:
        assert ids[-1] == formatter.tokenizer.convert_tokens_to_ids(last)


def _pieces(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(20, len(text) - 1))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name,forced,continuation,end", SCRIPTS + [
    # the name written straight up to the message, with no <|constrain|>
    ("gpt-oss-mxfp4", ForcedCall(), "get_time<|message|>{}", "<|call|>"),
])
def test_the_parser_reads_the_forced_start_then_the_models_text(name, forced, continuation, end):
    rng = random.Random(0)
    prefix = forced_call_prefix(FAMILY[name], forced, TOOLS)
    for pieces in [[continuation]] + [_pieces(continuation, rng) for _ in range(50)]:
        parser = reasoning_parser(FAMILY[name], thinking=False, tools=TOOLS)
        outs = [parser.feed(prefix)] + [parser.feed(p) for p in pieces] + [parser.finish()]
        assert all(out == ("", "") for out in outs)  # nothing leaks into the answer or the reasoning
        [call] = parser.calls
        expected = ("get_time", {}) if "get_time" in continuation else ("get_weather", {"city": "Paris", "days": 3})
        assert (call.name, json.loads(call.arguments)) == expected


def test_a_forced_call_must_be_one_of_the_tools():
    for family in FAMILY.values():
        assert forced_call_prefix(family, None, TOOLS) == ""
        with pytest.raises(ValueError, match="not among the request's tools"):
            forced_call_prefix(family, ForcedCall("get_stock"), TOOLS)
        with pytest.raises(ValueError, match="needs tools"):
            forced_call_prefix(family, ForcedCall(), ())


@pytest.mark.parametrize("name,forced,continuation,end", SCRIPTS)
def test_the_engine_streams_a_forced_call_like_a_chosen_one(engines, name, forced, continuation, end, monkeypatch):
    engine = engines(name)
    tokenizer = engine.formatter.tokenizer
    tokens = iter(tokenizer(continuation, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(end)])
    # the model's choices replaced by the script, one token a step (gpt-oss's arguments to a named
    # function are chosen by their schema's automaton: the script stands in for that choice too)
    monkeypatch.setattr(loop_module, "sample_tokens", lambda logits, samplers, contexts: [next(tokens)])
    monkeypatch.setattr(constrained.JsonAnswer, "choose", lambda answer, logits, sampler, context: next(tokens))
    items = list(engine.submit(ChatRequest(QUESTION, SamplingParams(max_tokens=100), tools=TOOLS, forced_call=forced)))
    deltas, final = [d for d in items if isinstance(d, Delta)], items[-1]
    assert isinstance(final, Final) and final.finish_reason == "tool_calls", final
    assert "".join(d.text for d in deltas) == "" and "".join(d.reasoning for d in deltas) == ""
    assert [(c.name, json.loads(c.arguments)) for d in deltas for c in d.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 3})]


def test_the_engine_refuses_a_forced_call_it_cannot_make(engines):
    engine = engines("glm-bf16")
    final = list(engine.submit(ChatRequest(QUESTION, tools=(WEATHER,), forced_call=ForcedCall("get_time"))))[-1]
    assert final.finish_reason == "error" and "'get_time' is not among the request's tools" in final.error


BOOKING = {"type": "function", "function": {
    "name": "book_table", "strict": True,
    "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string", "maxLength": 12}, "people": {"type": "integer"},
        "time": {"enum": ["18:00", "19:30", "21:00"]}, "terrace": {"type": "boolean"}},
        "required": ["restaurant", "people", "time", "terrace"], "additionalProperties": False}}}


# tokens that end what a random model would write forever (strings, numbers), in each family's format
ENDINGS = {"gpt-oss-mxfp4": ('"', "}", ",", ":"), "glm-bf16": ("</arg_value>", "</tool_call>", '"', "<")}


def lean_towards_endings(engine, name, monkeypatch):
    """A random model writes strings forever: lean it, more every token, towards ending them, as
    test_json_mode does."""
    ends = [engine.formatter.tokenizer.convert_tokens_to_ids(t) for t in ENDINGS[name]]
    run = engine.runner.run

    def leaning(plan):
        seqs, logits = run(plan)
        if logits is not None:
            logits = logits.clone()
            logits[:, ends] += 0.3 * len(seqs[0].generated)
        return seqs, logits

    monkeypatch.setattr(engine.runner, "run", leaning)


@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "glm-bf16"])
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_arguments_to_a_named_call_follow_its_schema(engines, name, seed, monkeypatch):
    engine = engines(name)
    lean_towards_endings(engine, name, monkeypatch)
    sampling = SamplingParams(max_tokens=300, temperature=0.0 if seed is None else 1.0, seed=seed)
    items = list(engine.submit(ChatRequest(QUESTION, sampling, tools=(WEATHER, BOOKING),
                                           forced_call=ForcedCall("book_table"))))
    final = items[-1]
    calls = [c for d in items if isinstance(d, Delta) for c in d.tool_calls]
    assert final.finish_reason == "tool_calls" and [c.name for c in calls] == ["book_table"], (final, calls)
    args = json.loads(calls[0].arguments)
    assert list(args) == ["restaurant", "people", "time", "terrace"]
    assert isinstance(args["people"], int) and not isinstance(args["people"], bool)
    assert len(args["restaurant"]) <= 12 and args["time"] in ("18:00", "19:30", "21:00")
    assert isinstance(args["terrace"], bool)


def test_a_strict_function_the_engine_cannot_hold_to_is_refused(engines):
    zipcode = {"type": "function", "function": {"name": "find", "strict": True, "parameters": {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
    final = list(engines("gpt-oss-mxfp4").submit(ChatRequest(QUESTION, tools=(zipcode,),
                                                              forced_call=ForcedCall("find"))))[-1]
    assert final.finish_reason == "error" and "'pattern' at #/properties/zip is not enforced" in final.error
    # without strict, what it cannot enforce is left to the model and the rest is held
    loose = {"type": "function", "function": {**zipcode["function"], "strict": False}}
    grammar = constrained.forced_arguments_grammar(
        ChatRequest(QUESTION, tools=(loose,), forced_call=ForcedCall("find")), "gpt_oss")
    assert grammar.advance(grammar.start, '{"zip": "abc"}') and grammar.advance(grammar.start, '{"zip": 3') is None
    # GLM-4.5V's tagged arguments likewise; calls the model names itself are left to the model
    tagged = constrained.forced_arguments_grammar(
        ChatRequest(QUESTION, tools=(loose,), forced_call=ForcedCall("find")), "glm4v_moe")
    assert tagged.is_complete(tagged.advance(tagged.start, "<arg_key>zip</arg_key>\n<arg_value>abc</arg_value>\n"
                                                           "</tool_call>"))
    assert tagged.advance(tagged.start, "<arg_key>city") is None
    assert constrained.forced_arguments_grammar(
        ChatRequest(QUESTION, tools=(loose,), forced_call=ForcedCall()), "gpt_oss") is None


# what the model writes of a call it decides on itself, up to where its arguments begin
CALL_STARTS = {"gpt-oss-mxfp4": "<|channel|>commentary to=functions.book_table <|constrain|>json<|message|>",
               "glm-bf16": "I will book it now.\n<tool_call>book_table\n"}


@pytest.mark.parametrize("ahead", [False, True], ids=["eager", "ahead"])
@pytest.mark.parametrize("name", ["gpt-oss-mxfp4", "glm-bf16"])
def test_a_call_the_model_makes_to_a_strict_function_follows_its_schema(name, ahead, monkeypatch):
    """The call's start (scripted) is the model's own choice; from the moment it begins, tokens are
    chosen on the host, so no step launched ahead writes an argument, and the arguments are held."""
    engine = Engine(open_fixture(name), device="cpu", dtype="float32", block_size=4, cuda_graphs=ahead)
    tokenizer = engine.formatter.tokenizer
    start = tokenizer(CALL_STARTS[name], add_special_tokens=False)["input_ids"]
    script = iter(start)
    free = {"n": 0}

    def scripted(logits, samplers, contexts):
        free["n"] += 1
        return [next(script)]

    def scripted_on_device(logits, samplers, contexts):
        return torch.tensor(scripted(logits, samplers, contexts), device=logits.device)

    monkeypatch.setattr(loop_module, "sample_tokens", scripted)
    monkeypatch.setattr(loop_module, "choose_tokens", scripted_on_device)
    lean_towards_endings(engine, name, monkeypatch)
    try:
        items = list(engine.submit(ChatRequest(QUESTION, SamplingParams(max_tokens=300, temperature=0.0),
                                               tools=(WEATHER, BOOKING))))
        final = items[-1]
        calls = [c for d in items if isinstance(d, Delta) for c in d.tool_calls]
        assert final.finish_reason == "tool_calls" and [c.name for c in calls] == ["book_table"], (final, calls)
        args = json.loads(calls[0].arguments)
        assert list(args) == ["restaurant", "people", "time", "terrace"]
        assert len(args["restaurant"]) <= 12 and args["time"] in ("18:00", "19:30", "21:00")
        assert free["n"] == len(start)  # every token after the call's start came from the grammar
        if ahead:
            assert engine.counters()["ahead_steps"] > 0
    finally:
        engine.shutdown()


def test_a_strict_function_offered_with_keywords_it_cannot_enforce_is_held_to_the_rest(engines):
    zipcode = {"type": "function", "function": {"name": "find", "strict": True, "parameters": {
        "type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}}}
    request = ChatRequest(QUESTION, SamplingParams(max_tokens=5), tools=(zipcode,))
    for name in ("gpt-oss-mxfp4", "glm-bf16"):
        assert list(engines(name).submit(request))[-1].finish_reason != "error"
    calls = constrained.strict_calls(request, None, "gpt_oss")
    grammar = constrained.arguments_grammar((zipcode,), "find", "gpt_oss", lenient=True)
    assert grammar.advance(grammar.start, '{"zip": "abc"}') and grammar.advance(grammar.start, '{"zap"') is None
    assert calls is not None and calls("other") is None
