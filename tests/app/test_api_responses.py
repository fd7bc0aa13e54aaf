"""/v1/responses (app/api_responses.py) through the official openai client, which parses every
response and stream event into its own types, and httpx for raw shapes and errors: the request
translated into what the engine runs, the output items and events built from its answer."""
import base64
import json

import httpx
import openai
import pytest

from demo_engine import DemoEngine
from fake_engine import FakeEngine
from live_server import LiveServer, png_bytes
from localchat.app.ui import create_app
from localchat.engine.runtime.request import ImagePart, TextPart, ToolCall

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def served(history):
    engines = {}

    def serve(**options):
        engine = FakeEngine(delay=0.002, filler_words=3, **options)
        srv = LiveServer(create_app(engine, history)).__enter__()
        engines[srv] = engine
        return engine, openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0), srv.url + "v1"

    yield serve
    for srv in engines:
        srv.__exit__(None, None, None)


def test_a_response_holds_the_reasoning_and_the_answer(served):
    engine, client, _ = served()
    r = client.responses.create(model="fake-glm", input="hi there", instructions="Be brief.", max_output_tokens=50,
                                temperature=0.3, reasoning={"effort": "low"})
    request = engine.requests[-1]
    assert [(m.role, m.content[0].text) for m in request.messages] == [("system", "Be brief."), ("user", "hi there")]
    assert request.sampling.max_tokens == 50 and request.sampling.temperature == 0.3
    assert request.reasoning_effort == "low"
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_") and r.model == "fake-glm"
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["Let me look. "]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.output_text == "Seen 0 image(s). You said: hi there w0 w1 w2"
    assert r.usage.output_tokens == 7 and r.usage.output_tokens_details.reasoning_tokens == 3
    assert r.usage.total_tokens == r.usage.input_tokens + 7 and r.usage.input_tokens_details.cached_tokens == 0
    assert r.instructions == "Be brief." and r.max_output_tokens == 50


