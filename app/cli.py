"""`localchat`: serve the chat app (default), or `run` one question from the shell."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from .defaults import ANSWER_TOKENS
from .errors import UserError
from .placement import check_checkpoint_fits, default_model, refuse_unrunnable, tp_size


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where the model runs")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="compute dtype of the unquantized parts (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--max-context", type=_within(int, 1), default=None, help="cap the context length (tokens)")
    p.add_argument("--gpus", type=_gpu_list, default=None, metavar="0,1,...",
                   help="the GPUs to split the model over (default: GPUs 0..N-1 with --tp N, else the fewest GPUs "
                        "that hold the model and its context)")
    p.add_argument("--tp", type=_within(int, 1), default=None, metavar="N",
                   help="tensor-parallel size: one process per GPU, each holding 1/N of the model (default: the "
                        "number of --gpus listed, else the fewest GPUs that hold the model and its context); with "
                        "--device cpu, N CPU processes")
    p.add_argument("--ep", action="store_true",
                   help="expert parallel: split the MoE experts whole over the --tp ranks instead of slicing each one")
    p.add_argument("--quantize", default=None, choices=["fp8"],
                   help="store a bf16 checkpoint's decoder projections as FP8 with a scale per row while loading "
                        "(half their memory; GLM-4.5V then fits one 141 GB GPU); needs compute capability 8.9+")


def _gpu_list(text: str) -> list[int]:
    try:
        gpus = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes GPU indices separated by commas, like 0,1 (got {text!r})")
    if not gpus or min(gpus) < 0:
        raise argparse.ArgumentTypeError(f"--gpus takes GPU indices separated by commas, like 0,1 (got {text!r})")
    return gpus


def _within(kind, low, high=None, *, above_low=False):
    """An argparse type: `kind` parsed, then held to [low, high] ((low, high] with above_low)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if value < low or (above_low and value == low) or (high is not None and value > high):
            bounds = f"{'above' if above_low else 'at least'} {low:g}" + (f" and at most {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be {bounds} (got {text})")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="localchat", description="Local vision chat with GLM-4.5V and gpt-oss. With no command: serve the chat page.")
    parser.add_argument("--model", default=None,
                        help="registry name, Hub repo id or checkpoint directory (default: the best model that fits); "
                             "'demo' for a tiny random-weight model that runs on CPU; with --backend, the remote "
                             "model to use (default: the first it lists)")
    parser.add_argument("--backend", default=None, metavar="URL",
                        help="chat through an OpenAI-compatible server (vLLM, SGLang, localchat) at URL, "
                             "e.g. http://host:8000/v1, instead of loading a model here")
    parser.add_argument("--backend-key", default=None, metavar="KEY", help="bearer key the --backend server wants")
    parser.add_argument("--host", "--listen", dest="host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; any other needs --auth and --api-key)")
    parser.add_argument("--port", type=_within(int, 0, 65535), default=7860)
    parser.add_argument("--auth", default=None, metavar="USER:PASSWORD", help="required to listen beyond localhost")
    parser.add_argument("--api-key", default=None, help="bearer key for /v1; required to listen beyond localhost")
    parser.add_argument("--no-browser", action="store_true", help="do not open the page in a browser")
    parser.add_argument("--offline", action="store_true", help="use the local model cache only")
    _add_engine_args(parser)
    parser.set_defaults(func=cmd_serve, json=False)
    sub = parser.add_subparsers(dest="command")

    run = sub.add_parser("run", help="answer one question and exit",
                         description="Answer one question with a local checkpoint; stream the answer to stdout.")
    run.add_argument("target", nargs="?", default=None, metavar="MODEL",
                     help="a registry name (glm-4.5v-fp8, gpt-oss-20b, ...), a Hub repo id, a checkpoint directory, "
                          "or 'demo' (a tiny random-weight model); or give it with --model")
    run.add_argument("--model", dest="run_model", default=None, metavar="MODEL", help="the model, as MODEL")
    run.add_argument("question", nargs="?", default=None, metavar="PROMPT",
                     help="the question (or give it with --prompt, or pipe it in on standard input)")
    run.add_argument("--prompt", default=None, help="the question")
    run.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image to ask about (repeat for several; they come before the text, in order)")
    run.add_argument("--system", default=None, help="a system prompt")
    run.add_argument("--max-tokens", type=_within(int, 1), default=ANSWER_TOKENS,
                     help=f"the most answer tokens, reasoning included (default {ANSWER_TOKENS}, capped by the context)")
    run.add_argument("--temperature", type=_within(float, 0.0), default=None,
                     help="0 for greedy (default: the checkpoint's generation_config, else 1.0)")
    run.add_argument("--top-p", type=_within(float, 0.0, 1.0, above_low=True), default=None)
    run.add_argument("--top-k", type=_within(int, 0), default=None, help="0: off")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--no-thinking", action="store_true", help="GLM: answer without a thinking phase")
    run.add_argument("--reasoning-effort", default="medium", choices=["low", "medium", "high"], help="gpt-oss")
    run.add_argument("--show-reasoning", action="store_true", help="also stream the reasoning, to stderr")
    run.add_argument("--offline", action="store_true", help="use the local cache only, never the network")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object: prompt_token_ids, token_ids, text, reasoning, finish_reason, timings")
    run.add_argument("--json-answer", action="store_true",
                     help="JSON mode: the answer is one JSON object (decoding held to JSON; the model does not "
                          "think first)")
    run.add_argument("--json-schema", metavar="FILE", default=None,
                     help="like --json-answer, the object also held to the JSON schema in FILE")
    run.add_argument("-i", "--interactive", action="store_true",
                     help="a conversation: each line you type is a turn (the default with no question on a "
                          "terminal); /help lists its commands")
    _add_engine_args(run)
    run.set_defaults(func=cmd_run)

    from .bench import add_bench_command
    from .model_commands import add_model_commands

    add_model_commands(sub)
    add_bench_command(sub)
    return parser


