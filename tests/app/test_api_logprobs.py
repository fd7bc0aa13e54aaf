"""`logprobs` / `top_logprobs` on /v1/chat/completions: OpenAI's shape through the official client,
streamed and not, over the fake engine and the real engine on the demo checkpoint; and the 400s."""
import httpx
import openai
import pytest

from demo_engine import DemoEngine
from fake_engine import FakeEngine
from live_server import LiveServer
from localchat.app.ui import create_app

QUESTION = [{"role": "user", "content": "hi"}]


@pytest.fixture
def fake(history):
    engine = FakeEngine(delay=0.001, filler_words=4)
    with LiveServer(create_app(engine, history)) as srv:
        yield engine, openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0), srv


def _streamed_entries(chunks) -> list[list]:
    """Each chunk's logprob entries (an empty list where the chunk carries none)."""
    return [list(c.choices[0].logprobs.content) if c.choices and c.choices[0].logprobs else [] for c in chunks]


def test_entries_in_openais_shape_plain_and_streamed(fake):
    engine, client, _ = fake
    r = client.chat.completions.create(model="fake-glm", messages=QUESTION, logprobs=True, top_logprobs=2)
    assert engine.requests[-1].sampling.logprobs == 2
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8 and choice.logprobs.refusal is None
    assert "".join(e.token for e in entries) == choice.message.model_extra["reasoning_content"] + choice.message.content
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2 for e in entries)
    assert [t.token for t in entries[0].top_logprobs] == ["alt0", "alt1"]
    assert entries[0].logprob == -0.25 and entries[-1].logprob == -0.75

    chunks = list(client.chat.completions.create(model="fake-glm", messages=QUESTION, logprobs=True,
                                                 top_logprobs=2, stream=True))
    per_chunk = _streamed_entries(chunks)
    assert [e.model_dump() for e in sum(per_chunk, [])] == [e.model_dump() for e in entries]
    for c, got in zip(chunks, per_chunk):  # each token's entry rides with its own text
        delta = c.choices[0].delta
        text = (delta.model_extra.get("reasoning_content") or "") + (delta.content or "")
        assert "".join(e.token for e in got) == text

    r = client.chat.completions.create(model="fake-glm", messages=QUESTION)
    assert r.choices[0].logprobs is None and engine.requests[-1].sampling.logprobs is None
    chunks = list(client.chat.completions.create(model="fake-glm", messages=QUESTION, stream=True))
    assert all(c.choices[0].logprobs is None for c in chunks)
    r = client.chat.completions.create(model="fake-glm", messages=QUESTION, logprobs=True)
    assert engine.requests[-1].sampling.logprobs == 0
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_malformed_fields_are_400s_naming_the_field(fake):
    engine, _, srv = fake
    cases = [({"logprobs": 1}, "logprobs", "'logprobs' must be true or false"),
             ({"logprobs": "true"}, "logprobs", "'logprobs' must be true or false"),
             ({"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
             ({"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs 'logprobs': true"),
             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20"),
             ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "from 0 to 20"),
             ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "an integer"),
             ({"logprobs": True, "top_logprobs": True}, "top_logprobs", "an integer")]
    for fields, param, message in cases:
        r = httpx.post(srv.url + "v1/chat/completions", json={"messages": QUESTION, **fields})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and message in err["message"], (fields, err)
    assert engine.requests == []
    for fields in ({"logprobs": False}, {"logprobs": None, "top_logprobs": None}, {"logprobs": True, "top_logprobs": 20}):
        r = httpx.post(srv.url + "v1/chat/completions", json={"messages": QUESTION, **fields})
        assert r.status_code == 200, r.text


@pytest.fixture
def demo(demo_runtime, history):
    engine = DemoEngine(demo_runtime, max_tokens=40)
    with LiveServer(create_app(engine, history)) as srv:
        yield openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)


def test_the_real_engine_lists_every_generated_token(demo):
    greedy = dict(model="demo", messages=QUESTION, temperature=0, logprobs=True, top_logprobs=3)
    r = demo.chat.completions.create(**greedy, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    choice = r.choices[0]
    entries = choice.logprobs.content
    assert choice.finish_reason == "stop" and len(entries) == r.usage.completion_tokens > 3
    # the text of every token but the last, which is the end-of-turn token
    assert "".join(e.token for e in entries[:-1]) == choice.message.content
    assert entries[-1].token == "<|endoftext|>"
    for e in entries:  # greedy: each token is its position's most likely
        assert [t.token for t in e.top_logprobs][0] == e.token and e.logprob == e.top_logprobs[0].logprob
        assert e.logprob <= 0 and [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
        assert bytes(e.bytes).decode() == e.token

    chunks = list(demo.chat.completions.create(**greedy, stream=True,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    per_chunk = _streamed_entries(chunks)
    assert [e.model_dump() for e in sum(per_chunk, [])] == [e.model_dump() for e in entries]
    for c, got in zip(chunks, per_chunk):
        if c.choices and c.choices[0].delta.content:
            assert "".join(e.token for e in got) == c.choices[0].delta.content
    assert [e.token for e in per_chunk[-1]] == ["<|endoftext|>"] and chunks[-1].choices[0].finish_reason == "stop"

    # with thinking on, the markup tokens around the reasoning are listed too
    r = demo.chat.completions.create(**greedy)
    message, entries = r.choices[0].message, r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == \
        f"<think>{message.model_extra['reasoning_content']}</think>{message.content}<|endoftext|>"


def test_logit_bias_shifts_the_real_engines_choice(demo_runtime, history):
    from localchat.app.remote import RemoteEngine
    from localchat.engine.runtime.request import ChatRequest, Message, SamplingParams

    token = demo_runtime.formatter.tokenizer.convert_tokens_to_ids("x")
    question = [{"role": "user", "content": "Say something."}]
    with LiveServer(create_app(DemoEngine(demo_runtime, max_tokens=50), history)) as srv:
        client = openai.OpenAI(base_url=srv.url + "v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="demo", messages=question, max_tokens=4, temperature=0,
                                           logit_bias={str(token): 100}, logprobs=True,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.choices[0].message.content == "xxxx"
        assert [e.token for e in r.choices[0].logprobs.content] == ["x"] * 4
        # banned, it never comes, sampled or not
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
            r = client.chat.completions.create(model="demo", messages=question, max_tokens=12, logprobs=True,
                                               logit_bias={str(token): -100}, **sampling)
            assert "x" not in [e.token for e in r.choices[0].logprobs.content]
        for bias, phrase in (({"x": 1}, "maps token ids to biases"), ({str(token): 101}, "from -100 to 100"),
                             ({"123456789": 5}, "token ids run from 0 to")):
            err = httpx.post(srv.url + "v1/chat/completions", json={"messages": question, "logit_bias": bias}).json()
            assert err["error"]["param"] == "logit_bias" and phrase in err["error"]["message"], err
        # a localchat behind --backend gets it passed on
        request = ChatRequest((Message.text("user", "Say something."),),
                              SamplingParams(max_tokens=3, temperature=0, logit_bias=((token, 100.0),)))
        remote = RemoteEngine(srv.url + "v1")
        assert remote._body(request)["logit_bias"] == {str(token): 100.0}
        final = list(remote.submit(request))[-1]
        assert final.finish_reason == "length"
