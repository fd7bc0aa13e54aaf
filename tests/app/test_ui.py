"""The chat page through gradio_client against a live server (uvicorn, as `serve` runs it)."""
import time

import pytest
from gradio_client import Client, handle_file

from live_server import LiveServer, png_bytes
from fake_engine import FakeEngine
from localchat.app.history import STOPPED, ChatSettings
from localchat.app.ui import build_ui, create_app, is_loopback, serve
from localchat.app.ui_images import ImageLimits
from localchat.engine.runtime.request import ImagePart
from localchat.engine.spec import SamplingDefaults


def _text(msg: dict) -> str:
    return " ".join(c.get("text", "") for c in msg["content"] if c.get("type") == "text")


def _wait(job, timeout=20):
    t = time.time()
    while not job.done():
        assert time.time() - t < timeout, "generation did not finish"
        time.sleep(0.02)
    return job.outputs()


@pytest.fixture
def images(tmp_path):
    a, b = tmp_path / "red.png", tmp_path / "blue.jpg"
    a.write_bytes(png_bytes(40, 30, (220, 20, 20)))
    b.write_bytes(png_bytes(30, 40, (20, 20, 220), fmt="JPEG"))
    return str(a), str(b)


@pytest.fixture
def live(history):
    engine = FakeEngine(delay=0.005, filler_words=10)
    with LiveServer(create_app(engine, history, limits=ImageLimits(max_images=3, max_bytes=200_000))) as srv:
        yield engine, history, Client(srv.url, verbose=False), srv


def test_send_text_and_two_images_streams_answer(live, images):
    engine, history, client, _ = live
    engine.delay = 0.025  # the answer spans several of the page's update frames (ui_frames.py)
    chat, _, conv_list = client.predict({"text": "what is this?", "files": [handle_file(p) for p in images]},
                                        api_name="/send")
    assert [c["type"] for c in chat[0]["content"]] == ["file", "file", "text"]
    outs = _wait(client.submit(api_name="/generate"))
    assert len(outs) > 4, "the answer should arrive in several streamed updates"
    lengths = [len(_text(o[-1])) for o in outs[:-1] if o[-1]["role"] == "assistant"]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]
    final = outs[-1]
    thinking = [m for m in final if (m.get("metadata") or {}).get("title") == "Thinking"]
    assert thinking and "Let me look." in _text(thinking[0])
    assert any("Seen 2 image(s). You said: what is this? w0" in _text(m) for m in final)
    assert any("tok/s" in (m.get("metadata") or {}).get("title", "") for m in final), "status line missing"
    req = engine.requests[-1]
    assert sum(isinstance(p, ImagePart) for p in req.messages[-1].content) == 2
    assert req.thinking is True
    (cid, title, _), = history.list()
    assert title == "what is this?" and conv_list["value"] == cid
    conv = history.get(cid)
    assert [m.role for m in conv.messages] == ["user", "assistant"] and len(conv.messages[0].images) == 2
    assert conv.messages[1].reasoning.strip() == "Let me look." and conv.messages[1].status == "done"


def test_a_fast_answer_reaches_the_page_in_frames_not_one_update_a_token(live):
    engine, history, client, _ = live
    engine.delay, engine.filler_words = 0.0005, 600  # ~2000 tokens a second
    client.predict({"text": "go", "files": []}, api_name="/send")
    outs = _wait(client.submit(api_name="/generate"))
    assert len(outs) < 60, f"{len(outs)} updates for 600 tokens"
    assert any(" w599" in _text(m) for m in outs[-1])
    answer = history.get(history.list()[0][0]).messages[-1]
    assert answer.text.count(" w") == 600 and answer.status == "done"


def test_stop_mid_answer_closes_engine_stream(live):
    engine, history, client, _ = live
    engine.delay, engine.filler_words = 0.05, 400
    client.predict({"text": "long please", "files": []}, api_name="/send")
    job = client.submit(api_name="/generate")
    t = time.time()
    while not job.outputs() or " w1" not in _text(job.outputs()[-1][-1]):
        assert time.time() - t < 20
        time.sleep(0.02)
    client.predict(api_name="/stop")
    _wait(job, timeout=5)
    stream = engine.streams[-1]
    assert stream in engine.closed and stream.finish_reason == "abort"
    answer = history.get(history.list()[0][0]).messages[-1]
    assert answer.status == STOPPED and 0 < answer.text.count(" w") < 400
    assert time.time() - t < 10