def _sampling(args, model_dir: Path):
    """The flags, else what the checkpoint recommends (ModelSpec.sampling), else 1.0 / 1.0 / off."""
    from ..engine.runtime.request import SamplingParams
    from ..engine.spec import ModelSpec

    recommended = ModelSpec.from_dir(model_dir).sampling

    def pick(name: str, fallback):
        for value in (getattr(args, name), getattr(recommended, name)):
            if value is not None:
                return value
        return fallback

    return SamplingParams(temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                          top_k=int(pick("top_k", 0)), seed=args.seed, max_tokens=args.max_tokens)


def _request(args, model_dir: Path):
    from ..engine.runtime.request import ChatRequest, Message, TextPart

    from .ui_images import ImageLimits, ImageRejected, check_count

    try:
        check_count(len(args.image), ImageLimits())
    except ImageRejected as e:
        raise UserError(str(e)) from None
    images = _images(args.image)
    messages = []
    if args.system:
        messages.append(Message.text("system", args.system))
    messages.append(Message("user", (*images, TextPart(args.prompt))))
    schema = getattr(args, "schema", None)
    return ChatRequest(tuple(messages), _sampling(args, model_dir), thinking=not args.no_thinking,
                       reasoning_effort=args.reasoning_effort,
                       response_format="json_schema" if schema else "json_object" if args.json_answer else "text",
                       response_schema=schema)


def _images(paths: list[str]) -> list:
    """The image files as ImageParts, checked and (above ~2 MP) downscaled as the chat page and the
    API do (side by side), each downscale said on stderr; raises UserError saying what is wrong."""
    from .ui_images import ImageRejected, prepare_images

    files = [Path(path) for path in paths]
    for file in files:
        if not file.is_file():
            raise UserError(f"no such image file: {file}")
    try:
        prepared = prepare_images([(file.read_bytes(), file.name) for file in files])
    except ImageRejected as e:
        raise UserError(str(e)) from None
    for image in prepared:
        if image.note:
            print(f"note: {image.note}", file=sys.stderr)
    return [image.part for image in prepared]


