"""Function calling: each family's calls taken out of its output (any piece boundaries), the tools,
calls and results rendered through the checkpoints' templates, and the engine ending a turn with
finish_reason "tool_calls"."""
import json
import random

import pytest

from fixtures import open_fixture
from localchat.engine.runtime import engine_loop as loop_module
from localchat.engine.runtime.engine import Engine
from localchat.engine.runtime.reasoning import GlmReasoningParser, HarmonyParser
from localchat.engine.runtime.request import ChatRequest, Delta, Final, Message, SamplingParams, ToolCall

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "units": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

GLM_CALLS = ("<think>Weather needs a lookup.</think>Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
             "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n"
             "<arg_value>42</arg_value>\n</tool_call>\n<tool_call>get_time\n</tool_call>")
# the recipient after the channel (as the model writes it) and after the role (as the template does)
HARMONY_CALLS = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}')
HARMONY_ROLE_RECIPIENT = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'


def _run(parser, pieces):
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(a for a, _ in outs), "".join(r for _, r in outs), parser.calls


def _pieces(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 20)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_glm_calls_come_out_of_the_answer_with_typed_arguments():
    rng = random.Random(0)
    for pieces in [[GLM_CALLS]] + [_pieces(GLM_CALLS, rng) for _ in range(100)]:
        answer, reasoning, calls = _run(GlmReasoningParser(tools=(WEATHER, TIME)), pieces)
        assert (answer, reasoning) == ("Let me check.\n\n", "Weather needs a lookup.")
        assert [c.name for c in calls] == ["get_weather", "get_time"]
        # a string parameter stays text even when it looks like a number; others are JSON values
        assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3, "units": "42"}
        assert json.loads(calls[1].arguments) == {} and calls[0].id != calls[1].id


def test_without_tools_a_call_is_just_text():
    answer, _, calls = _run(GlmReasoningParser(), [GLM_CALLS])
    assert "<tool_call>get_weather" in answer and calls == []
    _, reasoning, calls = _run(HarmonyParser(), [HARMONY_CALLS])
    assert '{"city": "Paris"' in reasoning and calls == []


def test_a_cut_off_glm_call_is_shown_as_text():
    answer, _, calls = _run(GlmReasoningParser(thinking=False, tools=(WEATHER,)), ["<tool_call>get_wea"])
    assert (answer, calls) == ("<tool_call>get_wea", [])


def test_harmony_calls_end_at_the_turn_or_at_call():
    rng = random.Random(1)
    for pieces in [[HARMONY_CALLS]] + [_pieces(HARMONY_CALLS, rng) for _ in range(100)]:
        # the turn ends at <|call|>, an end-of-sequence id the text never shows
        answer, reasoning, calls = _run(HarmonyParser(tools=(WEATHER,)), pieces)
        assert (answer, reasoning) == ("", "Need the weather.")
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 3})]
    _, _, calls = _run(HarmonyParser(tools=(TIME,)), [HARMONY_ROLE_RECIPIENT])
    assert [(c.name, c.arguments) for c in calls] == [("get_time", "{}")]
    # arguments cut off by max tokens: no call, the text stays commentary
    _, reasoning, calls = _run(HarmonyParser(tools=(WEATHER,)), [HARMONY_CALLS[:-8]])
    assert calls == [] and reasoning == 'Need the weather.{"city": "Paris", "d'


def _call(name, args, call_id):
    return ToolCall(call_id, name, json.dumps(args))


def _result(text, call_id):
    return Message("tool", Message.text("tool", text).content, tool_call_id=call_id)


def _history():
    """A question, one answer calling two tools, their results (in the other order), a question."""
    a, b = _call("get_weather", {"city": "Paris"}, "call_a"), _call("get_time", {}, "call_b")
    return (Message.text("system", "Be brief."), Message.text("user", "Weather and time in Paris?"),
            Message("assistant", (), reasoning="Two lookups.", tool_calls=(a, b)),
            _result("14:05", "call_b"), _result("sunny", "call_a"),
            Message.text("user", "And tomorrow?"))


def test_glm_template_gets_the_tools_the_calls_and_the_results():
    engine = Engine(open_fixture("glm-bf16"), device="cpu", dtype="float32", block_size=4)
    try:
        text = engine.formatter.render(ChatRequest(_history(), tools=(WEATHER, TIME)))
        assert '"name": "get_weather"' in text and '"name": "get_time"' in text and "# Tools" in text
        assert ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
                "\n<tool_call>get_time\n</tool_call>") in text
        # one <|observation|> for the run of results, each in its own <tool_response>
        assert text.count("<|observation|>") == 1
        assert "<tool_response>\n14:05\n</tool_response>\n<tool_response>\nsunny\n</tool_response>" in text
        assert "# Tools" not in engine.formatter.render(ChatRequest(_history()[:2]))
    finally:
        engine.shutdown()


def test_gpt_oss_template_gets_one_call_a_message_each_with_its_result():
    engine = Engine(open_fixture("gpt-oss-mxfp4"), device="cpu", dtype="float32", block_size=4)
    try:
        text = engine.formatter.render(ChatRequest(_history(), tools=(WEATHER, TIME)))
        assert "namespace functions" in text and "type get_weather" in text and "// \ntype get_time" in text
        assert "Calls to these tools must go to the commentary channel: 'functions'." in text
        # the thinking before the calls, then each call followed by its own result
        assert ('<|start|>assistant<|channel|>analysis<|message|>Two lookups.<|end|>'
                '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
                '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
                '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
                '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"14:05"<|end|>') in text
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name,script,end", [
    ("gpt-oss-mxfp4", HARMONY_CALLS, "<|call|>"),
    ("glm-bf16", GLM_CALLS.replace("<think>", "", 1), "<|observation|>"),
])
def test_the_engine_streams_the_calls_and_ends_with_tool_calls(name, script, end, monkeypatch):
    engine = Engine(open_fixture(name), device="cpu", dtype="float32", block_size=4)
    tokenizer = engine.formatter.tokenizer
    tokens = iter(tokenizer(script, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(end)])
    # the model's choices replaced by the script, one token a step
    monkeypatch.setattr(loop_module, "sample_tokens", lambda logits, samplers, contexts: [next(tokens)])
    try:
        stream = engine.submit(ChatRequest((Message.text("user", "Weather in Paris?"),),
                                           SamplingParams(max_tokens=200), tools=(WEATHER, TIME)))
        items = list(stream)
        calls = [c for d in items if isinstance(d, Delta) for c in d.tool_calls]
        final = items[-1]
        assert isinstance(final, Final) and final.finish_reason == "tool_calls"
        assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] == "Paris"
        assert "<tool_call>" not in "".join(d.text for d in items if isinstance(d, Delta))
    finally:
        engine.shutdown()
