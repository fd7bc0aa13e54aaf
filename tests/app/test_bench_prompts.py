"""The benchmark's synthetic prompts: fresh ids per request, and a shared history where asked."""
from localchat.app.bench import spec_for
from localchat.app.bench_prompts import SyntheticPrompts
from localchat.engine.runtime.request import ChatRequest, Message, SamplingParams, TextPart


def request(*texts: str) -> ChatRequest:
    return ChatRequest((Message("user", tuple(TextPart(t) for t in texts)),), SamplingParams(max_tokens=1))


def test_history_is_shared_and_turns_are_new():
    prompts = SyntheticPrompts(spec_for("gpt-oss-20b", 1), 8)
    a, b = (prompts.build(request("history:40:3", "tokens:5")).input_ids for _ in range(2))
    other = prompts.build(request("history:40:4", "tokens:5")).input_ids
    assert len(a) == len(b) == 45 and a[:40] == b[:40] and a[40:] != b[40:]
    assert other[:40] != a[:40]
    assert len(prompts.build(request("anything")).input_ids) == 8
