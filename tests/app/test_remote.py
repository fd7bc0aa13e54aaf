"""RemoteEngine against localchat's own /v1 served by uvicorn over the fake engine."""
import time

import pytest

from fake_engine import FakeEngine
from live_server import LiveServer, free_port, png_bytes
from localchat.app.remote import DEFAULT_CONTEXT, RemoteEngine
from localchat.app.ui import create_app
from localchat.engine.runtime.request import (
    ChatRequest, Delta, Final, ForcedCall, ImagePart, Message, SamplingParams, TextPart, Timings,
)
from localchat.engine.spec import SamplingDefaults

KEY = "sk-remote-test"


@pytest.fixture
def server(history):
    engine = FakeEngine(delay=0.002, filler_words=6)
    with LiveServer(create_app(engine, history, api_key=KEY)) as srv:
        yield engine, srv.url + "v1"


def ask(text, *parts, **sampling):
    return ChatRequest((Message("user", (*parts, TextPart(text))),), SamplingParams(**sampling))


def collect(stream):
    items = list(stream)
    deltas = [i for i in items if isinstance(i, Delta)]
    assert isinstance(items[-1], Final) and all(not isinstance(i, Final) for i in items[:-1])
    return "".join(d.text for d in deltas), "".join(d.reasoning for d in deltas), items[-1]


def test_info_comes_from_the_model_list(server):
    _, url = server
    info = RemoteEngine(url, api_key=KEY).info()
    assert (info.name, info.context_length, info.supports_images, info.reasoning) == ("fake-glm", 8192, True, "thinking")
    assert info.placement.startswith("remote (127.0.0.1:") and info.placement.endswith(" on cpu (fake)")
    # Another localchat reports its weight memory; the fake engine knows no KV cache size: unknown stays None.
    assert info.weights_bytes == 123_000_000 and info.kv_cache_bytes is None and info.kv_cache_tokens is None


def test_info_from_a_plain_openai_card_leaves_memory_unknown():
    from localchat.app.remote import _model_info

    info = _model_info({"id": "some-model", "object": "model", "max_model_len": 4096}, "http://h:8000/v1")
    assert (info.context_length, info.placement, info.weights_bytes, info.kv_cache_bytes) == \
        (4096, "remote (h:8000)", 0, None)
    full = _model_info({"id": "demo", "localchat": {"kv_cache_bytes": 25_165_824, "kv_cache_tokens": 16384,
                                                   "kv_window_tokens": 2048, "weights_bytes": True,
                                                   "weights_format": "MXFP4 experts; bf16 elsewhere"}},
                       "http://h:8000/v1")
    assert (full.kv_cache_bytes, full.kv_cache_tokens, full.weights_bytes) == (25_165_824, 16384, 0)
    assert full.kv_window_tokens == 2048 and info.kv_window_tokens is None
    assert full.weights_format == "MXFP4 experts; bf16 elsewhere" and info.weights_format is None
    assert info.sampling == SamplingDefaults() and full.sampling == SamplingDefaults()
    tuned = _model_info({"id": "demo", "localchat": {"sampling": {"temperature": 0.8, "top_k": 40, "top_p": "x"}}},
                        "http://h:8000/v1")
    assert tuned.sampling == SamplingDefaults(temperature=0.8, top_p=None, top_k=40)


def test_streams_text_reasoning_and_usage_with_sampling_params(server):
    engine, url = server
    remote = RemoteEngine(url.removesuffix("/v1"), api_key=KEY)  # a bare host gets /v1
    text, reasoning, final = collect(remote.submit(ask(
        "hi", temperature=0.3, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, seed=7,
        max_tokens=50, stop=("zzz",), presence_penalty=0.5, frequency_penalty=-0.25)))
    assert reasoning == "Let me look. " and text == "Seen 0 image(s). You said: hi w0 w1 w2 w3 w4 w5"
    assert final.finish_reason == "stop" and final.completion_tokens == 10 and final.prompt_tokens == 1
    assert final.timings.ttft > 0 and final.error is None
    s = engine.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed, s.max_tokens, s.stop) == \
        (0.3, 0.9, 20, 0.05, 1.1, 7, 50, ("zzz",))
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.25)
    assert engine.requests[-1].thinking is True


