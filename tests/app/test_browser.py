"""End to end in headless Chromium (Debian `chromium` package) driven by Playwright.

Open the page, attach an image, send, watch the answer stream, open the thinking panel, check
code highlighting and LaTeX, reload, reopen the chat from the sidebar, Ctrl+Shift+O for a new
chat. Set LOCALCHAT_SCREENSHOT=assets/screenshot.png to refresh the README screenshot.
"""
import os
import shutil
import time
from pathlib import Path

import pytest

from fake_engine import FakeEngine
from live_server import LiveServer
from localchat.app.ui import ASSETS, create_app

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


def test_browser_send_image_stream_thinking_reload(history, tmp_path):
    engine = FakeEngine(delay=0.04, filler_words=40, extra_markdown=EXTRA,
                        thinking_words=("The", "chart", "has", "four", "bars."))
    with LiveServer(create_app(engine, history)) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(srv.url)
            page.wait_for_selector("#lc-input textarea", timeout=30_000)
            page.locator("#lc-input input[type=file]").set_input_files(str(ASSETS / "examples" / "bar_chart.png"))
            page.wait_for_selector("#lc-input img", timeout=10_000)
            page.locator("#lc-input textarea").fill("Which quarter sold most?")
            page.locator("#lc-input textarea").press("Enter")
            mid = _wait_text(page, "You said: Which quarter sold most? w0 w1 w2")
            assert "w39" not in mid, "the answer should be visible while it streams"
            _wait_text(page, "tok/s")
            page.wait_for_selector("#lc-chat pre code", timeout=10_000)  # fenced code rendered
            page.wait_for_selector("#lc-chat .katex", timeout=10_000)  # $...$ rendered by KaTeX
            page.get_by_text("Thinking").first.click()
            page.get_by_text("The chart has four bars.").wait_for(state="visible", timeout=10_000)
            assert len(engine.requests) == 1 and len(engine.requests[0].messages[-1].content) == 2

            page.reload()
            page.wait_for_selector("#lc-chats label", timeout=30_000)
            assert "Which quarter sold most?" in page.locator("#lc-chats").inner_text()
            page.locator("#lc-chats label").first.click()
            _wait_text(page, "w39")
            page.wait_for_selector("#lc-chat img", timeout=10_000)
            page.get_by_text("Thinking").first.click()
            page.get_by_text("The chart has four bars.").wait_for(state="visible", timeout=10_000)
            time.sleep(0.5)  # let the panel's open animation finish before the screenshot
            shot = Path(os.environ.get("LOCALCHAT_SCREENSHOT", tmp_path / "screenshot.png"))
            page.screenshot(path=str(shot))
            assert shot.stat().st_size > 10_000

            page.keyboard.press("Control+Shift+O")
            t = time.time()
            while "w39" in _chat_text(page):
                assert time.time() - t < 5, "Ctrl+Shift+O should start a new chat"
                time.sleep(0.05)
        finally:
            browser.close()