def test_streamed_events_build_the_same_response(served):
    _, client, _ = served()
    plain = client.responses.create(model="fake-glm", input="hello")
    events = list(client.responses.create(model="fake-glm", input="hello", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[2:6] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = events[-1].response
    assert text == plain.output_text == done.output_text and reasoning == "Let me look. "
    assert [e.text for e in events if e.type == "response.output_text.done"] == [text]
    # the reasoning item closes before the message opens; both end "completed"
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    finished = [(e.output_index, e.item.type, e.item.status) for e in events if e.type == "response.output_item.done"]
    assert added == [(0, "reasoning"), (1, "message")]
    assert finished == [(0, "reasoning", "completed"), (1, "message", "completed")]
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    assert [i.type for i in done.output] == ["reasoning", "message"] and done.usage.output_tokens == 7


def test_a_cut_off_answer_is_incomplete(served):
    _, client, _ = served()
    r = client.responses.create(model="fake-glm", input="hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete"
    events = list(client.responses.create(model="fake-glm", input="hi", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


def test_function_calls_go_out_as_items_and_their_outputs_come_back(served):
    call = ToolCall("call_7", "get_weather", '{"city": "Paris"}')
    engine, client, _ = served(calls=(call,))
    r = client.responses.create(model="fake-glm", input="Weather in Paris?", tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    request = engine.requests[-1]
    assert request.tools == ({"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                        "parameters")}},)
    assert request.forced_call.function == "get_weather"
    calls = [i for i in r.output if i.type == "function_call"]
    assert [(c.call_id, c.name, json.loads(c.arguments)) for c in calls] == [("call_7", "get_weather", {"city": "Paris"})]
    assert r.status == "completed" and r.tools[0].name == "get_weather"
    events = list(client.responses.create(model="fake-glm", input="Weather in Paris?", tools=[WEATHER], stream=True))
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == ['{"city": "Paris"}']
    # the next turn sends the reasoning, the call and its output back, and the engine sees a chat
    client.responses.create(model="fake-glm", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_7", "output": "Sunny, 21 C"},
        {"role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]}])
    user, assistant, tool, again = engine.requests[-1].messages
    assert (user.role, assistant.role, tool.role, again.role) == ("user", "assistant", "tool", "user")
    assert assistant.reasoning == "Look it up." and [(c.id, c.name) for c in assistant.tool_calls] == [
        ("call_7", "get_weather")]
    assert tool.tool_call_id == "call_7" and tool.content[0].text == "Sunny, 21 C"


def test_images_and_assistant_turns_reach_the_engine(served):
    engine, client, _ = served()
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    r = client.responses.create(model="fake-glm", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                     {"type": "input_image", "image_url": url}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A square."}]},
        {"role": "user", "content": "Which colour?"}])
    first, answer, last = engine.requests[-1].messages
    assert [type(p) for p in first.content] == [TextPart, ImagePart]
    assert (answer.role, answer.content[0].text, last.content[0].text) == ("assistant", "A square.", "Which colour?")
    assert r.output_text.startswith("Seen 1 image(s).")


@pytest.mark.parametrize("fields,param,phrase", [
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "keeps no conversation objects"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type", "function tools only"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", ""),
    ({"input": []}, "input", "non-empty list"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stores none"),
    ({"input": [{"role": "assistant", "content": "Hello."}]}, "input", "at least one user message"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content",
     "data: URL"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "array"}}}},
     "text.format", "top level must be an object"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice",
     "'nope'"),
])
def test_requests_it_cannot_serve_are_refused_naming_the_field(served, fields, param, phrase):
    engine, _, url = served()
    r = httpx.post(url + "/responses", json={"model": "fake-glm", **fields})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and phrase in err["message"], err
    assert engine.requests == []


def test_the_real_engine_answers_to_a_schema_streamed_or_not(demo_runtime, history):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
              "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": True}}
    engine = DemoEngine(demo_runtime, max_tokens=200)
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        r = client.responses.create(model="demo", input="A colour as JSON.", text=fmt, temperature=0)
        assert r.status == "completed" and json.loads(r.output_text)["colour"] in ("red", "green", "blue")
        assert [i.type for i in r.output] == ["message"]  # JSON answers come without reasoning
        events = list(client.responses.create(model="demo", input="A colour as JSON.", text=fmt, temperature=0,
                                              stream=True))
        assert events[-1].type == "response.completed" and events[-1].response.output_text == r.output_text
        # a second turn over the same prefix finds it in the cache
        again = client.responses.create(model="demo", input="A colour as JSON.", text=fmt, temperature=0)
        assert again.usage.input_tokens_details.cached_tokens > 0


def test_a_response_goes_on_from_a_stored_one(served):
    call = ToolCall("call_9", "get_weather", '{"city": "Oslo"}')
    engine, client, url = served()
    first = client.responses.create(model="fake-glm", input="My name is Ada.", instructions="Be brief.")
    second = client.responses.create(model="fake-glm", previous_response_id=first.id, input="What is my name?")
    user, answer, question = engine.requests[-1].messages  # instructions are not inherited
    assert (user.role, answer.role, question.role) == ("user", "assistant", "user")
    assert answer.content[0].text == first.output_text and answer.reasoning == "Let me look. "
    assert second.previous_response_id == first.id
    # streamed responses are kept too, and chains go on
    streamed = list(client.responses.create(model="fake-glm", previous_response_id=second.id, input="Again?",
                                            stream=True))[-1].response
    client.responses.create(model="fake-glm", previous_response_id=streamed.id, input="Once more?")
    assert [m.role for m in engine.requests[-1].messages] == ["user", "assistant"] * 3 + ["user"]
    # store: false keeps nothing to go on from
    private = client.responses.create(model="fake-glm", input="A secret.", store=False)
    r = httpx.post(url + "/responses", json={"model": "fake-glm", "previous_response_id": private.id, "input": "?"})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "response_not_found" and "store: false" in err["message"]
    # a function call, then its output in the next request
    engine.calls = (call,)
    asked = client.responses.create(model="fake-glm", input="Weather in Oslo?", tools=[WEATHER])
    client.responses.create(model="fake-glm", previous_response_id=asked.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": "call_9", "output": "Snow"}])
    user, calling, result = engine.requests[-1].messages
    assert [(c.id, c.name) for c in calling.tool_calls] == [("call_9", "get_weather")]
    assert (result.role, result.tool_call_id, result.content[0].text) == ("tool", "call_9", "Snow")


def test_only_the_last_responses_are_kept():
    from localchat.app.api_errors import ApiError
    from localchat.app.api_responses import ResponseStore

    store = ResponseStore(size=2)
    for rid in ("a", "b", "c"):
        store.put(rid, [{"role": "user", "content": rid}])
    store.get("b")  # used: kept longer than c
    store.put("d", [])
    with pytest.raises(ApiError):
        store.get("a")
    with pytest.raises(ApiError):
        store.get("c")
    assert store.get("b") == [{"role": "user", "content": "b"}] and store.get("d") == []


def test_truncation_auto_lets_a_long_conversation_go_on_without_its_oldest_items(served):
    engine, client, url = served()
    r = client.responses.create(model="fake-glm", input="hi")
    assert engine.requests[-1].overflow == "error" and r.truncation == "disabled"
    r = client.responses.create(model="fake-glm", input="hi", truncation="auto")
    assert engine.requests[-1].overflow == "drop_oldest" and r.truncation == "auto"
    err = httpx.post(url + "/responses", json={"model": "fake-glm", "input": "hi", "truncation": "middle"}).json()
    assert err["error"]["param"] == "truncation"


def test_stored_images_are_bounded_by_their_bytes():
    from localchat.app.api_responses import ResponseStore

    store = ResponseStore(size=10, max_bytes=1000)
    photo = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 600}}]}
    store.put("a", [photo])
    store.put("b", store.get("a") + [{"role": "assistant", "content": "A cat."}])  # shares the photo: counted once
    assert store.get("a") and store.get("b")
    store.put("c", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "B" * 600}}]}])
    with pytest.raises(Exception):
        store.get("a")
    assert store.get("c")  # the newest stays, whatever its size
