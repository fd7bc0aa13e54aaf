"""The page served while the model gets ready: download, loading, kernel compilation.

A first start of a large model spends minutes (an hour on a slow line) downloading and loading
before the chat page can exist. Rather than leave the browser on a refused connection and the
progress in a terminal the user may not be looking at, `localchat` serves this small page on the
chat page's own address at once; it shows what is happening and how far along it is, and reloads
into the chat page once that is up. /health and /v1 answer 503 meanwhile (with Retry-After), so
process managers and API clients see "not ready" rather than a refused connection.

The page is served from a duplicate of the listening socket: closing it when the model is ready
leaves the original bound, so requests that arrive between the two servers wait in its backlog and
are answered by the chat page's server.
"""
from __future__ import annotations

import html
import json
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import fastapi
from fastapi.responses import HTMLResponse, JSONResponse

from .api import key_error
from .api_errors import ApiError

# How long a failed start keeps the page up for a browser that is watching it, so the reason
# shows there too (the terminal always has it).
FAILURE_GRACE_S = 3.0
POLL_MS = 1000


@dataclass(frozen=True)
class StartupState:
    """What the page shows. stage: download | load | warmup | ready | failed; fraction in [0, 1]
    or None when unknown; detail: the file or step under way; error: why the start failed."""

    model: str
    stage: str = "starting"
    fraction: float | None = None
    detail: str = ""
    error: str = ""


STAGE_TITLES = {"starting": "Starting", "download": "Downloading the model", "load": "Loading the weights",
                "warmup": "Compiling kernels and capturing decode graphs", "ready": "Ready",
                "failed": "localchat could not start"}


class StartupStatus:
    """Thread-safe progress of a start, written by the loading thread and read by the page. Its
    methods match the progress callbacks of the download (engine.hub) and the loader."""

    def __init__(self, model: str, *, show_errors: bool = True):
        """show_errors=False (a page reachable from other machines, before any login): a failure
        says only that the start failed; its reason, which may name local paths, stays in the terminal."""
        self._show_errors = show_errors
        self._lock = threading.Lock()
        self._state = StartupState(model=model)
        self._last_read = 0.0  # time.monotonic() of the last poll from a page
        self._read_after_failure = threading.Event()

    def state(self, *, polled: bool = False) -> StartupState:
        with self._lock:
            if polled:
                self._last_read = time.monotonic()
                if self._state.stage == "failed":
                    self._read_after_failure.set()
            return self._state

    def _set(self, **changes) -> None:
        with self._lock:
            self._state = StartupState(**{**asdict(self._state), **changes})

    def download(self, progress) -> None:
        """engine.hub's on_progress (a DownloadProgress)."""
        gib = 1024 ** 3
        self._set(stage="download", fraction=progress.overall_done / max(progress.overall_total, 1),
                  detail=f"{progress.overall_done / gib:.1f} of {progress.overall_total / gib:.1f} GiB, "
                         f"file {progress.files_done + 1} of {progress.files_total}: {progress.file}")

    def load(self, done: int, total: int, file: str) -> None:
        """The loader's on_progress(done_bytes, total_bytes, file)."""
        self._set(stage="load", fraction=done / max(total, 1), detail=Path(file).name)

    def warmup(self) -> None:
        self._set(stage="warmup", fraction=None, detail="")

    def ready(self) -> None:
        self._set(stage="ready", fraction=1.0, detail="")

    def failed(self, error: str) -> None:
        shown = error if self._show_errors else "the reason is in localchat's terminal"
        self._set(stage="failed", fraction=None, detail="", error=shown)

    def wait_for_watchers(self, grace_s: float = FAILURE_GRACE_S) -> None:
        """After failed(): if a page polled in the last few seconds, give it up to grace_s to
        fetch the error before the server goes away; return at once when nobody is watching."""
        with self._lock:
            watched = time.monotonic() - self._last_read < 3 * POLL_MS / 1000
        if watched:
            self._read_after_failure.wait(grace_s)


