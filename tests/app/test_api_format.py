"""response_format on /v1/chat/completions: JSON mode and JSON schemas accepted and passed on (to
the engine, and by --backend to the server behind), schemas the engine cannot hold to and malformed
formats refused with what to do, and the real engine's JSON answers parsing and following their
schema, streamed or not."""
import json

import httpx
import openai
import pytest

from demo_engine import DemoEngine
from fake_engine import FakeEngine
from live_server import LiveServer
from localchat.app.remote import RemoteEngine
from localchat.app.ui import create_app
from localchat.engine.runtime.json_schema import compile_schema
from localchat.engine.runtime.request import ChatRequest, Message
from localchat.engine.runtime.schema_constraint import SchemaGrammar

QUESTION = [{"role": "user", "content": "Describe a cat as JSON."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def fake_api(history):
    engine = FakeEngine(delay=0.001, filler_words=2)
    with LiveServer(create_app(engine, history)) as srv:
        yield engine, srv.url + "v1"


def post(url: str, **fields) -> httpx.Response:
    return httpx.post(url + "/chat/completions", json={"messages": QUESTION, **fields})


def test_json_object_reaches_the_engine(fake_api):
    engine, url = fake_api
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="fake-glm", messages=QUESTION, response_format={"type": "json_object"})
    assert engine.requests[-1].response_format == "json_object"
    for fields in ({"response_format": {"type": "text"}}, {}):
        assert post(url, **fields).status_code == 200 and engine.requests[-1].response_format == "text"
    # tools the model is not shown (tool_choice "none") leave nothing to conflict with
    r = post(url, response_format={"type": "json_object"}, tools=[WEATHER], tool_choice="none")
    assert r.status_code == 200 and engine.requests[-1].tools == () and engine.requests[-1].response_format == "json_object"


CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "lives": {"type": "integer"},
                                       "color": {"enum": ["black", "white"]}},
       "required": ["name", "lives", "color"], "additionalProperties": False}
CAT_FORMAT = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}


def test_a_json_schema_reaches_the_engine_compiled(fake_api):
    engine, url = fake_api
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    client.chat.completions.create(model="fake-glm", messages=QUESTION, response_format=CAT_FORMAT)
    request = engine.requests[-1]
    assert request.response_format == "json_schema"
    schema = request.response_schema
    assert (schema.name, schema.strict, schema.source) == ("cat", True, CAT)


@pytest.mark.parametrize("schema,strict,phrase", [
    ({"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]+$"}}}, True,
     "'pattern' at #/properties/zip is not enforced by localchat; remove it, or send \"strict\": false"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, False, "'not' at #/properties/a is not supported"),
    ({"type": "array", "items": {"type": "string"}}, False, "top level must be an object"),
])
def test_a_schema_the_engine_cannot_hold_to_is_refused_saying_where(fake_api, schema, strict, phrase):
    engine, url = fake_api
    r = post(url, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                          "strict": strict}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format" and phrase in err["message"], err
    assert engine.requests == []


def test_without_strict_a_format_keyword_is_accepted(fake_api):
    engine, url = fake_api
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}}
    r = post(url, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200 and engine.requests[-1].response_schema.strict is False


@pytest.mark.parametrize("fields,param,phrase", [
    ({"response_format": "json_object"}, "response_format", "must be"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": {}}, "response_format", "must be"),
    ({"response_format": [{"type": "json_object"}]}, "response_format", "must be"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format",
     "a function call is not one"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "response_format",
     "a function call is not one"),
    ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop", "cut the object short"),
    ({"response_format": {"type": "json_object"}, "stop": ["\n\n"]}, "stop", "cut the object short"),
    ({"response_format": CAT_FORMAT, "stop": "}"}, "stop", "cut the object short"),
    ({"response_format": CAT_FORMAT, "tools": [WEATHER]}, "response_format", "a function call is not one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": CAT, "strict": "yes"}}},
     "response_format", "'strict' true or false"),
])
def test_formats_json_mode_cannot_serve_are_refused(fake_api, fields, param, phrase):
    engine, url = fake_api
    r = post(url, **fields)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and phrase in err["message"], err
    assert engine.requests == []


def test_the_backend_is_asked_for_json_mode(fake_api):
    engine, url = fake_api
    remote = RemoteEngine(url)
    request = ChatRequest((Message.text("user", "A cat as JSON."),), response_format="json_object")
    assert remote._body(request)["response_format"] == {"type": "json_object"}
    assert "response_format" not in remote._body(ChatRequest((Message.text("user", "hi"),)))
    items = list(remote.submit(request))
    assert items[-1].finish_reason == "stop" and engine.requests[-1].response_format == "json_object"
    # a schema goes on as the request gave it
    schema = compile_schema(CAT, "cat", strict=True)
    request = ChatRequest((Message.text("user", "A cat as JSON."),), response_format="json_schema",
                          response_schema=schema)
    assert remote._body(request)["response_format"] == CAT_FORMAT
    list(remote.submit(request))
    assert engine.requests[-1].response_schema.source == CAT


def test_the_real_engine_answers_one_json_object(demo_runtime, history):
    engine = DemoEngine(demo_runtime, max_tokens=200)
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        for seed in (None, 1, 2):
            sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
            r = client.chat.completions.create(model="demo", messages=QUESTION, response_format={"type": "json_object"},
                                               **sampling)
            choice = r.choices[0]
            assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
            assert "reasoning_content" not in choice.message.model_extra  # the demo thinks, but not in JSON mode
            chunks = list(client.chat.completions.create(model="demo", messages=QUESTION, stream=True,
                                                         response_format={"type": "json_object"}, **sampling))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert isinstance(json.loads(content), dict) and chunks[-1].choices[0].finish_reason == "stop"
            assert not any((c.choices[0].delta.model_extra or {}).get("reasoning_content") for c in chunks if c.choices)
    assert all(r.response_format == "json_object" for r in engine.requests)


def test_the_real_engine_answers_as_the_schema_says(demo_runtime, history):
    engine = DemoEngine(demo_runtime, max_tokens=400)
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            r = client.chat.completions.create(model="demo", messages=QUESTION, response_format=CAT_FORMAT, **sampling)
            choice = r.choices[0]
            if choice.finish_reason == "stop":
                cat = json.loads(choice.message.content)
                assert list(cat) == ["name", "lives", "color"] and isinstance(cat["lives"], int), cat
                assert len(cat["name"]) <= 12 and cat["color"] in ("black", "white")
            else:  # the demo's random layers may fill max_tokens with whitespace and digits
                grammar = SchemaGrammar(compile_schema(CAT))
                assert choice.finish_reason == "length" and choice.message.content.startswith("{")
                assert grammar.advance(grammar.start, choice.message.content.encode().decode("latin-1"))
    assert all(r.response_format == "json_schema" for r in engine.requests)
