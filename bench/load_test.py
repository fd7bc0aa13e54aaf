"""Load test: many concurrent streaming clients against the OpenAI-compatible API over a real Engine.

    .venv/bin/python bench/load_test.py                  # demo model, 32 clients, 120 s, CPU
    .venv/bin/python bench/load_test.py --model DIR --clients 8 --seconds 15

The server is uvicorn on 127.0.0.1 (a free port) in a thread of this process, so the engine's KV
pool can be inspected once the load stops. Each client loops until the deadline: a random
prompt, random max_tokens, `stream: true` with usage; about 30% of requests hang up after a
few chunks. Checks: no 5xx and no error events; every response not hung up ends with a
finish_reason of stop/length, a usage chunk and `data: [DONE]`; once idle, every KV block is free
again (plain or cached). Prints the figures; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = ("the quick brown fox jumps over lazy dog what is in this picture describe image one sentence "
         "hello how are you today think step by step then answer question with short number red square "
         "blue circle table kitchen poem about sea sky stars night").split()
MAX_FAILURES_KEPT = 20


@dataclass
class LoadReport:
    """What the clients saw. `ttft` holds seconds from sending a request to its first token."""
    clients: int
    seconds: float
    completed: int = 0
    cancelled: int = 0
    completion_tokens: int = 0
    streamed_chunks: int = 0
    ttft: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    failure_count: int = 0
    kv_free_blocks: int | None = None
    kv_num_blocks: int | None = None

    def fail(self, message: str) -> None:
        self.failure_count += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append(message)

    @property
    def ok(self) -> bool:
        return self.failure_count == 0 and self.completed > 0

    def percentile(self, q: float) -> float:
        if not self.ttft:
            return float("nan")
        if len(self.ttft) == 1:
            return self.ttft[0]
        return statistics.quantiles(self.ttft, n=100, method="inclusive")[round(q) - 1]

    def summary(self) -> str:
        lines = [
            f"clients {self.clients}, duration {self.seconds:.1f} s",
            f"requests done {self.completed + self.cancelled} (completed {self.completed}, "
            f"cancelled mid-stream {self.cancelled})",
            f"completion tokens {self.completion_tokens} in completed responses, "
            f"{self.streamed_chunks} streamed chunks in all",
            f"aggregate {self.completion_tokens / self.seconds:.1f} tokens/s (completed responses), "
            f"{self.streamed_chunks / self.seconds:.1f} chunks/s (all)",
            f"time to first token p50 {self.percentile(50) * 1000:.0f} ms, p95 {self.percentile(95) * 1000:.0f} ms "
            f"({len(self.ttft)} requests)",
            f"KV pool once idle: {self.kv_free_blocks}/{self.kv_num_blocks} blocks free",
            f"failures {self.failure_count}",
        ]
        lines += [f"  - {f}" for f in self.failures]
        if self.failure_count > len(self.failures):
            lines.append(f"  ... and {self.failure_count - len(self.failures)} more")
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, name="load-test-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the API server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def api_app(engine):
    """A FastAPI app with only the /v1 routes (no Gradio page: it is not under test here)."""
    import fastapi

    from localchat.app.api import create_api

    app = fastapi.FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(create_api(engine))
    return app


async def one_request(http: httpx.AsyncClient, rng: random.Random, model: str, report: LoadReport,
                      cancel_prob: float, request_timeout: float) -> None:
    """One streamed chat completion; records it in `report`."""
    max_tokens = rng.randint(8, 64)
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    cancel_after = rng.randint(1, 4) if rng.random() < cancel_prob else None
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "seed": rng.randrange(2**31)}
    where = f"max_tokens={max_tokens} prompt={prompt[:40]!r}"
    sent = time.monotonic()
    first, chunks, finish, usage, done = None, 0, None, None, False
    async with asyncio.timeout(request_timeout):
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")[:200]
                report.fail(f"HTTP {resp.status_code} for {where}: {text}")
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    report.fail(f"error event for {where}: {event['error'].get('message')}")
                    return
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        chunks += 1
                        if first is None:
                            first = time.monotonic() - sent
                    finish = choice.get("finish_reason") or finish
                if cancel_after is not None and chunks >= cancel_after:
                    break  # leaving the block closes the connection mid-stream
    report.streamed_chunks += chunks
    if first is not None:
        report.ttft.append(first)
    if cancel_after is not None and chunks >= cancel_after:
        report.cancelled += 1
        return
    # A response shorter than its cancel point ran to the end: it must be complete like the rest.
    problems = []
    if not done:
        problems.append("no [DONE]")
    if finish not in ("stop", "length"):
        problems.append(f"finish_reason {finish!r}")
    if not usage or usage.get("completion_tokens", 0) < 1 or usage.get("prompt_tokens", 0) < 1:
        problems.append(f"usage {usage!r}")
    elif finish == "length" and usage["completion_tokens"] != max_tokens:
        problems.append(f"finish_reason length after {usage['completion_tokens']} tokens")
    elif usage["completion_tokens"] > max_tokens:
        problems.append(f"{usage['completion_tokens']} tokens over max_tokens")
    if problems:
        report.fail(f"incomplete response for {where}: {', '.join(problems)}")
        return
    report.completed += 1
    report.completion_tokens += usage["completion_tokens"]


async def client_loop(base_url: str, model: str, deadline: float, rng: random.Random, report: LoadReport,
                      cancel_prob: float, request_timeout: float) -> None:
    """Requests back to back until `deadline` (time.monotonic()); no new request starts after it."""
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(request_timeout),
                                 trust_env=False) as http:
        while time.monotonic() < deadline:
            try:
                await one_request(http, rng, model, report, cancel_prob, request_timeout)
            except (TimeoutError, httpx.HTTPError, json.JSONDecodeError) as e:
                report.fail(f"{type(e).__name__}: {e}")


async def drive(base_url: str, model: str, clients: int, seconds: float, seed: int, cancel_prob: float,
                request_timeout: float) -> LoadReport:
    report = LoadReport(clients, seconds)
    start = time.monotonic()
    deadline = start + seconds
    await asyncio.gather(*(client_loop(base_url, model, deadline, random.Random(seed * 1000 + i), report,
                                       cancel_prob, request_timeout) for i in range(clients)))
    report.seconds = time.monotonic() - start
    return report


def wait_for_idle_pool(engine, report: LoadReport, timeout: float = 30.0) -> None:
    """Waits until every KV block is free (aborts land before the engine's next step)."""
    deadline = time.monotonic() + timeout
    while True:
        c = engine.counters()
        report.kv_free_blocks, report.kv_num_blocks = c["free_blocks"], c["num_blocks"]
        if c["free_blocks"] == c["num_blocks"]:
            break
        if time.monotonic() > deadline:
            report.fail(f"KV pool not back to full {timeout:.0f} s after the load: "
                        f"{c['free_blocks']}/{c['num_blocks']} blocks free")
            return
        time.sleep(0.1)
    try:
        engine.pool.check()
    except AssertionError as e:
        report.fail(f"KV pool bookkeeping inconsistent once idle: {e}")


def run_load(engine, *, clients: int = 32, seconds: float = 120.0, seed: int = 0, cancel_prob: float = 0.3,
             request_timeout: float = 120.0) -> LoadReport:
    """Serves `engine` on 127.0.0.1, runs the clients, then checks the KV pool. Does not shut the engine down."""
    with ServerThread(api_app(engine)) as server:
        report = asyncio.run(drive(server.url, engine.info().name, clients, seconds, seed, cancel_prob,
                                   request_timeout))
    wait_for_idle_pool(engine, report)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the demo model, built in a temp dir)")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--cancel-prob", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or not 0 <= args.cancel_prob <= 1:
        p.error("--clients must be >= 1, --seconds > 0 and --cancel-prob in [0, 1]")

    from localchat.app.demo import ensure_demo
    from localchat.engine.runtime.engine import Engine

    with tempfile.TemporaryDirectory(prefix="localchat-load-") as tmp:
        model_dir = args.model if args.model is not None else ensure_demo(Path(tmp))
        if not (model_dir / "config.json").is_file():
            p.error(f"{model_dir} has no config.json; pass a checkpoint directory to --model")
        t0 = time.monotonic()
        engine = Engine(model_dir, device="cpu")
        print(f"model {model_dir} loaded in {time.monotonic() - t0:.1f} s; "
              f"{args.clients} clients for {args.seconds:g} s", flush=True)
        try:
            report = run_load(engine, clients=args.clients, seconds=args.seconds, seed=args.seed,
                              cancel_prob=args.cancel_prob)
        finally:
            engine.shutdown()
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