def _schema(path: str):
    """The JSON schema in `path`, compiled (strict: what cannot be held to is refused)."""
    from ..engine.runtime.json_schema import SchemaError, compile_schema

    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read the schema file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise UserError(f"{path} is not JSON ({e}); --json-schema takes a file holding one JSON schema") from None
    try:
        return compile_schema(schema, name=Path(path).stem, strict=True)
    except SchemaError as e:
        raise UserError(f"{path}: {e}") from None


def _model_dir(args) -> Path:
    """A local checkpoint directory for MODEL, downloading it on first use ("demo": built on first use),
    after refuse_unrunnable (app/placement.py)."""
    refuse_unrunnable(args)
    return _local_checkpoint(args)


def _local_checkpoint(args, on_download=None) -> Path:
    """MODEL's checkpoint directory, downloaded on first use (on_download: engine.hub's progress
    callback); "demo" is built on first use (a directory of that name is still reachable as ./demo)."""
    from ..engine.hub import ensure_local
    from .demo import DEMO_NAME, ensure_demo

    if args.model == DEMO_NAME:
        return ensure_demo()
    return Path(ensure_local(args.model, offline=args.offline or None, on_progress=on_download))


def _print_progress(done: int, total: int, file: str) -> None:
    print(f"\rloading {Path(file).name}: {done / max(total, 1):6.1%}", end="", file=sys.stderr, flush=True)


def _load_engine(args, model_dir: Path, on_load=None):
    """The Engine for model_dir; on_load(done_bytes, total_bytes, file) follows the loading, beside
    the terminal's progress line."""
    from ..engine.runtime.engine import Engine

    check_checkpoint_fits(args, model_dir)
    terminal = sys.stderr.isatty() and not getattr(args, "json", False)
    callbacks = [f for f in (_print_progress if terminal else None, on_load) if f is not None]

    def progress(done: int, total: int, file: str) -> None:
        for f in callbacks:
            f(done, total, file)

    engine = Engine(model_dir, device=args.device, dtype=args.dtype, max_context=args.max_context,
                    on_progress=progress if callbacks else None, name=args.model, tp=tp_size(args), ep=args.ep,
                    gpus=args.gpus, quantize=args.quantize)
    if terminal:
        print(file=sys.stderr)
    return engine


def _start_behind_page(args, sock, url: str):
    """Downloads, loads and warms up the model while the startup page (app/startup.py) shows how far
    it got at `url`, on `sock`; returns the ready Engine. A failure is shown on the page too before
    it is raised, so a user who started localchat from a launcher sees why in the browser."""
    import webbrowser

    from .startup import StartupServer, StartupStatus
    from .ui import is_loopback

    status = StartupStatus(args.model, show_errors=is_loopback(args.host))
    page = StartupServer(status, sock, api_key=args.api_key).start()
    print(f"localchat: page {url} (it shows the progress until {args.model} is ready)", file=sys.stderr)
    if not args.no_browser:
        webbrowser.open(url)
    try:
        model_dir = _local_checkpoint(args, on_download=status.download)
        status.load(0, 1, "")
        engine = _load_engine(args, model_dir, on_load=status.load)
        if engine.device.type == "cuda":
            status.warmup()
            print("localchat: compiling kernels and capturing decode graphs ...", end="", file=sys.stderr, flush=True)
            print(f" {engine.warmup():.1f} s", file=sys.stderr)
        status.ready()
        return engine
    except KeyboardInterrupt:
        status.failed("stopped from its terminal (Ctrl+C)")
        raise
    except Exception as e:
        # the errors main() prints as one line read the same on the page
        status.failed(str(e) if isinstance(e, _one_line_errors()) else f"{type(e).__name__}: {e}")
        status.wait_for_watchers()
        raise
    finally:
        page.stop()


