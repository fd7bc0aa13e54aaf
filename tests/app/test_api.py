"""/v1 through the official openai client (and httpx for raw shapes) against a live server."""
import base64
import json
import time

import httpx
import openai
import pytest

from demo_engine import DemoEngine, slow_steps, without_end_of_text
from fake_engine import FakeEngine
from live_server import LiveServer, png_bytes
from localchat.app.ui import create_app
from localchat.engine.runtime import constrained
from localchat.engine.runtime import engine_loop as loop_module
from localchat.engine.runtime.request import Final, ForcedCall, ImagePart, TextPart, ToolCall
from localchat.engine.spec import SamplingDefaults

KEY = "sk-local-test"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture
def api(history):
    engine = FakeEngine(delay=0.002, filler_words=6)
    with LiveServer(create_app(engine, history, api_key=KEY)) as srv:
        yield engine, openai.OpenAI(base_url=srv.url + "v1", api_key=KEY, max_retries=0), srv


def test_models_and_plain_completion(api):
    engine, client, _ = api
    models = client.models.list().data
    assert [(m.id, m.object, m.owned_by) for m in models] == [("fake-glm", "model", "localchat")]
    # localchat's own facts sit under one extra key; what the engine does not know is left out.
    extra = models[0].model_extra["localchat"]
    assert extra["weights_bytes"] == 123_000_000 and extra["placement"] == "cpu (fake)"
    assert "kv_cache_bytes" not in extra and "kv_cache_tokens" not in extra and "kv_window_tokens" not in extra
    r = client.chat.completions.create(
        model="fake-glm", messages=[{"role": "system", "content": "terse"}, {"role": "user", "content": "hi"}],
        temperature=0.3, top_p=0.9, max_tokens=50, stop=["zzz"], seed=7, presence_penalty=0.5, frequency_penalty=-1)
    msg = r.choices[0].message
    assert msg.content == "Seen 0 image(s). You said: hi w0 w1 w2 w3 w4 w5"
    assert msg.model_extra["reasoning_content"] == "Let me look. "
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-") and r.model == "fake-glm" and abs(r.created - time.time()) < 60
    assert r.usage.completion_tokens == 10 and r.usage.total_tokens == r.usage.prompt_tokens + 10
    s = engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.max_tokens, s.stop, s.seed) == (0.3, 0.9, 50, ("zzz",), 7)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -1)
    assert [m.role for m in engine.requests[-1].messages] == ["system", "user"]
    r = client.chat.completions.create(model="fake-glm", messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=4, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason == "length" and engine.requests[-1].thinking is False
    s = engine.requests[-1].sampling  # no recommendation from the model: OpenAI's defaults
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0) and "sampling" not in extra
    assert "reasoning_content" not in r.choices[0].message.model_extra


def test_left_out_sampling_is_the_models_recommendation(history):
    engine = FakeEngine(sampling=SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20))
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].model_extra["localchat"]["sampling"] == \
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
        client.chat.completions.create(model="fake-glm", messages=[{"role": "user", "content": "hi"}])
        s = engine.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k) == (0.6, 0.95, 20)
        client.chat.completions.create(model="fake-glm", messages=[{"role": "user", "content": "hi"}],
                                       temperature=0.0, top_p=0.5, extra_body={"top_k": 0})
        s = engine.requests[-1].sampling
        assert (s.temperature, s.top_p, s.top_k) == (0.0, 0.5, 0)


def test_streaming_with_image_part_and_usage(api):
    engine, client, _ = api
    url = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()
    stream = client.chat.completions.create(
        model="fake-glm", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "describe"},
                                               {"type": "image_url", "image_url": {"url": url}}]}])
    chunks = list(stream)
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "Let me look. " and content.startswith("Seen 1 image(s). You said: describe")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    parts = engine.requests[-1].messages[0].content
    assert isinstance(parts[0], TextPart) and isinstance(parts[1], ImagePart) and parts[1].image.size == (32, 24)