def test_retry_and_edit_continue_from_there(live):
    engine, history, client, _ = live
    client.predict({"text": "first", "files": []}, api_name="/send")
    _wait(client.submit(api_name="/generate"))
    client.predict({"text": "second", "files": []}, api_name="/send")
    outs = _wait(client.submit(api_name="/generate"))
    answer_index = max(i for i, m in enumerate(outs[-1]) if "You said: second" in _text(m))
    client.predict(answer_index, api_name="/retry")
    _wait(client.submit(api_name="/generate"))
    cid = history.list()[0][0]
    assert [m.text[:4] for m in history.get(cid).messages] == ["firs", "Seen", "seco", "Seen"]
    assert [m.role for m in engine.requests[-1].messages] == ["user", "assistant", "user"]
    client.predict(0, "changed question", api_name="/edit")
    final = _wait(client.submit(api_name="/generate"))[-1]
    msgs = history.get(cid).messages
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[0].text == "changed question"
    assert "You said: changed question" in msgs[1].text
    assert any("You said: changed question" in _text(m) for m in final)
    assert len(engine.requests[-1].messages) == 1


def test_bad_inputs_get_a_message_and_store_nothing(live, tmp_path, images):
    engine, history, client, _ = live
    notimg = tmp_path / "notes.png"
    notimg.write_bytes(b"this is text, not a picture")
    chat, _, _ = client.predict({"text": "x", "files": [handle_file(str(notimg))]}, api_name="/send")
    assert "not an image" in _text(chat[-1])
    # Plain words, not an emoji that renders as a box where no emoji font is installed.
    assert _text(chat[-1]).startswith("**Image not accepted:**")
    chat, _, _ = client.predict({"text": "x", "files": [handle_file(images[0])] * 4}, api_name="/send")
    assert "limit is 3 per message" in _text(chat[-1])
    big = tmp_path / "big.png"
    big.write_bytes(png_bytes(1200, 1200, (1, 2, 3)) + b"\0" * 250_000)
    chat, _, _ = client.predict({"text": "x", "files": [handle_file(str(big))]}, api_name="/send")
    assert "limit is 0 MB" not in _text(chat[-1]) and "MB per image" in _text(chat[-1])
    client.predict({"text": "   ", "files": []}, api_name="/send")
    _wait(client.submit(api_name="/generate"))
    assert history.list() == [] and engine.requests == []


def test_large_image_is_downscaled_with_a_note(history, tmp_path):
    engine = FakeEngine(delay=0.0, filler_words=1)
    with LiveServer(create_app(engine, history, limits=ImageLimits(target_pixels=100 * 100))) as srv:
        client = Client(srv.url, verbose=False)
        p = tmp_path / "wide.png"
        p.write_bytes(png_bytes(400, 200))
        chat, _, _ = client.predict({"text": "look", "files": [handle_file(str(p))]}, api_name="/send")
        assert any("400×200; downscaled to 141×70" in _text(m) for m in chat)
        _wait(client.submit(api_name="/generate"))
    assert engine.requests[0].messages[-1].content[0].image.size == (141, 70)


def test_two_tabs_stream_at_once_and_sidebar_actions(live):
    engine, history, client, srv = live
    engine.delay, engine.filler_words = 0.02, 30
    other = Client(srv.url, verbose=False)
    client.predict({"text": "tab one", "files": []}, api_name="/send")
    other.predict({"text": "tab two", "files": []}, api_name="/send")
    t = time.time()
    jobs = [client.submit(api_name="/generate"), other.submit(api_name="/generate")]
    for j in jobs:
        _wait(j)
    assert time.time() - t < 1.6 * 33 * 0.02 + 1.0, "the two answers should stream concurrently"
    titles = {title: cid for cid, title, _ in history.list()}
    assert set(titles) == {"tab one", "tab two"}
    found = client.predict("TAB T", api_name="/search")
    assert {c[0] for c in found["choices"]} == {"tab two"}
    assert [c[0] for c in client.predict("said: tab two", api_name="/search")["choices"]] == ["tab two"]
    chat, title, system, temperature, *_ = client.predict(titles["tab two"], api_name="/open")
    assert title == "tab two" and temperature == 0.7 and any("You said: tab two" in _text(m) for m in chat)
    client.predict("Renamed", "", api_name="/rename")
    assert history.get(titles["tab two"]).title == "Renamed"
    path = client.predict(api_name="/export_markdown")
    assert open(path).read().startswith("# Renamed")
    client.predict("", api_name="/delete")
    assert [t for _, t, _ in history.list()] == ["tab one"]


def test_generator_closed_by_browser_disconnect_aborts_engine(history):
    engine = FakeEngine(delay=0.01, filler_words=100)
    demo = build_ui(engine, history)
    ctl = demo.localchat_controller
    ctl.send({"text": "hi", "files": []}, None, "", 0.7, 1.0, 0, 64, -1, True, "medium")
    cid = history.list()[0][0]
    gen = ctl.generate(True, cid)
    next(gen), next(gen)
    gen.close()  # what gradio does to a running generator when its event is cancelled
    assert engine.streams[-1] in engine.closed
    assert history.get(cid).messages[-1].status == STOPPED


