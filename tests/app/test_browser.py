"""End to end in headless Chromium (Debian `chromium` package) driven by Playwright.

With the real engine on the demo model: attach one image and paste another, send, watch the
answer stream, open the thinking panel, stop a second answer with Esc, reload, reopen the chat
from the sidebar, and take the README screenshot (LOCALCHAT_SCREENSHOT=assets/screenshot.png
writes it there). With a scripted engine: code highlighting, LaTeX and Ctrl+Shift+O, which the
demo model's answers cannot show.
"""
import base64
import os
import shutil
import time
from pathlib import Path

import pytest

from demo_engine import DemoEngine, slow_steps
from fake_engine import FakeEngine
from live_server import LiveServer
from localchat.app.demo import DEMO_NOTE
from localchat.app.history import STOPPED
from localchat.app.ui import ASSETS, bind_listener, create_app, page_url

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y --no-install-recommends chromium"),
    pytest.mark.skipif(sync_playwright is None, reason="needs Playwright: pip install playwright"),
]

EXTRA = "\n\n```python\nprint(sum(range(10)))\n```\n\nThe area is $A = \\pi r^2$."


def _chat_text(page) -> str:
    return page.evaluate("() => document.querySelector('#lc-chat').innerText")


def _wait_text(page, needle: str, timeout: float = 20.0) -> str:
    t = time.time()
    while needle not in (text := _chat_text(page)):
        assert time.time() - t < timeout, f"{needle!r} never appeared; chat shows {text[:300]!r}"
        time.sleep(0.05)
    return text


def _launch(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])


PASTE_JS = """([name, b64]) => {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, {type: 'image/png'}));
  const box = document.querySelector('#lc-input textarea');
  box.dispatchEvent(new ClipboardEvent('paste', {clipboardData: data, bubbles: true, cancelable: true}));
}"""
# What a file dragged from the desktop and dropped on the message box delivers.
DROP_JS = """([name, b64]) => {
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], name, {type: 'image/png'}));
  const box = document.querySelector('#lc-input textarea');
  for (const type of ['dragenter', 'dragover', 'drop'])
    box.dispatchEvent(new DragEvent(type, {dataTransfer: data, bubbles: true, cancelable: true}));
}"""


def _b64(name: str) -> str:
    return base64.b64encode((ASSETS / "examples" / name).read_bytes()).decode()


def test_browser_real_demo_engine(demo_runtime, monkeypatch, history, tmp_path):
    slow_steps(monkeypatch, demo_runtime, 0.03)  # a person's view: the answer grows over a second or two
    engine = DemoEngine(demo_runtime, max_tokens=64)
    app = create_app(engine, history, demo_note=DEMO_NOTE)
    with LiveServer(app) as srv, sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1280})
            page.goto(srv.url)
            page.wait_for_selector("#lc-input textarea", timeout=30_000)
            assert "Demo model" in page.locator("#lc-demo-note").inner_text()
            page.locator("#lc-input input[type=file]").set_input_files(str(ASSETS / "examples" / "bar_chart.png"))
            page.wait_for_selector("#lc-input img", timeout=10_000)
            page.evaluate(PASTE_JS, ["smiley.png", _b64("smiley.png")])
            t = time.time()
            while page.locator("#lc-input img").count() < 2:
                assert time.time() - t < 10, "pasting an image should attach it"
                time.sleep(0.05)
            page.locator("#lc-input textarea").fill("Which quarter sold most, and what is the face doing?")
            # Watch the chat from inside the page: every change of its text is recorded.
            page.evaluate("""() => { window.lcTexts = [];
                new MutationObserver(() => window.lcTexts.push(document.querySelector('#lc-chat').innerText))
                  .observe(document.querySelector('#lc-chat'), {subtree: true, childList: true, characterData: true}); }""")
            page.locator("#lc-input textarea").press("Enter")
            _wait_text(page, "tok/s", timeout=60)
            grown = {len(x) for x in page.evaluate("window.lcTexts") if "tok/s" not in x}
            assert len(grown) >= 5, "the answer should appear piece by piece"
            req = engine.requests[0]
            assert sum(type(c).__name__ == "ImagePart" for c in req.messages[-1].content) == 2 and req.thinking
            (cid, _, _), = history.list()
            answer = history.get(cid).messages[-1]
            assert answer.reasoning.strip() and answer.text.strip(), "the demo thinks, then answers"
            page.get_by_text("Thinking").first.click()
            page.get_by_text(answer.reasoning.strip()[:20]).first.wait_for(state="visible", timeout=10_000)
            # Gradio's per-image "Share" uploads to huggingface.co; the page hides it.
            assert page.locator("#lc-chat img").count() >= 2
            assert not any(b.is_visible() for b in page.locator('#lc-chat button[aria-label="Share"]').all())

            # Esc stops an answer inside the engine (in a new chat, so the first stays one clean turn).
            page.get_by_role("button", name="New chat").click()
            t = time.time()
            while "Which quarter" in _chat_text(page):
                assert time.time() - t < 5
                time.sleep(0.05)
            page.locator("#lc-input textarea").fill("Tell me more.")
            page.locator("#lc-input textarea").press("Enter")
            t = time.time()
            while len(engine.streams) < 2:
                assert time.time() - t < 10
                time.sleep(0.02)
            page.keyboard.press("Escape")
            _wait_text(page, "stopped", timeout=30)
            (stop_cid, _, _), _ = history.list()
            stopped = history.get(stop_cid).messages[-1]
            assert stopped.status == STOPPED and stopped.stats.get("finish_reason") == "abort"

            page.reload()
            page.wait_for_selector("#lc-chats label", timeout=30_000)
            assert page.locator("#lc-chats label").count() == 2
            page.locator("#lc-chats label", has_text="Which quarter sold most").click()
            _wait_text(page, answer.text.strip()[:20])
            page.wait_for_selector("#lc-chat img", timeout=10_000)
            page.get_by_text("Thinking").first.click()
            page.get_by_text(answer.reasoning.strip()[:20]).first.wait_for(state="visible", timeout=10_000)
            page.get_by_text("Model", exact=True).click()  # the model panel, open in the screenshot
            time.sleep(0.5)  # let the panel's open animation finish before the screenshot
            shot = Path(os.environ.get("LOCALCHAT_SCREENSHOT", tmp_path / "screenshot.png"))
            page.screenshot(path=str(shot))
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()