def test_a_messages_images_arrive_in_their_places(api):
    engine, client, _ = api
    urls = ["data:image/png;base64," + base64.b64encode(png_bytes(32 + i, 24, (40 * i, 0, 0))).decode()
            for i in range(3)]
    client.chat.completions.create(model="fake-glm", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": urls[0]}}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": urls[1]}}, {"type": "image_url", "image_url": {"url": urls[2]}}]}])
    parts = engine.requests[-1].messages[0].content
    assert [type(p).__name__ for p in parts] == ["ImagePart", "TextPart", "ImagePart", "ImagePart"]
    assert [p.image.size for p in parts if isinstance(p, ImagePart)] == [(32, 24), (33, 24), (34, 24)]


def test_errors_use_openai_format(api):
    engine, client, srv = api
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-glm", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
    assert e.value.status_code == 400 and e.value.code == "image_url_not_supported"
    assert "only data: URLs are accepted" in e.value.message and e.value.param == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="fake-glm", n=9, messages=[{"role": "user", "content": "x"}])
    assert e.value.param == "n" and "'n' must be an integer from 1 to 8" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found"
    headers = {"Authorization": f"Bearer {KEY}"}
    cases = [({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
             ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
             ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
             ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
             ({"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": "any"},
              "tool_choice"),
             ({"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, "functions"),
             ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"id": "a"}]}]},
              "messages[1].tool_calls[0]"),
             ({"messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
             ({"messages": [{"role": "user", "content": "x"}], "stop": {"a": 1}}, "stop"),
             ({"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}, "frequency_penalty"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
              "messages[0].content[0]"),
             # of a message's images, prepared side by side, the one refused is named
             ({"messages": [{"role": "user", "content": [
                 {"type": "text", "text": "two"},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png_bytes()).decode()}},
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
              "messages[0].content[2]")]
    for body, param in cases:
        r = httpx.post(srv.url + "v1/chat/completions", json=body, headers=headers)
        err = r.json()["error"]
        assert r.status_code == 400 and set(err) == {"message", "type", "param", "code"} and err["param"] == param
    r = httpx.post(srv.url + "v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "v1/nothing", headers=headers).json()["error"]["code"] == "unknown_url"
    r = httpx.get(srv.url + "v1/chat/completions", headers=headers)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert engine.requests == []


def test_api_key_required_when_set(api):
    _, client, srv = api
    for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(srv.url + "v1/models", headers=auth)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=srv.url + "v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="fake-glm", messages=[{"role": "user", "content": "x"}])


def test_health_answers_without_a_key(api):
    engine, _, srv = api
    r = httpx.get(srv.url + "health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    # an engine that can no longer serve says why, so a supervisor restarts it
    engine.health = lambda: "the GPU reported a fault the engine cannot recover from (...); restart localchat"
    r = httpx.get(srv.url + "health")
    assert r.status_code == 503 and r.json()["status"] == "failed" and "restart localchat" in r.json()["error"]


def test_no_key_needed_on_loopback_without_key(history):
    with LiveServer(create_app(FakeEngine(), history)) as srv:
        assert httpx.get(srv.url + "v1/models").json()["data"][0]["id"] == "fake-glm"


@pytest.mark.parametrize("n", [1, 2])
def test_client_disconnect_aborts_engine_stream(api, n):
    engine, _, srv = api
    engine.delay, engine.filler_words = 0.02, 1000
    body = {"model": "fake-glm", "stream": True, "n": n, "messages": [{"role": "user", "content": "go"}]}
    with httpx.stream("POST", srv.url + "v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(8)]
    assert any(line.startswith("data: {") for line in got)
    streams = engine.streams[-n:]
    t = time.time()
    while not all(s in engine.closed for s in streams) and time.time() - t < 5:
        time.sleep(0.02)
    assert all(s in engine.closed for s in streams), "closing the HTTP stream must close every engine stream"
    t = time.time()
    while any(s.finish_reason is None for s in streams) and time.time() - t < 5:
        time.sleep(0.02)
    assert [s.finish_reason for s in streams] == ["abort"] * n


def test_history_system_stop_string_and_lenient_fields(api):
    engine, client, srv = api
    r = client.chat.completions.create(
        model="fake-glm", stop="zzz", top_p=0, extra_body={"n": None},
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": "first"},
                  {"role": "assistant", "content": "an answer", "reasoning_content": "old thought"},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": [{"type": "text", "text": "second"}]}])
    assert r.choices[0].message.content.startswith("Seen 0 image(s). You said: second")
    req = engine.requests[-1]
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "assistant", "user"]
    assert req.messages[2].reasoning == "old thought" and req.messages[2].content == (TextPart("an answer"),)
    # top_p 0 keeps only the most likely token: passed on as a tiny positive p the sampler accepts.
    assert req.sampling.stop == ("zzz",) and 0 < req.sampling.top_p <= 1e-6


@pytest.fixture
def demo_api(demo_runtime, history, monkeypatch):
    """The real engine (demo checkpoint) behind /v1, slowed so a client can leave mid-answer, with
    no end-of-text token, so that a random-weight answer cannot end before the client leaves; every
    item each engine stream hands out is recorded, so tests see the Final the engine itself sent."""
    slow_steps(monkeypatch, demo_runtime, 0.03)
    without_end_of_text(monkeypatch, demo_runtime)
    engine = _RecordingEngine(demo_runtime, max_tokens=400)
    with LiveServer(create_app(engine, history, api_key=KEY)) as srv:
        yield engine, srv


class _RecordingEngine(DemoEngine):
    def submit(self, request):
        stream = super().submit(request)
        stream.seen = []
        return _Recording(stream)


class _Recording:
    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        for item in self.stream:
            self.stream.seen.append(item)
            yield item

    def close(self):
        self.stream.close()


def _engine_final(engine, timeout=10):
    """The Final the engine sent for the last request (read by the server, or still queued in the
    engine stream once nobody reads it), after its KV blocks are back in the pool."""
    stream, deadline = engine.streams[-1], time.time() + timeout
    while True:
        sent = [*stream.seen, *list(stream.items.queue)]
        if sent and isinstance(sent[-1], Final) and \
                engine.counters()["free_blocks"] == engine.counters()["num_blocks"]:
            return sent[-1]
        assert time.time() < deadline, "the engine did not end the request and free its KV blocks"
        time.sleep(0.02)


def test_client_disconnect_aborts_the_real_engine_request(demo_api):
    engine, srv = demo_api
    info = httpx.get(srv.url + "v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
    extra = info["localchat"]
    assert extra["kv_cache_tokens"] == 16384 and extra["kv_cache_bytes"] > 0 and extra["weights_bytes"] > 0
    assert extra["weights_format"] == "float32"  # the demo's bf16 checkpoint, computed in float32 on the CPU
    body = {"model": "demo", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": "go on"}]}
    with httpx.stream("POST", srv.url + "v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: {") and json.loads(line[6:])["choices"] for line in got)
    final = _engine_final(engine)
    assert engine.streams[-1].aborted.is_set()
    assert final.finish_reason == "abort" and 0 < final.completion_tokens < 400

    # A plain (non-streaming) request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "v1/chat/completions", json={**body, "stream": False}, timeout=httpx.Timeout(5, read=0.5),
                   headers={"Authorization": f"Bearer {KEY}"})
    final = _engine_final(engine)
    assert final.finish_reason == "abort" and final.completion_tokens < 400


def test_prompt_over_the_context_is_a_400_before_any_stream(demo_api):
    engine, srv = demo_api
    client = openai.OpenAI(base_url=srv.url + "v1", api_key=KEY, max_retries=0)
    long = [{"role": "user", "content": "the quick brown fox " * 5000}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="demo", messages=long, stream=stream, max_tokens=8)
        assert e.value.code == "context_length_exceeded" and "8192" in e.value.message


def test_model_card_carries_the_sliding_window_pool():
    from localchat.app.api import _model_card
    from localchat.engine.runtime.request import ModelInfo

    info = ModelInfo("gpt-oss-20b", "gpt_oss", 131072, False, "effort", "cuda:0", 13_000_000_000,
                     kv_cache_bytes=25_165_824, kv_cache_tokens=16384, kv_window_tokens=2048)
    extra = _model_card(info, 0)["localchat"]
    assert (extra["kv_cache_tokens"], extra["kv_window_tokens"]) == (16384, 2048)


def test_tool_calls_round_trip(history):
    calls = (ToolCall("call_1", "get_weather", '{"city": "Paris"}'), ToolCall("call_2", "get_weather", '{"city": "Oslo"}'))
    engine = FakeEngine(delay=0.002, calls=calls)
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        question = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
        r = client.chat.completions.create(model="fake-glm", messages=question, tools=[WEATHER])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [(c.id, c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
            ("call_1", "function", "get_weather", {"city": "Paris"}), ("call_2", "function", "get_weather", {"city": "Oslo"})]
        assert engine.requests[-1].tools == (WEATHER,)

        # streamed: one delta per call, indexed, then finish_reason tool_calls
        chunks = list(client.chat.completions.create(model="fake-glm", messages=question, tools=[WEATHER], stream=True))
        deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
        assert [(d[0].index, d[0].id, d[0].function.name) for d in deltas] == [(0, "call_1", "get_weather"),
                                                                             (1, "call_2", "get_weather")]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the results sent back: the engine gets the calls and the results, matched by id
        follow = question + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": "call_2", "content": "snow"},
                             {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sun"}]}]
        r = client.chat.completions.create(model="fake-glm", messages=follow, tools=[WEATHER], tool_choice="none")
        sent = engine.requests[-1]
        assert sent.tools == () and r.choices[0].finish_reason == "stop"  # "none": the model is not shown them
        assert [m.role for m in sent.messages] == ["user", "assistant", "tool", "tool"]
        assert sent.messages[1].tool_calls == calls
        assert [(m.tool_call_id, m.content[0].text) for m in sent.messages[2:]] == [("call_2", "snow"), ("call_1", "sun")]


def test_forced_tool_choice_is_checked_and_passed_on(history):
    calls = (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    engine = FakeEngine(delay=0.002, calls=calls)
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        question = [{"role": "user", "content": "Weather in Paris?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice, forced in (("required", ForcedCall()), (named, ForcedCall("get_weather")), ("auto", None)):
            r = client.chat.completions.create(model="fake-glm", messages=question, tools=[WEATHER], tool_choice=choice)
            assert (engine.requests[-1].tools, engine.requests[-1].forced_call) == ((WEATHER,), forced)
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.tool_calls[0].id == "call_1"
        sent = len(engine.requests)
        bad = [({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                "'get_time', which is not among 'tools' (get_weather)"),
               ({"tool_choice": "required"}, "needs 'tools' to call"),
               ({"tools": [], "tool_choice": named}, "needs 'tools' to call"),
               ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},
                'may be "auto", "none", "required" or {"type": "function", "function": {"name": NAME}}'),
               ({"tools": [WEATHER], "tool_choice": 1}, "got 1.")]
        for fields, message in bad:
            r = httpx.post(srv.url + "v1/chat/completions", json={"messages": question, **fields})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "tool_choice" and message in err["message"], err
        assert len(engine.requests) == sent


@pytest.mark.parametrize("reasoning,family", [("thinking", "glm4v_moe"), ("channels", "gpt_oss")])
def test_a_strict_function_is_refused_only_where_its_arguments_would_be_held(history, reasoning, family):
    """(a named call, in either family)"""
    engine = FakeEngine(delay=0.002, reasoning=reasoning)
    assert engine.info().family == family
    strict = {"type": "function", "function": {"name": "find", "strict": True, "parameters": {
        "type": "object", "properties": {"zip": {"type": "string", "format": "postal-code"}}}}}
    named = {"type": "function", "function": {"name": "find"}}
    question = [{"role": "user", "content": "Find 75001"}]
    with LiveServer(create_app(engine, history)) as srv:
        def post(**fields):
            return httpx.post(srv.url + "v1/chat/completions", json={"messages": question, **fields})

        assert post(tools=[WEATHER, strict]).status_code == 200  # the model decides: nothing is held
        assert post(tools=[WEATHER, strict], tool_choice="required").status_code == 200
        # a named call is held to its schema, which it cannot be in full
        r = post(tools=[WEATHER, strict], tool_choice=named)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools[1].function.parameters", err
        assert "'format' at #/properties/zip is not enforced" in err["message"] and "strict" in err["message"]
        loose = {"type": "function", "function": {**strict["function"], "strict": False}}
        assert post(tools=[loose], tool_choice=named).status_code == 200


def test_a_forced_call_from_the_real_engine_comes_out_like_a_chosen_one(demo_runtime, history, monkeypatch):
    tokenizer = demo_runtime.formatter.tokenizer
    # what the model writes after the forced `<tool_call>get_weather\n`, then the end of its turn
    script = tokenizer("<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
                       add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|observation|>")]
    tokens = iter(())

    def scripted(logits, samplers, contexts):
        return [next(tokens)]

    monkeypatch.setattr(loop_module, "sample_tokens", scripted)
    # the arguments of a named call are chosen by its schema's grammar: the script stands in there too
    monkeypatch.setattr(constrained.JsonAnswer, "choose", lambda answer, logits, sampler, context: next(tokens))
    engine = DemoEngine(demo_runtime, max_tokens=50)
    named = {"type": "function", "function": {"name": "get_weather"}}
    question = [{"role": "user", "content": "Weather in Paris?"}]
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        tokens = iter(script)
        r = client.chat.completions.create(model="demo", messages=question, tools=[WEATHER], tool_choice=named)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert "reasoning_content" not in choice.message.model_extra
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        tokens = iter(script)
        chunks = list(client.chat.completions.create(model="demo", messages=question, tools=[WEATHER],
                                                     tool_choice=named, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not any(d.content or (d.model_extra or {}).get("reasoning_content") for d in deltas)
        assert [(t.index, t.function.name, json.loads(t.function.arguments))
                for d in deltas for t in d.tool_calls or ()] == [(0, "get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_prompt_tokens_found_in_the_prefix_cache_are_reported(demo_runtime, history):
    from types import SimpleNamespace

    from localchat.app.remote import RemoteEngine
    from localchat.app.ui_render import answer_stats, status_line
    from localchat.engine.runtime.request import ChatRequest, Message, SamplingParams

    system = f"You are a ship's cook (chat {time.time_ns()}). " + "Answer in one short line. " * 6
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is for dinner?"}]
    engine = DemoEngine(demo_runtime, max_tokens=4)
    with LiveServer(create_app(engine, history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
        again = client.chat.completions.create(model="demo", messages=messages, max_tokens=4, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < again.usage.prompt_tokens
        # a localchat behind --backend reports it too, and the status line says it
        request = ChatRequest((Message.text("system", system), Message.text("user", "What is for dinner?")),
                              SamplingParams(max_tokens=4, temperature=0))
        final = list(RemoteEngine(srv.url + "v1").submit(request))[-1]
        assert final.cached_tokens == cached
        stats = answer_stats(final, 4096, None)
        _, details = status_line(SimpleNamespace(stats=stats, status="done"))
        assert f"({cached:,} of them from the prefix cache)" in details


def test_several_choices_decode_together(api, demo_runtime, history):
    engine, client, srv = api
    question = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="fake-glm", messages=question, n=3, seed=7, max_tokens=50)
    assert [c.index for c in r.choices] == [0, 1, 2] and len(engine.requests) == 3
    assert [q.sampling.seed for q in engine.requests] == [7, 8, 9]  # each choice its own draw, reproducibly
    assert all(c.message.content.startswith("Seen 0 image(s). You said: hi") for c in r.choices)
    assert r.usage.completion_tokens == 3 * 10 and r.usage.prompt_tokens == 1
    chunks = list(client.chat.completions.create(model="fake-glm", messages=question, n=2, stream=True,
                                                 stream_options={"include_usage": True}))
    by_choice = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            by_choice[choice.index] += choice.delta.content or ""
    finished = [ch.index for c in chunks for ch in c.choices if ch.finish_reason]
    assert sorted(finished) == [0, 1] and by_choice[0] == by_choice[1] == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []
    # the real engine: sampled choices differ and a seed gives them again; greedy ones agree
    with LiveServer(create_app(DemoEngine(demo_runtime, max_tokens=50), history)) as real:
        demo = openai.OpenAI(base_url=real.url + "v1", api_key="unused", max_retries=0)

        def answers(**sampling):
            out = demo.chat.completions.create(model="demo", messages=question, n=3, max_tokens=8, **sampling)
            return [(c.message.content, c.message.model_extra.get("reasoning_content")) for c in out.choices]

        sampled = answers(temperature=1.0, seed=11)
        assert len(set(sampled)) > 1 and answers(temperature=1.0, seed=11) == sampled
        assert len(set(answers(temperature=0))) == 1
