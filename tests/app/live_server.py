"""Test helpers: PNG bytes and a live uvicorn server on 127.0.0.1 for the app tests."""
import io
import socket
import threading
import time

from PIL import Image


def png_bytes(w: int = 32, h: int = 24, color=(200, 30, 30), fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, fmt)
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn running create_app() in a thread, the way `serve` runs it."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     timeout_graceful_shutdown=0.2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        # gradio_client keeps streaming connections open; do not wait for them to drain.
        self.server.should_exit = True
        self.thread.join(timeout=10)