def create_startup_app(status: StartupStatus, api_key: str | None = None) -> fastapi.FastAPI:
    """/ the progress page, /startup its JSON, /health and /v1/... 503 until the model is ready
    (with `api_key`, /v1 wants it already, as the API will)."""
    app = fastapi.FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    def not_ready(state: StartupState) -> str:
        if state.stage == "failed":
            return f"localchat could not start: {state.error}"
        return f"the model ({state.model}) is still loading: {STAGE_TITLES.get(state.stage, state.stage).lower()}"

    @app.get("/", response_class=HTMLResponse)
    def page():
        return HTMLResponse(startup_html(status.state()), headers={"Cache-Control": "no-store"})

    @app.get("/startup")
    def progress():
        return JSONResponse(asdict(status.state(polled=True)), headers={"Cache-Control": "no-store"})

    @app.get("/health")
    def health():
        state = status.state()
        return JSONResponse({"status": "loading" if state.stage != "failed" else "failed", "stage": state.stage,
                             "fraction": state.fraction}, status_code=503, headers={"Retry-After": "5"})

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    def api(rest: str, request: fastapi.Request):
        # the API's own errors (its key check, the error shape OpenAI clients parse and print)
        refused = key_error(request, api_key)
        if refused is not None:
            return refused.response()
        loading = ApiError(503, not_ready(status.state()), type="service_unavailable", code="model_loading")
        return loading.response(headers={"Retry-After": "5"})

    return app


def startup_html(state: StartupState) -> str:
    """A self-contained page (nothing loaded from elsewhere) that polls /startup and reloads into
    the chat page when the model is ready."""
    model = html.escape(state.model)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>localchat: starting {model}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body {{ font-family: system-ui, sans-serif; max-width: 40rem; margin: 18vh auto; padding: 0 1.5rem;
        color: #1f2937; background: #fff; }}
 @media (prefers-color-scheme: dark) {{ body {{ color: #e5e7eb; background: #111827; }} }}
 h1 {{ font-size: 1.3rem; font-weight: 600; }}
 .bar {{ height: .6rem; border-radius: .3rem; background: #e5e7eb; overflow: hidden; }}
 .fill {{ height: 100%; width: 0; background: #4f46e5; transition: width .4s; }}
 .busy .fill {{ width: 30%; animation: slide 1.4s ease-in-out infinite; }}
 @keyframes slide {{ from {{ margin-left: -30%; }} to {{ margin-left: 100%; }} }}
 #detail {{ margin-top: .7rem; font-size: .9rem; opacity: .75; word-break: break-all; }}
 #error {{ margin-top: 1rem; color: #b91c1c; white-space: pre-wrap; }}
</style></head>
<body>
<h1>localchat · {model}</h1>
<p id="stage">{html.escape(STAGE_TITLES.get(state.stage, state.stage))}</p>
<div class="bar busy" id="bar"><div class="fill" id="fill"></div></div>
<div id="detail"></div><div id="error"></div>
<script>
const titles = {json.dumps(STAGE_TITLES)};
let misses = 0;
async function poll() {{
  let r;
  try {{ r = await fetch('/startup', {{cache: 'no-store'}}); }} catch (e) {{ r = null; }}
  if (r && !r.ok) {{ location.reload(); return; }}  // the chat page's server has no /startup: it is up
  if (!r) {{
    if (++misses >= 3) document.getElementById('detail').textContent =
      'localchat is not answering; if it stopped, its terminal says why. Retrying...';
    setTimeout(poll, 2000); return;
  }}
  misses = 0;
  let s;
  try {{ s = await r.json(); }} catch (e) {{ location.reload(); return; }}  // not this page's server any more
  if (s.stage === 'ready') {{ setTimeout(() => location.reload(), 500); return; }}
  document.getElementById('stage').textContent = titles[s.stage] || s.stage;
  document.getElementById('detail').textContent = s.detail;
  const bar = document.getElementById('bar');
  bar.classList.toggle('busy', s.fraction === null && s.stage !== 'failed');
  document.getElementById('fill').style.width = s.fraction === null ? '' : (100 * s.fraction).toFixed(1) + '%';
  if (s.stage === 'failed') {{ document.getElementById('error').textContent = s.error; return; }}
  setTimeout(poll, {POLL_MS});
}}
poll();
</script></body></html>"""


class StartupServer:
    """The startup page's uvicorn server, on a duplicate of `sock`, in a background thread."""

    def __init__(self, status: StartupStatus, sock: socket.socket, api_key: str | None = None):
        import uvicorn

        self.status = status
        # graceful shutdown waits this long for open connections (a page's poll takes milliseconds)
        config = uvicorn.Config(create_startup_app(status, api_key), log_level="warning",
                                timeout_graceful_shutdown=1, lifespan="off")
        self._server = uvicorn.Server(config)
        self._sock = sock.dup()
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="localchat-startup-page", daemon=True)

    def start(self) -> StartupServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving the page; the original socket stays bound for the chat page's server."""
        self._server.should_exit = True
        self._thread.join(timeout=5)
        self._sock.close()