def _run_model(args) -> None:
    """Sets args.model from `run MODEL`, `run --model MODEL` or `localchat --model MODEL run`; with a
    --model, a lone positional word is the question."""
    flag = args.run_model or args.model
    if args.run_model and args.model and args.run_model != args.model:
        raise UserError(f"two models given (--model {args.model} and --model {args.run_model}); give one")
    if flag is None:
        if args.target is None:
            raise UserError("no model: localchat run MODEL \"question\" (for example gpt-oss-20b, or demo)")
        args.model = args.target
        return
    if args.target is not None:
        if args.question is not None:
            raise UserError(f"two models given ({flag} with --model and {args.target} before the question); give one")
        args.question = args.target
    args.model = flag


def _given_question(args) -> str | None:
    """The question from PROMPT or --prompt, None when neither gives one."""
    if args.question is not None and args.prompt is not None:
        raise UserError("the question was given twice (as PROMPT and with --prompt); give it once")
    return args.prompt if args.prompt is not None else args.question


def _question(args) -> str:
    """The question from PROMPT, --prompt or standard input (when it is not a terminal)."""
    text = _given_question(args)
    if text is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no question: put it after the model name (localchat run MODEL \"...\"), give it with "
                            "--prompt, or pipe it in on standard input")
        text = sys.stdin.read().strip()
        if not text:
            raise UserError("the question on standard input is empty")
    return text


