"""The startup page: progress while a model downloads and loads, 503 for /health and /v1 meanwhile,
the failure shown where a browser watches, and the socket handed to the chat page's server."""
import socket
import threading
import time
import types

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from live_server import free_port

from localchat.app.startup import StartupServer, StartupStatus, create_startup_app
from localchat.app.ui import bind_listener, page_url
from localchat.engine.hub import DownloadProgress
from localchat.engine.hub_errors import AccessDenied


def _progress(done: int, total: int, files_done: int = 0) -> DownloadProgress:
    return DownloadProgress(file="model-00002-of-00009.safetensors", done=done, total=total, overall_done=done,
                            overall_total=total, files_done=files_done, files_total=9)


def test_the_page_says_how_far_the_start_got_and_the_api_says_not_ready():
    status = StartupStatus("<b>gpt-oss-20b</b>")
    client = TestClient(create_startup_app(status))

    page = client.get("/")
    assert page.status_code == 200 and "&lt;b&gt;gpt-oss-20b&lt;/b&gt;" in page.text and "<b>gpt" not in page.text
    status.download(_progress(3 * 1024 ** 3, 12 * 1024 ** 3, files_done=1))
    state = client.get("/startup").json()
    assert state["stage"] == "download" and state["fraction"] == pytest.approx(0.25)
    assert "3.0 of 12.0 GiB" in state["detail"] and "file 2 of 9" in state["detail"]

    status.load(600, 1000, "/cache/snapshots/abc/model-00004-of-00009.safetensors")
    state = client.get("/startup").json()
    assert (state["stage"], state["fraction"], state["detail"]) == ("load", 0.6, "model-00004-of-00009.safetensors")

    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "loading" and health.headers["retry-after"]
    chat = client.post("/v1/chat/completions", json={"model": "x", "messages": []})
    assert chat.status_code == 503 and chat.headers["retry-after"]
    assert chat.json()["error"]["code"] == "model_loading" and "still loading" in chat.json()["error"]["message"]
    assert client.get("/v1/models").status_code == 503

    status.warmup()
    assert client.get("/startup").json()["fraction"] is None  # a step of unknown length
    status.failed("the GPU is out of memory: pass --max-context 16384")
    assert client.get("/health").json()["status"] == "failed"
    assert "--max-context 16384" in client.post("/v1/chat/completions", json={}).json()["error"]["message"]
    assert client.get("/startup").json()["error"] == "the GPU is out of memory: pass --max-context 16384"


def test_the_api_wants_its_key_while_loading_too():
    client = TestClient(create_startup_app(StartupStatus("m"), api_key="sk-1"))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-1"}).status_code == 503


def test_a_page_other_machines_reach_does_not_show_the_reason():
    status = StartupStatus("m", show_errors=False)
    status.failed("cannot read /home/alice/.cache/huggingface/hub/models--x/model.safetensors")
    assert "alice" not in TestClient(create_startup_app(status)).get("/startup").text


def test_a_failure_waits_only_for_a_page_that_is_watching():
    status = StartupStatus("m")
    status.failed("boom")
    start = time.monotonic()
    status.wait_for_watchers(grace_s=2)
    assert time.monotonic() - start < 0.2  # nobody polled: no delay

    status = StartupStatus("m")
    status.state(polled=True)  # a page is open
    status.failed("boom")
    threading.Timer(0.3, status.state, kwargs={"polled": True}).start()
    start = time.monotonic()
    status.wait_for_watchers(grace_s=5)
    assert 0.25 < time.monotonic() - start < 2  # until the page had the error, not the whole grace

    status = StartupStatus("m")
    status.state(polled=True)
    status.failed("boom")
    start = time.monotonic()
    status.wait_for_watchers(grace_s=0.4)  # the page went away: the grace, then on
    assert 0.35 < time.monotonic() - start < 2


def test_a_browser_asking_before_the_server_runs_waits_instead_of_being_refused():
    # the page is opened as soon as the address is known; the server's thread may not have started
    sock = bind_listener("127.0.0.1", 0)
    try:
        early = socket.create_connection(sock.getsockname(), timeout=5)
        early.close()
    finally:
        sock.close()


