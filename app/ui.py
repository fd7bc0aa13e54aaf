"""The chat page (Gradio Blocks) and `serve`, which runs it with the /v1 API in one uvicorn server.

Privacy: analytics off (set before gradio is imported), no share links, theme fonts are local
(gradio's default theme uses LocalFont), and the page loads nothing from other hosts.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import threading
import webbrowser
from pathlib import Path

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"

import fastapi  # noqa: E402
import gradio as gr  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from localchat.app.api import create_api  # noqa: E402
from localchat.app.history import History  # noqa: E402
from localchat.app.ui_chat import ChatController, max_answer_tokens  # noqa: E402
from localchat.app.ui_images import ImageLimits  # noqa: E402
from localchat.app.ui_render import model_markdown  # noqa: E402
from localchat.engine.runtime.request import ChatEngine  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "assets"
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False},
         {"left": "\\(", "right": "\\)", "display": False}, {"left": "\\[", "right": "\\]", "display": True}]
# Esc stops, Ctrl/Cmd+Shift+O starts a new chat; Enter sends (MultimodalTextbox default).
SHORTCUTS_JS = """<script>
document.addEventListener('keydown', (e) => {
  if (e.key === 'Escape') { document.getElementById('lc-stop')?.click(); }
  if ((e.ctrlKey || e.metaKey) && e.shiftKey && e.key.toLowerCase() === 'o') {
    e.preventDefault(); document.getElementById('lc-new')?.click();
  }
});
</script>"""
# The choice is kept in the browser (localStorage) and put back on every load, over the system's.
DARK_TOGGLE_JS = ("() => { const dark = document.body.classList.toggle('dark');"
                  " localStorage.setItem('localchat-theme', dark ? 'dark' : 'light'); }")
THEME_RESTORE_JS = ("() => { const theme = localStorage.getItem('localchat-theme');"
                    " if (theme) document.body.classList.toggle('dark', theme === 'dark'); }")


def build_ui(engine: ChatEngine, history: History, *, demo_note: str | None = None,
             limits: ImageLimits = ImageLimits()) -> gr.Blocks:
    ctl = ChatController(engine, history, limits)
    info = ctl.info
    d = ctl.defaults
    with gr.Blocks(title="localchat", analytics_enabled=False, fill_height=True) as demo:
        conv_id = gr.State(None)
        pending = gr.State(False)
        with gr.Sidebar(open=True, label="Chats"):
            gr.HTML(_logo_html())
            new_btn = gr.Button("New chat", elem_id="lc-new", size="sm")
            query = gr.Textbox(placeholder="Search chats", show_label=False, elem_id="lc-search")
            chats = gr.Radio(choices=ctl.conversation_choices(), label="Chats", show_label=False, elem_id="lc-chats")
            with gr.Accordion("This chat", open=False):
                title = gr.Textbox(label="Title", elem_id="lc-title")
                rename_btn = gr.Button("Rename", size="sm")
                delete_btn = gr.Button("Delete", size="sm", variant="stop")
                with gr.Row():
                    export_json_btn = gr.Button("Export JSON", size="sm")
                    export_md_btn = gr.Button("Export Markdown", size="sm")
                export_file = gr.File(label="Download", interactive=False)
            import_btn = gr.UploadButton("Import a chat (JSON)", file_types=[".json"], size="sm", elem_id="lc-import")
        if demo_note:
            gr.Markdown(demo_note, elem_id="lc-demo-note")
        chatbot = gr.Chatbot(elem_id="lc-chat", show_label=False, editable="user", buttons=["copy", "copy_all"],
                             latex_delimiters=LATEX, feedback_options=None, scale=1, height="70vh",
                             placeholder=f"Ask **{info.name}** anything; attach, paste or drop images.")
        textbox = gr.MultimodalTextbox(
            file_count="multiple", file_types=["image"], sources=["upload"], elem_id="lc-input",
            placeholder="Message (Enter sends, Shift+Enter new line, Esc stops)", show_label=False,
            autofocus=True)
        with gr.Row():
            stop_btn = gr.Button("Stop", elem_id="lc-stop", size="sm", variant="secondary")
            dark_btn = gr.Button("◐ Dark mode", size="sm")
        with gr.Accordion("Settings", open=False):
            system = gr.Textbox(label="System prompt", lines=2, value=d.system_prompt)
            with gr.Row():
                temperature = gr.Slider(0, 2, value=d.temperature, step=0.05, label="Temperature")
                top_p = gr.Slider(0.01, 1, value=d.top_p, step=0.01, label="Top-p")
                top_k = gr.Slider(0, 200, value=d.top_k, step=1, label="Top-k (0 = off)")
            with gr.Row():
                max_tokens = gr.Slider(16, max_answer_tokens(info), value=d.max_tokens, step=16,
                                       label="Max answer tokens")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1 = random)")
            thinking = gr.Checkbox(value=d.thinking, label="Thinking", visible=info.reasoning == "thinking")
            effort = gr.Radio(["low", "medium", "high"], value=d.reasoning_effort, label="Reasoning effort",
                              visible=info.reasoning == "effort")
        with gr.Accordion("Model", open=False):
            gr.Markdown(model_markdown(info))
        settings = [system, temperature, top_p, top_k, max_tokens, seed, thinking, effort]

        # Send: store the turn, then stream. Hidden-but-named endpoints (edit/retry by index) let
        # scripts and tests drive the same handlers as the chatbot's own edit/retry buttons.
        gen = dict(fn=ctl.generate, inputs=[pending, conv_id], outputs=[chatbot], concurrency_limit=None,
                   api_name="generate")
        textbox.submit(ctl.send, [textbox, conv_id] + settings, [chatbot, textbox, conv_id, pending, chats],
                       api_name="send").then(**gen)
        stop_btn.click(ctl.stop, None, None, api_name="stop", queue=False)

        def on_edit(cid, data: gr.EditData, *values):
            return ctl.edit(cid, data.index, _text_of(data.value), *values)

        def on_retry(cid, data: gr.RetryData, *values):
            return ctl.retry(cid, data.index, *values)

        chatbot.edit(on_edit, [conv_id] + settings, [chatbot, pending], api_visibility="private").then(
            **{**gen, "api_name": None, "api_visibility": "private"})
        chatbot.retry(on_retry, [conv_id] + settings, [chatbot, pending], api_visibility="private").then(
            **{**gen, "api_name": None, "api_visibility": "private"})
        idx, new_text = gr.Number(visible=False, precision=0), gr.Textbox(visible=False)
        edit_api_btn, retry_api_btn = gr.Button(visible=False), gr.Button(visible=False)
        edit_api_btn.click(ctl.edit, [conv_id, idx, new_text] + settings, [chatbot, pending], api_name="edit")
        retry_api_btn.click(ctl.retry, [conv_id, idx] + settings, [chatbot, pending], api_name="retry")

        opened = [chatbot, conv_id, title] + settings
        chats.input(ctl.open, [chats], opened, api_name="open")
        new_btn.click(ctl.new_chat, None, [chatbot, conv_id, title, chats] + settings, api_name="new_chat")
        # The chatbot's trash icon starts a new chat; the stored one stays in the sidebar.
        chatbot.clear(ctl.new_chat, None, [chatbot, conv_id, title, chats] + settings, api_visibility="private")
        query.change(ctl.search, [query, conv_id], [chats], api_name="search")
        rename_btn.click(ctl.rename, [conv_id, title, query], [chats], api_name="rename")
        delete_btn.click(ctl.delete, [conv_id, query], [chatbot, conv_id, title, chats], api_name="delete")
        export_json_btn.click(lambda c: ctl.export(c, "json"), [conv_id], [export_file], api_name="export_json")
        export_md_btn.click(lambda c: ctl.export(c, "md"), [conv_id], [export_file], api_name="export_markdown")
        import_btn.upload(ctl.import_chat, [import_btn, query], [chatbot, conv_id, title, chats] + settings,
                          api_name="import_chat")
        dark_btn.click(None, js=DARK_TOGGLE_JS)
        # Other tabs may have added chats: refresh the list whenever a page loads.
        demo.load(ctl.search, [query, conv_id], [chats], api_visibility="private")
        demo.load(None, js=THEME_RESTORE_JS)
    demo.queue(default_concurrency_limit=8)
    demo.localchat_controller = ctl  # tests and the CLI reach the handlers through it
    return demo


def _text_of(value) -> str:
    """EditData.value is the edited text, or a list of content parts for a multi-part message."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return " ".join(_text_of(v) for v in value if isinstance(v, (str, dict, list)))
    if isinstance(value, dict):
        return value.get("text") or value.get("value") or ""
    return str(value or "")


