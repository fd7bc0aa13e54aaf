"""The chat page over the real engine on the demo checkpoint (CPU): send text and two images,
stream the answer, stop one mid-answer, and find both turns in the history."""
import dataclasses
import time

import pytest
from gradio_client import Client, handle_file

from live_server import LiveServer, png_bytes
from localchat.app.demo import ensure_demo
from localchat.app.ui import create_app
from localchat.engine.runtime.engine import Engine


class ShortAnswers:
    """The real engine, with every answer capped at a few tokens so the test stays short."""

    def __init__(self, engine: Engine, max_tokens: int):
        self.engine, self.max_tokens = engine, max_tokens

    def info(self):
        return self.engine.info()

    def counters(self):
        return self.engine.counters()

    def submit(self, request):
        sampling = dataclasses.replace(request.sampling, max_tokens=min(request.sampling.max_tokens, self.max_tokens))
        return self.engine.submit(dataclasses.replace(request, sampling=sampling))


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    engine = Engine(ensure_demo(tmp_path_factory.mktemp("demo")), device="cpu")
    yield ShortAnswers(engine, max_tokens=48)
    engine.shutdown()


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
        time.sleep(0.2)
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
