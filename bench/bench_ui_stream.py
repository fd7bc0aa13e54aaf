"""The chat page keeping up with a fast model: a scripted engine (tests/app/fake_engine.py) streams
--tokens deltas at --rates tokens a second into the real page (uvicorn in this process, driven by
gradio_client as the browser-side tests do), after --prior earlier turns of the same length in the
chat. Prints the page's time to deliver the whole answer against the engine's own time, and how
many updates it took. Host work only (no GPU, no byte floor).

    python bench/bench_ui_stream.py [--tokens 1000] [--rates 500,0] [--prior 0,10]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "app"))

from fake_engine import FakeEngine  # noqa: E402
from gradio_client import Client  # noqa: E402
from live_server import LiveServer  # noqa: E402

from localchat.app.history import History  # noqa: E402
from localchat.app.ui import create_app  # noqa: E402


def answer(client: Client, text: str) -> tuple[float, int]:
    """(seconds from asking until the page's last update, updates)."""
    start = time.perf_counter()
    client.predict({"text": text, "files": []}, api_name="/send")
    job = client.submit(api_name="/generate")
    while not job.done():
        time.sleep(0.002)
    return time.perf_counter() - start, len(job.outputs())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--rates", default="500,0", help="tokens a second; 0: all at once")
    p.add_argument("--prior", default="0,10", help="earlier turns in the chat")
    args = p.parse_args()
    print("| tokens a second | earlier turns | the engine's pace | the page's time | updates |")
    print("|---|---|---|---|---|")
    for rate in map(float, args.rates.split(",")):
        for prior in map(int, args.prior.split(",")):
            engine = FakeEngine(delay=0.0, filler_words=args.tokens)
            with LiveServer(create_app(engine, History(tempfile.mkdtemp()))) as srv:
                client = Client(srv.url, verbose=False)
                for i in range(prior):
                    answer(client, f"question {i}")
                engine.delay = 1 / rate if rate else 0.0
                seconds, updates = answer(client, "the measured one")
            label = f"{rate:.0f}" if rate else "all at once"
            print(f"| {label} | {prior} | {args.tokens * engine.delay:.2f} s | {seconds:.2f} s | {updates} |")


if __name__ == "__main__":
    main()
