"""An answer's stream gathered into page updates: at most one every FRAME_S, the first at once.

Each update of the chat page sends the chatbot's value through Gradio (its post-processing and a
diff against the last value, over the whole chat) and makes the browser render the answer's
Markdown again, code highlighting and LaTeX included. One update a token fell behind a fast model:
~1.2 ms an update in a new chat and ~2.2 ms after ten long turns on a 2-core machine
(BENCHMARKS.md, "The chat page's updates"), against ~2 ms a token from gpt-oss-20b on one GPU,
and the browser's share grows with the answer. 25 updates a second read as smooth streaming.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator

FRAME_S = 0.04


class _End:
    """Put after the stream's last item; carries what the stream raised, if it did."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def frames(stream: Iterable, frame_s: float = FRAME_S) -> Iterator[list]:
    """The stream's items in order, as lists: one list per update, holding everything that arrived
    since the last one and at least frame_s after it; the first list as soon as its first item is
    there, the last as soon as the stream ends. What the stream raises is raised here, after the
    items before it."""
    arrived: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for item in stream:
                arrived.put(item)
        except BaseException as e:  # handed to the page's thread, which reports it
            arrived.put(_End(e))
        else:
            arrived.put(_End())

    # the stream blocks between tokens; a thread of its own lets the page's thread wait with a deadline
    threading.Thread(target=pump, name="localchat-answer-stream", daemon=True).start()
    last = float("-inf")
    while True:
        batch, end = [], None
        item = arrived.get()
        while True:
            if isinstance(item, _End):
                end = item
                break
            batch.append(item)
            wait = last + frame_s - time.monotonic()
            try:
                item = arrived.get(timeout=wait) if wait > 0 else arrived.get_nowait()
            except queue.Empty:
                break
        if batch:
            last = time.monotonic()
            yield batch
        if end is not None:
            if end.error is not None:
                raise end.error
            return