def cmd_run(args) -> int:
    from ..engine.runtime.request import Delta, Final

    _run_model(args)
    asked = args.question is not None or args.prompt is not None
    if args.interactive or (not asked and sys.stdin is not None and sys.stdin.isatty()):
        return _converse(args)
    args.prompt = _question(args)  # before any download or load, so a missing question fails at once
    args.schema = _schema(args.json_schema) if args.json_schema else None  # likewise a schema it cannot follow
    model_dir = _model_dir(args)
    request = _request(args, model_dir)
    engine = _load_engine(args, model_dir)
    token_ids: list[int] = []
    text, reasoning = [], []
    final = None
    stream = engine.submit(request)
    try:
        for item in stream:
            if isinstance(item, Delta):
                token_ids.extend(item.token_ids)
                text.append(item.text)
                reasoning.append(item.reasoning)
                if not args.json:
                    if item.reasoning and args.show_reasoning:
                        print(item.reasoning, end="", file=sys.stderr, flush=True)
                    if item.text:
                        print(item.text, end="", flush=True)
            elif isinstance(item, Final):
                final = item
    finally:
        stream.close()
        # Stop the engine thread before the interpreter exits, not while it is mid-step.
        engine.shutdown()
    if final.finish_reason == "error":
        raise UserError(final.error)
    if args.json:
        t = final.timings
        print(json.dumps({
            "prompt_token_ids": list(final.prompt_token_ids), "token_ids": token_ids,
            "text": "".join(text), "reasoning": "".join(reasoning), "finish_reason": final.finish_reason,
            "timings": {"image_encode_s": t.image_encode, "prefill_s": t.prefill, "first_token_s": t.first_token,
                        "ttft_s": t.ttft, "decode_s": t.decode, "decode_tokens_per_s": t.decode_tokens_per_s},
        }))
    else:
        print()
        if final.finish_reason == "length" and (args.json_answer or args.json_schema):
            print(f"localchat: the JSON object was cut off: --max-tokens {args.max_tokens} ran out before it "
                  "closed; raise --max-tokens", file=sys.stderr)
        elif final.finish_reason == "length" and not "".join(text).strip() and "".join(reasoning).strip():
            shown = "" if args.show_reasoning else " (--show-reasoning prints its reasoning)"
            print(f"localchat: no answer yet: --max-tokens {args.max_tokens} ran out while the model was still "
                  f"thinking{shown}; raise --max-tokens", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .demo import DEMO_NAME, DEMO_NOTE
    from .ui import bind_listener, is_loopback, page_url, serve

    if not is_loopback(args.host) and not (args.auth and args.api_key):
        # Checked before a model loads, so the refusal comes at once.
        raise UserError(f"listening on {args.host} exposes your chats to the network: pass --auth USER:PASSWORD "
                        "(for the page) and --api-key KEY (for /v1), or keep the default 127.0.0.1")
    sock = bind_listener(args.host, args.port)  # a busy port is said at once, not after the model loads
    if args.backend:
        from .remote import RemoteEngine

        engine = RemoteEngine(args.backend, api_key=args.backend_key, model=args.model)
        info = engine.info()  # an unreachable or refusing server stops here, not at the first chat
        print(f"localchat: chatting with {info.name} at {engine.base_url}", file=sys.stderr)
    else:
        if args.model is None:
            args.model = default_model()
            print(f"localchat: using {args.model} (pass --model to choose)", file=sys.stderr)
        refuse_unrunnable(args)  # before the page opens: a refusal needs no browser
    auth = tuple(args.auth.split(":", 1)) if args.auth else None
    note = DEMO_NOTE if args.model == DEMO_NAME and not args.backend else None
    with _Interrupts() as interrupts:
        if not args.backend:
            engine = _start_behind_page(args, sock, page_url(args.host, sock))
        # the startup page already opened the browser where a model loaded here
        serve(engine, host=args.host, port=args.port, auth=auth, api_key=args.api_key,
              open_browser=not args.no_browser and bool(args.backend), demo_note=note, sock=sock,
              stop_requested=lambda: interrupts.seen)
    if interrupts.seen:
        raise KeyboardInterrupt
    return 0


class _Interrupts:
    """Ctrl+C while localchat starts: raised as KeyboardInterrupt as usual, and remembered too,
    because Python drops an exception raised inside a finalizer (an event loop collected on the
    main thread, say), which would lose the Ctrl+C and start the chat page anyway. The chat page's
    server takes SIGINT over once it runs."""

    def __init__(self):
        self.seen = False
        self._previous = None

    def _handle(self, signum, frame):
        self.seen = True
        raise KeyboardInterrupt

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _one_line_errors() -> tuple[type[Exception], ...]:
    """The errors whose message says what to do: printed as one line, without a traceback."""
    from ..engine.hub_errors import HubError

    return UserError, HubError, FileNotFoundError, ValueError, RuntimeError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "run" and args.question is None and len(extra) == 1 and not extra[0].startswith("-"):
        # argparse fills run's positionals from their first run of words only, so a question after
        # options (`run MODEL --image a.png "What is it?"`) comes back here
        args.question = extra[0]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except _one_line_errors() as e:
        print(f"localchat: {e}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1


def _converse(args) -> int:
    """`localchat run MODEL --interactive`: a conversation in the terminal (app/cli_chat.py)."""
    from ..engine.runtime.request import ChatRequest, ImagePart, Message
    from .cli_chat import HELP, TerminalChat

    if args.json or args.json_answer or args.json_schema:
        raise UserError("--json, --json-answer and --json-schema answer one question; leave them out of a "
                        "conversation (--interactive)")
    first = _given_question(args)

    def load_image(path: str) -> ImagePart:
        try:
            return _images([path])[0]
        except UserError as e:
            raise ValueError(str(e)) from None

    images = _images(args.image)  # before the load, as for one question
    model_dir = _model_dir(args)
    template = ChatRequest((Message.text("system", args.system),) if args.system else (), _sampling(args, model_dir),
                           thinking=not args.no_thinking, reasoning_effort=args.reasoning_effort)
    engine = _load_engine(args, model_dir)
    chat = TerminalChat(engine, template, load_image, show_reasoning=args.show_reasoning)
    chat.images = images
    terminal = sys.stdin.isatty()
    if terminal:
        print(f"localchat: {args.model}. {HELP}", file=sys.stderr)

    def read_line(prompt: str) -> str:
        if terminal:
            if sys.stdout.isatty():
                return input(prompt)
            print(prompt, end="", file=sys.stderr, flush=True)  # answers go to a file or pipe, prompts do not
            return input()
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")

    try:
        chat.run(read_line, first)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