def test_browser_markdown_and_new_chat_shortcut(history, tmp_path):
    engine = FakeEngine(delay=0.04, filler_words=40, extra_markdown=EXTRA,
                        thinking_words=("The", "chart", "has", "four", "bars."))
    with LiveServer(create_app(engine, history)) as srv, sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(srv.url)
            page.wait_for_selector("#lc-input textarea", timeout=30_000)
            page.evaluate(DROP_JS, ["bar_chart.png", _b64("bar_chart.png")])
            page.wait_for_selector("#lc-input img", timeout=10_000)  # dropped image attached
            page.locator("#lc-input textarea").fill("Which quarter sold most?")
            page.locator("#lc-input textarea").press("Enter")
            mid = _wait_text(page, "You said: Which quarter sold most? w0 w1 w2")
            assert "w39" not in mid, "the answer should be visible while it streams"
            _wait_text(page, "tok/s")
            page.wait_for_selector("#lc-chat pre code .token", timeout=10_000)  # fenced code, highlighted
            page.wait_for_selector("#lc-chat .katex", timeout=10_000)  # $...$ rendered by KaTeX
            page.get_by_text("Thinking").first.click()
            page.get_by_text("The chart has four bars.").wait_for(state="visible", timeout=10_000)
            assert len(engine.requests[0].messages[-1].content) == 2  # the dropped image and the text

            page.get_by_role("button", name="Dark mode").click()
            assert page.evaluate("document.body.classList.contains('dark')")

            page.keyboard.press("Control+Shift+O")
            t = time.time()
            while "w39" in _chat_text(page):
                assert time.time() - t < 5, "Ctrl+Shift+O should start a new chat"
                time.sleep(0.05)

            page.reload()  # the dark-mode choice outlives the page
            page.wait_for_selector("#lc-input textarea", timeout=30_000)
            t = time.time()
            while not page.evaluate("document.body.classList.contains('dark')"):
                assert time.time() - t < 10, "dark mode should come back after a reload"
                time.sleep(0.05)
            page.get_by_role("button", name="Dark mode").click()
            page.reload()
            page.wait_for_selector("#lc-input textarea", timeout=30_000)
            time.sleep(0.5)
            assert page.evaluate("localStorage.getItem('localchat-theme')") == "light"
            assert not page.evaluate("document.body.classList.contains('dark')")
        finally:
            browser.close()


def test_browser_startup_page_follows_the_progress_then_becomes_the_chat(history):
    import threading

    import uvicorn

    from localchat.app.startup import StartupServer, StartupStatus
    from localchat.engine.hub import DownloadProgress

    sock = bind_listener("127.0.0.1", 0)
    url = page_url("127.0.0.1", sock)
    status = StartupStatus("fake-glm")
    startup = StartupServer(status, sock).start()
    server = None
    with sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page()
            page.goto(url)
            status.download(DownloadProgress(file="model-00001-of-00002.safetensors", done=3, total=4,
                                             overall_done=3 << 30, overall_total=4 << 30, files_done=0, files_total=2))
            page.get_by_text("Downloading the model").wait_for(timeout=10_000)
            page.get_by_text("3.0 of 4.0 GiB").wait_for(timeout=10_000)
            assert page.evaluate("document.getElementById('fill').style.width") == "75%"
            status.load(1, 2, "model-00002-of-00002.safetensors")
            page.get_by_text("Loading the weights").wait_for(timeout=10_000)

            # ready: the startup server goes, the chat page's server takes the socket, the page reloads
            status.ready()
            startup.stop()
            server = uvicorn.Server(uvicorn.Config(create_app(FakeEngine(), history), log_level="warning",
                                                   timeout_graceful_shutdown=0.2))
            threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
            page.wait_for_selector("#lc-input textarea", timeout=30_000)
            assert page.url == url

            # a failed start: the reason on the page
            failed = StartupStatus("gpt-oss-120b")
            server.should_exit = True
            time.sleep(0.5)
            sock2 = bind_listener("127.0.0.1", 0)
            late = StartupServer(failed, sock2).start()
            try:
                page.goto(page_url("127.0.0.1", sock2))
                page.get_by_text("Starting").wait_for(timeout=10_000)
                failed.failed("gpt-oss-120b does not fit GPU 0: pass --max-context 8192")
                page.get_by_text("localchat could not start").wait_for(timeout=10_000)
                assert "--max-context 8192" in page.locator("#error").inner_text()
            finally:
                late.stop()
                sock2.close()
        finally:
            browser.close()
            startup.stop()
            if server is not None:
                server.should_exit = True
            sock.close()