def _logo_html() -> str:
    svg = (ASSETS / "logo.svg").read_text() if (ASSETS / "logo.svg").exists() else ""
    return f'<div id="lc-logo">{svg}<span>localchat</span></div>'


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(engine: ChatEngine, history: History, *, auth=None, api_key: str | None = None,
               demo_note: str | None = None, limits: ImageLimits = ImageLimits()) -> fastapi.FastAPI:
    """One FastAPI app: /v1 (OpenAI-compatible) first, the Gradio page at /."""
    app = fastapi.FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(create_api(engine, api_key=api_key, limits=limits))
    # Liveness for process managers and load balancers (vLLM and SGLang answer the same path); it
    # says nothing about the chats, so it needs no key. An engine that can no longer serve (a GPU
    # fault) answers 503 with the reason, so a supervisor restarts it.
    app.add_api_route("/health", lambda: _health(engine), methods=["GET"])
    demo = build_ui(engine, history, demo_note=demo_note, limits=limits)
    css = ASSETS / "style.css"
    return gr.mount_gradio_app(
        app, demo, path="/", auth=auth, allowed_paths=[str(history.images_dir)],
        # Gradio's own upload cap sits above ours so our message (which names the limit) shows.
        max_file_size=4 * limits.max_bytes, footer_links=[], ssr_mode=False, pwa=False, mcp_server=False,
        theme=gr.themes.Default(primary_hue="indigo"), head=SHORTCUTS_JS,
        css_paths=[css] if css.exists() else None,
        favicon_path=str(ASSETS / "logo.svg") if (ASSETS / "logo.svg").exists() else None)