def test_image_thinking_off_and_length(server):
    engine, url = server
    image = ImagePart.from_bytes(png_bytes(40, 30))
    history = Message("assistant", (TextPart("earlier"),), reasoning="old thought")
    request = ChatRequest((Message.text("system", "terse"), Message.text("user", "a"), history,
                           Message("user", (image, TextPart("describe"))),),
                          SamplingParams(max_tokens=3), thinking=False)
    text, reasoning, final = collect(RemoteEngine(url, api_key=KEY).submit(request))
    assert reasoning == "" and text == "Seen 1 image(s). You said: describe w0 w1"
    assert final.finish_reason == "length" and final.completion_tokens == 3
    got = engine.requests[-1]
    assert got.thinking is False and [m.role for m in got.messages] == ["system", "user", "assistant", "user"]
    assert got.messages[2].reasoning == "old thought"
    sent = got.messages[3].content[0]
    assert isinstance(sent, ImagePart) and sent.image.size == (40, 30)
    assert sent.image.tobytes() == image.image.tobytes()  # PNG on the wire is lossless


def test_close_aborts_the_remote_request(history):
    engine = FakeEngine(delay=0.05, filler_words=400)
    with LiveServer(create_app(engine, history)) as srv:
        stream = RemoteEngine(srv.url + "v1").submit(ask("go"))
        it = iter(stream)
        assert isinstance(next(it), Delta)
        t0 = time.perf_counter()
        stream.close()
        rest = list(it)
        assert isinstance(rest[-1], Final) and rest[-1].finish_reason == "abort"
        assert time.perf_counter() - t0 < 1.0
        deadline = time.time() + 5
        while not engine.closed and time.time() < deadline:  # the server saw the client go
            time.sleep(0.02)
        assert engine.closed and engine.closed[0].finish_reason == "abort"


def test_http_errors_become_a_final_error_naming_the_server(server):
    _, url = server
    final = list(RemoteEngine(url, api_key="wrong").submit(ask("hi")))[-1]
    # info() fails first here: GET /models is refused too
    assert final.finish_reason == "error" and url in final.error and "401" in final.error
    with pytest.raises(RuntimeError, match="401"):
        RemoteEngine(url, api_key="wrong").info()
    remote = RemoteEngine(url, api_key=KEY)
    remote.info()
    final = list(remote.submit(ask("hi", max_tokens=10**9)))[-1]  # over the context: the server says 400
    assert final.finish_reason == "error" and "HTTP 400" in final.error and "max_tokens" in final.error
    with pytest.raises(RuntimeError, match="does not serve model 'nope'.*fake-glm"):
        RemoteEngine(url, api_key=KEY, model="nope").info()


class FailingEngine(FakeEngine):
    def submit(self, request):
        return iter([Delta(text="par"), Final("error", 3, 1, Timings(), error="out of memory")])


def test_an_error_inside_the_stream_and_an_unreachable_server(history):
    with LiveServer(create_app(FailingEngine(), history)) as srv:
        text, _, final = collect(RemoteEngine(srv.url + "v1").submit(ask("hi")))
    assert text == "par" and final.finish_reason == "error" and "out of memory" in final.error
    with pytest.raises(RuntimeError, match="cannot reach the backend"):
        RemoteEngine(f"http://127.0.0.1:{free_port()}/v1", timeout_s=2).info()


def test_unknown_context_length_gets_a_default():
    from localchat.app.remote import _model_info

    info = _model_info({"id": "openai/gpt-oss-20b"}, "http://h:8000/v1")
    assert (info.context_length, info.reasoning) == (DEFAULT_CONTEXT, "effort")
    assert _model_info({"id": "zai-org/GLM-4.5V", "max_model_len": 65536}, "http://h/v1").context_length == 65536


def test_serve_with_backend_loads_no_model(server, monkeypatch):
    from localchat.app import cli, ui

    _, url = server
    seen = {}
    monkeypatch.setattr(ui, "serve", lambda engine, **kw: seen.update(engine=engine, **kw))
    monkeypatch.setattr(cli, "_load_engine", lambda *a: pytest.fail("no local model may load"))
    assert cli.main(["--backend", url, "--backend-key", KEY, "--no-browser"]) == 0
    assert isinstance(seen["engine"], RemoteEngine) and seen["engine"].info().name == "fake-glm"
    assert seen["demo_note"] is None and seen["api_key"] is None
    assert cli.main(["--backend", url, "--no-browser"]) == 1  # the server wants a key: one line, no serve