def test_the_socket_goes_from_the_startup_page_to_the_chat_page():
    import fastapi
    import uvicorn

    sock = bind_listener("127.0.0.1", 0)
    url = page_url("127.0.0.1", sock).rstrip("/")
    status = StartupStatus("m")
    page = StartupServer(status, sock).start()
    try:
        assert _get(url + "/startup").json()["stage"] == "starting"
    finally:
        page.stop()
    # between the two servers a connection waits in the original socket's backlog
    early = socket.create_connection(sock.getsockname(), timeout=5)
    early.close()

    chat = fastapi.FastAPI()
    chat.add_api_route("/", lambda: {"page": "chat"})
    server = uvicorn.Server(uvicorn.Config(chat, log_level="warning", timeout_graceful_shutdown=0.2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert _get(url + "/").json() == {"page": "chat"}
        assert _get(url + "/startup").status_code == 404  # what tells the page to reload
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _get(url: str, deadline_s: float = 10) -> httpx.Response:
    end = time.monotonic() + deadline_s
    while True:
        try:
            return httpx.get(url, timeout=2)
        except httpx.TransportError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


def _serve_in_thread(monkeypatch, argv, local_checkpoint, engine):
    """Runs cli.main(argv) in a thread with the download and the load replaced; returns the thread,
    what serve() received and main's exit code (filled in when the thread ends)."""
    from localchat.app import cli, ui

    seen, result = {}, {}
    monkeypatch.setattr(cli, "_local_checkpoint", local_checkpoint)
    monkeypatch.setattr(cli, "_load_engine", lambda args, model_dir, on_load=None: engine(on_load))
    monkeypatch.setattr(ui, "serve", lambda engine, **kw: seen.update(engine=engine, **kw))
    monkeypatch.setattr("webbrowser.open", lambda url: seen.setdefault("browser", url))
    thread = threading.Thread(target=lambda: result.update(rc=cli.main(argv)), daemon=True)
    thread.start()
    return thread, seen, result


def test_localchat_shows_the_progress_then_serves_the_chat_on_the_same_socket(monkeypatch, tmp_path):
    port = free_port()
    downloading, loading, finish = threading.Event(), threading.Event(), threading.Event()

    def local_checkpoint(args, on_download=None):
        on_download(_progress(5, 10))
        downloading.set()
        finish.wait(10)
        return tmp_path

    def engine(on_load):
        on_load(1, 4, str(tmp_path / "model.safetensors"))
        loading.set()
        return types.SimpleNamespace(device=torch.device("cpu"))

    thread, seen, result = _serve_in_thread(monkeypatch, ["--model", "some/model", "--port", str(port)],
                                            local_checkpoint, engine)
    url = f"http://127.0.0.1:{port}/"
    assert downloading.wait(20)
    assert seen["browser"] == url  # opened on the progress page, not later
    page = _get(url)
    assert page.status_code == 200 and "some/model" in page.text
    assert _get(url + "startup").json()["fraction"] == 0.5
    assert _get(url + "health").status_code == 503
    finish.set()
    thread.join(20)
    assert loading.is_set() and result["rc"] == 0
    assert seen["open_browser"] is False and seen["sock"].getsockname()[1] == port
    seen["sock"].close()


def test_a_failed_start_is_shown_on_the_page_and_in_the_exit_code(monkeypatch, capsys):
    port = free_port()
    polled = threading.Event()

    def local_checkpoint(args, on_download=None):
        polled.wait(10)  # the page is open before the download fails
        raise AccessDenied("some/model is gated: accept its license on huggingface.co, then `hf auth login`")

    thread, seen, result = _serve_in_thread(monkeypatch, ["--model", "some/model", "--port", str(port),
                                                          "--no-browser"], local_checkpoint, None)
    url = f"http://127.0.0.1:{port}/startup"
    assert _get(url).json()["stage"] in ("starting", "load")
    polled.set()
    errors = []
    while not errors and thread.is_alive():  # as the page's script polls
        try:
            state = httpx.get(url, timeout=2).json()
        except httpx.TransportError:
            break
        if state["stage"] == "failed":
            errors.append(state["error"])
        time.sleep(0.1)
    thread.join(20)
    assert errors and "hf auth login" in errors[0]
    assert result["rc"] == 1 and "browser" not in seen and "engine" not in seen
    assert "hf auth login" in capsys.readouterr().err


def test_localchat_serves_the_demo_from_its_own_process(tmp_path):
    # the real command: the startup page first, then the chat page and the API on the same port,
    # and Ctrl+C (SIGINT) ends it cleanly
    import os
    import shutil
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = shutil.which("localchat", path=str(Path(sys.executable).parent)) or shutil.which("localchat")
    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), XDG_DATA_HOME=str(tmp_path / "data"),
               HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.Popen([script, "--model", "demo", "--port", str(port), "--no-browser", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        seen = set()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                health = httpx.get(url + "health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.add(health.status_code)
            if health.status_code == 200:
                break
            time.sleep(0.02)
        assert 200 in seen, "the chat page never came up"
        answer = httpx.post(url + "v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
        assert answer["choices"][0]["finish_reason"] in ("stop", "length")
        assert httpx.get(url + "startup", timeout=5).status_code == 404  # the startup page is gone
        assert httpx.get(url, timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode in (0, 130), err
    assert "Traceback" not in err and f"page {url}" in err + out


def test_a_ctrl_c_that_python_dropped_still_stops_localchat(monkeypatch):
    # a KeyboardInterrupt raised inside a finalizer is printed and dropped by Python; the Ctrl+C
    # must still stop localchat instead of starting the chat page
    import os
    import signal

    from localchat.app import cli, ui

    def swallowed_interrupt(args, sock, url):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here
        except KeyboardInterrupt:
            pass  # what a finalizer does with it
        return types.SimpleNamespace(device=torch.device("cpu"))

    seen = {}
    monkeypatch.setattr(cli, "_start_behind_page", swallowed_interrupt)
    monkeypatch.setattr(ui, "serve", lambda engine, **kw: seen.update(stopped=kw["stop_requested"]()))
    assert cli.main(["--model", "some/model", "--port", str(free_port()), "--no-browser"]) == 130
    assert seen["stopped"] is True
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