def _health(engine: ChatEngine):
    failure = engine.health() if callable(getattr(engine, "health", None)) else None
    if failure:
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    return {"status": "ok"}


def bind_listener(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, for the server, so that a busy port is reported
    before a model spends minutes loading (and before the page's address is announced). Listening
    from here on, a browser that asks before a server's thread has started (the page opened at once
    on a busy machine), or while the startup page hands the socket to the chat page, waits in the
    backlog instead of being refused."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot listen on {host}: {e.strerror}; pass --listen with an address of this "
                         "machine (127.0.0.1 keeps the page on this machine)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart may reuse the port at once
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use (another localchat?): pass --port with a "
                             "free port, or stop the program that holds it") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)  # uvicorn's default backlog; its server listens on the socket again, which is harmless
    return sock


def page_url(host: str, sock: socket.socket) -> str:
    """The page's address as a browser on this machine reaches it (port: the one bound, which the
    system chose for --port 0)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{sock.getsockname()[1]}/"


def serve(engine: ChatEngine, *, history: History | None = None, host: str = "127.0.0.1", port: int = 7860,
          auth=None, api_key: str | None = None, open_browser: bool = True, demo_note: str | None = None,
          sock: socket.socket | None = None, stop_requested=None) -> None:
    """Run the page and /v1 until interrupted. Beyond loopback both `auth` and `api_key` are required.
    sock: bind_listener(host, port) made earlier (else bound here). stop_requested() -> True: a
    Ctrl+C came while the page was being built; the server does not start."""
    import uvicorn

    if not is_loopback(host) and (not auth or not api_key):
        raise ValueError(f"Listening on {host} exposes your chats to the network: pass --auth USER:PASSWORD "
                         "(for the page) and --api-key KEY (for /v1), or keep the default 127.0.0.1.")
    app = create_app(engine, history or History(), auth=auth, api_key=api_key, demo_note=demo_note)
    sock = sock or bind_listener(host, port)
    port = sock.getsockname()[1]  # the one the system chose for --port 0
    url = page_url(host, sock)
    print(f"localchat: page {url}  API {url}v1  (Ctrl+C stops)", flush=True)
    if open_browser:
        threading.Timer(1.5, webbrowser.open, args=(url,)).start()
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    if stop_requested is None or not stop_requested():
        server.run(sockets=[sock])