def test_a_new_chat_starts_from_the_models_recommended_sampling(history):
    recommended = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    ctl = build_ui(FakeEngine(sampling=recommended), history).localchat_controller
    settings = ["", 0.6, 0.95, 20, ChatSettings().max_tokens, -1, True, "medium"]
    assert ctl.new_chat()[4:] == settings and ctl.open(None)[3:] == settings
    # a stored chat keeps its own settings; a model that recommends nothing gets localchat's defaults
    ctl.send({"text": "hi", "files": []}, None, "", 1.3, 0.5, 0, 64, -1, True, "medium")
    cid = history.list()[0][0]
    assert ctl.open(cid)[4:7] == [1.3, 0.5, 0]
    plain = build_ui(FakeEngine(), history).localchat_controller
    assert plain.new_chat()[4:] == plain.settings_values(ChatSettings())
    # the answer budget stays within the context (the slider's range)
    short = build_ui(FakeEngine(context_length=4096), history).localchat_controller
    assert ChatSettings().max_tokens > 4096 and short.defaults.max_tokens == 4096


def test_non_loopback_needs_auth_and_key(engine, history):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0")
    with pytest.raises(ValueError, match="--auth"):
        serve(engine, history=history, host="0.0.0.0", open_browser=False)
    with pytest.raises(ValueError, match="--api-key"):
        serve(engine, history=history, host="192.168.1.5", auth=("u", "p"), open_browser=False)


def test_model_panel_shows_the_engines_placement_and_memory():
    from localchat.app.ui_render import model_markdown
    from localchat.engine.runtime.request import ModelInfo

    one = model_markdown(ModelInfo("demo", "glm4v_moe", 8192, True, "thinking", "cpu", 1_556_672,
                                   kv_cache_bytes=25_165_824, kv_cache_tokens=16384))
    assert "placement: cpu" in one and "1.6 MB" in one and "8,192 tokens" in one
    assert "KV cache: 25.2 MB, holds 16,384 tokens" in one and "sliding" not in one
    oss = model_markdown(ModelInfo("gpt-oss-20b", "gpt_oss", 131072, False, "effort", "cuda:0", 13_000_000_000,
                                   kv_cache_bytes=25_165_824, kv_cache_tokens=16384, kv_window_tokens=2048))
    assert "holds 16,384 tokens over all chats (sliding-window layers: 2,048 recent tokens)" in oss
    split = model_markdown(ModelInfo("glm-4.5v-fp8", "glm4v_moe", 65536, True, "thinking",
                                     "cuda:0 layers 0-22; cuda:1 layers 23-45", 108_000_000_000,
                                     weights_format="FP8, channel scales; bf16 elsewhere"))
    assert "\n- cuda:0 layers 0-22\n- cuda:1 layers 23-45" in split
    assert "weights in memory: 108.0 GB (FP8, channel scales; bf16 elsewhere)" in split
    # Unknown memory (a remote backend) is left out, not shown as 0 or "unknown".
    remote = model_markdown(ModelInfo("glm", "remote", 32768, True, "thinking", "remote (gpu-box:8000)"))
    assert "weights" not in remote and "KV cache" not in remote and "placement: remote (gpu-box:8000)" in remote


def test_engine_reports_its_kv_cache(demo_runtime):
    info = demo_runtime.info()
    cache = demo_runtime.cache
    assert info.kv_cache_bytes == 2 * cache.k.numel() * cache.k.element_size() > 0
    assert info.kv_cache_tokens == demo_runtime.pool.num_blocks * demo_runtime.block_size >= info.context_length


def test_an_exported_chat_imports_from_the_sidebar(live, tmp_path):
    engine, history, client, _ = live
    client.predict({"text": "first question", "files": []}, api_name="/send")
    _wait(client.submit(api_name="/generate"))
    (cid, _, _), = history.list()
    exported = tmp_path / "chat.json"
    exported.write_text(history.export_json(cid))
    chatbot, title, chats, *_ = client.predict(handle_file(str(exported)), "", api_name="/import_chat")
    assert title == "first question" and len(history.list()) == 2
    assert chats["value"] != cid and chats["value"] in {c for _, c in chats["choices"]}  # opened, and listed
    from localchat.app.ui_render import render
    shown = render(history.get(cid).messages, history)[0]  # the original chat as the page shows it
    assert [m["role"] for m in chatbot] == [m["role"] for m in shown] and _text(chatbot[0]) == "first question"
    assert any("You said: first question" in _text(m) for m in chatbot[1:])
    bad = tmp_path / "other.json"
    bad.write_text('{"hello": 1}')
    client.predict(handle_file(str(bad)), "", api_name="/import_chat")
    assert len(history.list()) == 2