def test_tools_go_to_the_backend_and_its_calls_come_back(history):
    from localchat.engine.runtime.request import ToolCall

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    calls = (ToolCall("call_1", "get_weather", '{"city": "Paris"}'), ToolCall("call_2", "get_weather", "{}"))
    engine = FakeEngine(delay=0.002, calls=calls)
    with LiveServer(create_app(engine, history)) as srv:
        remote = RemoteEngine(srv.url + "v1")
        items = list(remote.submit(ChatRequest((Message.text("user", "Weather?"),), tools=(weather,))))
        got = [c for i in items if isinstance(i, Delta) for c in i.tool_calls]
        assert got == list(calls) and items[-1].finish_reason == "tool_calls"
        assert engine.requests[-1].tools == (weather,)
        # the calls and their results go back to the backend as they were
        follow = (Message.text("user", "Weather?"), Message("assistant", (), tool_calls=calls),
                  Message("tool", (TextPart("sun"),), tool_call_id="call_1"))
        list(remote.submit(ChatRequest(follow, tools=(weather,))))
        sent = engine.requests[-1].messages
        assert sent[1].tool_calls == calls and (sent[2].role, sent[2].tool_call_id) == ("tool", "call_1")
        # a forced call reaches the backend as its tool_choice
        for forced in (ForcedCall(), ForcedCall("get_weather")):
            items = list(remote.submit(ChatRequest((Message.text("user", "Weather?"),), tools=(weather,),
                                                   forced_call=forced)))
            assert engine.requests[-1].forced_call == forced and items[-1].finish_reason == "tool_calls"
        assert remote._body(ChatRequest((Message.text("user", "Weather?"),), tools=(weather,),
                                        forced_call=ForcedCall("get_weather")))["tool_choice"] == \
            {"type": "function", "function": {"name": "get_weather"}}
        assert "tool_choice" not in remote._body(ChatRequest((Message.text("user", "Weather?"),), tools=(weather,)))


def test_streamed_tool_call_fragments_are_joined_by_index():
    from localchat.app.remote import _gather_tool_calls

    calls = {}
    for chunk in ([{"index": 0, "id": "a", "function": {"name": "f", "arguments": ""}}],
                  [{"index": 0, "function": {"arguments": '{"x": '}}], [{"index": 1, "id": "b", "function": {"name": "g"}}],
                  [{"index": 0, "function": {"arguments": "1}"}}]):
        _gather_tool_calls(calls, chunk)
    assert [(c["id"], c["name"], "".join(c["arguments"])) for _, c in sorted(calls.items())] == \
        [("a", "f", '{"x": 1}'), ("b", "g", "")]


def test_logprobs_are_asked_of_the_backend_and_its_entries_passed_on(server):
    from localchat.engine.runtime.request import TokenLogprob

    engine, url = server
    remote = RemoteEngine(url, api_key=KEY)
    items = list(remote.submit(ask("hi", logprobs=2)))
    assert engine.requests[-1].sampling.logprobs == 2
    deltas = [i for i in items if isinstance(i, Delta)]
    entries = [e for d in deltas for e in d.logprobs]
    assert len(entries) == items[-1].completion_tokens == 10
    assert "".join(e.token for e in entries) == "".join(d.reasoning + d.text for d in deltas)
    first = entries[0]
    assert first == TokenLogprob(None, "Let ", -0.25, tuple(b"Let "),
                                 (TokenLogprob(None, "alt0", -0.25, tuple(b"alt0")),
                                  TokenLogprob(None, "alt1", -0.5, tuple(b"alt1"))))
    list(remote.submit(ask("hi", logprobs=0)))
    assert engine.requests[-1].sampling.logprobs == 0
    assert "logprobs" not in remote._body(ask("hi")) and "top_logprobs" not in remote._body(ask("hi", logprobs=0))
    list(remote.submit(ask("hi")))
    assert engine.requests[-1].sampling.logprobs is None


def test_malformed_logprob_entries_from_a_backend_are_left_out():
    from localchat.app.remote import _token_logprobs

    got = _token_logprobs({"content": [{"token": "a", "logprob": -1, "bytes": [97], "top_logprobs": [{"token": 1}]},
                                       {"token": "b"}, "junk", {"token": "c", "logprob": -0.5, "bytes": None}]})
    assert [(e.token, e.logprob, e.bytes, e.top) for e in got] == [("a", -1.0, (97,), ()), ("c", -0.5, None, ())]
    assert _token_logprobs(None) == () and _token_logprobs({"content": None}) == ()
