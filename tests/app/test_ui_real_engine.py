"""The chat page over the real engine on the demo checkpoint (CPU): send text and two images,
stream the answer, stop one mid-answer, and find both turns in the history."""
import time

import pytest
from gradio_client import Client, handle_file

from demo_engine import DemoEngine, slow_steps, without_end_of_text
from live_server import LiveServer, png_bytes
from localchat.app.history import STOPPED
from localchat.app.ui import create_app


@pytest.fixture
def demo_engine(demo_runtime, monkeypatch):
    slow_steps(monkeypatch, demo_runtime, 0.1)  # so Stop lands mid-answer, even on a loaded machine
    without_end_of_text(monkeypatch, demo_runtime)  # and the answer cannot end first
    return DemoEngine(demo_runtime, max_tokens=48)


def _wait(job, timeout=60):
    t = time.time()
    while not job.done():
        assert time.time() - t < timeout, "generation did not finish"
        time.sleep(0.02)
    return job.outputs()


def test_page_streams_from_the_real_engine_and_stop_frees_the_pool(demo_engine, history, tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.jpg"
    a.write_bytes(png_bytes(64, 48, (200, 30, 30)))
    b.write_bytes(png_bytes(48, 64, (30, 30, 200), fmt="JPEG"))
    with LiveServer(create_app(demo_engine, history)) as srv:
        client = Client(srv.url, verbose=False)
        client.predict({"text": "what is this?", "files": [handle_file(str(a)), handle_file(str(b))]},
                       api_name="/send")
        outs = _wait(client.submit(api_name="/generate"))
        assert len(outs) > 3, "the answer should stream in several updates"
        final = outs[-1]
        assert final[-1]["role"] == "assistant"
        assert any("tok/s" in (m.get("metadata") or {}).get("title", "") for m in final), "status line missing"
        computed = demo_engine.counters()["computed_tokens"]
        assert computed > 0

        client.predict({"text": "and now a long answer please", "files": []}, api_name="/send")
        job = client.submit(api_name="/generate")
        while len(job.outputs()) < 3:
            assert not job.done(), "the second answer ended before Stop"
            time.sleep(0.01)
        client.predict(api_name="/stop")
        _wait(job)
        deadline = time.time() + 10
        while demo_engine.counters()["free_blocks"] != demo_engine.counters()["num_blocks"]:
            assert time.time() < deadline, "stopping the answer did not give its KV blocks back"
            time.sleep(0.05)
    (cid, _, _), = history.list()
    stored = history.get(cid).messages
    assert [m.role for m in stored][:4] == ["user", "assistant", "user", "assistant"]
    assert len(stored[0].images) == 2 and stored[1].text
    # The engine's own Final says "abort": it stopped the request, not just the page's loop.
    assert stored[3].status == STOPPED and stored[3].stats["finish_reason"] == "abort"
    assert stored[3].stats["completion_tokens"] < 48


def test_a_prompt_too_long_for_the_context_gets_a_message_with_the_limit(demo_checkpoint, history):
    from localchat.app.ui import build_ui
    from localchat.engine.runtime.engine import Engine

    engine = Engine(demo_checkpoint, device="cpu", name="demo", max_context=48)
    try:
        ctl = build_ui(engine, history).localchat_controller
        ctl.send({"text": "the quick brown fox " * 30, "files": []}, None, "", 0.7, 1.0, 0, 32, -1, True, "medium")
        cid = history.list()[0][0]
        chat = list(ctl.generate(True, cid))[-1]
    finally:
        engine.shutdown()
    shown = [m["content"] for m in chat if m["role"] == "assistant" and not m.get("metadata")]
    assert any("context holds 48" in c and "Error:" in c for c in shown), shown


def test_a_chat_past_the_context_goes_on_and_says_what_was_left_out(demo_checkpoint, history):
    from localchat.app.ui import build_ui
    from localchat.app.ui_render import status_line
    from localchat.engine.runtime.engine import Engine

    engine = Engine(demo_checkpoint, device="cpu", name="demo", max_context=256)
    sent = []
    submit = engine.submit
    engine.submit = lambda request: sent.append(request) or submit(request)
    try:
        ctl = build_ui(engine, history).localchat_controller
        cid = None
        for turn in range(12):
            ctl.send({"text": f"question {turn}: " + "tell me more about the sea and its boats " * 3, "files": []},
                     cid, "Answer briefly.", 0.0, 1.0, 0, 16, 1, False, "medium")
            cid = history.list()[0][0]
            for _ in ctl.generate(True, cid):
                pass
            answer = history.get(cid).messages[-1]
            assert answer.status != "error", answer.stats.get("error")
            if answer.stats.get("dropped_messages"):
                break
        else:
            pytest.fail("the chat never outgrew the 256-token context")
        assert sent[-1].overflow == "drop_oldest"
        dropped = answer.stats["dropped_messages"]
        summary, details = status_line(answer)
        assert f"{dropped} oldest messages left out" in summary and "system prompt stays" in details
        # the next turn starts from the same cut
        ctl.send({"text": "and the harbours?", "files": []}, cid, "Answer briefly.", 0.0, 1.0, 0, 16, 1, False,
                 "medium")
        for _ in ctl.generate(True, cid):
            pass
        assert sent[-1].dropped_hint == dropped
        assert history.get(cid).messages[-1].stats["dropped_messages"] >= dropped
    finally:
        engine.shutdown()
