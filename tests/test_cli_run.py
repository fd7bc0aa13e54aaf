"""`localchat run` through the installed console script, on the tiny checkpoints."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fixtures import open_fixture
from test_parity import engine, image, oracle_greedy, request

SCRIPT = shutil.which("localchat", path=str(Path(sys.executable).parent)) or shutil.which("localchat")


def run_cli(*args, timeout=120, stdin=""):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([SCRIPT, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                          input=stdin)


@pytest.mark.parametrize("name", ["glm-bf16", "glm-fp8-block", "gpt-oss-mxfp4", "gpt-oss-bf16"])
def test_run_json_reproduces_transformers_greedy_tokens(name, tmp_path):
    ckpt = open_fixture(name)
    args = ["run", ckpt, "--prompt", "Describe the picture.", "--temperature", "0", "--max-tokens", "12", "--json"]
    images = []
    if name.startswith("glm"):
        img = image(3)
        path = tmp_path / "a.png"
        img.image.save(path)
        images = [img]
        args += ["--image", path]
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    side = engine(name)
    prompt = side.formatter.build(request("Describe the picture.", images))
    assert result["prompt_token_ids"] == prompt.input_ids
    _, ref = oracle_greedy(name, prompt, 12)
    eos = set(side.spec.eos_token_ids)
    expected = ref[: next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))]
    assert result["token_ids"] == expected
    assert result["finish_reason"] == ("stop" if expected[-1] in eos else "length")
    assert set(result["timings"]) >= {"prefill_s", "ttft_s", "decode_tokens_per_s"}


def test_run_streams_plain_text():
    out = run_cli("run", open_fixture("gpt-oss-bf16"), "--prompt", "hi", "--temperature", "0", "--max-tokens", "5")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")


def test_an_answer_cut_off_while_thinking_says_so():
    out = run_cli("run", "demo", "hi", "--temperature", "0", "--max-tokens", "3")
    assert out.returncode == 0 and out.stdout.strip() == ""
    assert "--max-tokens 3 ran out while the model was still thinking" in out.stderr
    room = run_cli("run", "demo", "hi", "--temperature", "0", "--max-tokens", "40", "--json")
    assert json.loads(room.stdout)["text"] and "ran out" not in room.stderr


def test_the_question_after_the_model_or_on_standard_input():
    ckpt = open_fixture("gpt-oss-bf16")
    greedy = ["--temperature", "0", "--max-tokens", "6", "--json"]
    with_flag = json.loads(run_cli("run", ckpt, "--prompt", "Why is the sky blue?", *greedy).stdout)
    positional = run_cli("run", ckpt, "Why is the sky blue?", *greedy)
    piped = run_cli("run", ckpt, *greedy, stdin="Why is the sky blue?\n")
    after_options = run_cli("run", ckpt, *greedy, "Why is the sky blue?")
    for out in (positional, piped, after_options):
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["prompt_token_ids"] == with_flag["prompt_token_ids"]
        assert result["token_ids"] == with_flag["token_ids"]
    extra = run_cli("run", ckpt, "one", "--json", "two")
    assert extra.returncode == 2 and "unrecognized arguments: two" in extra.stderr
    twice = run_cli("run", ckpt, "one", "--prompt", "two")
    assert twice.returncode != 0 and "twice" in twice.stderr and "Traceback" not in twice.stderr
    empty = run_cli("run", ckpt, stdin="  \n")
    assert empty.returncode != 0 and "empty" in empty.stderr and "Traceback" not in empty.stderr


def test_the_model_with_a_flag_before_or_after_run():
    ckpt = open_fixture("gpt-oss-bf16")
    greedy = ["--temperature", "0", "--max-tokens", "4", "--json"]
    positional = json.loads(run_cli("run", ckpt, "Why is the sky blue?", *greedy).stdout)
    for args in (["run", "--model", ckpt, "Why is the sky blue?"], ["--model", ckpt, "run", "Why is the sky blue?"]):
        out = run_cli(*args, *greedy)
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert (result["prompt_token_ids"], result["token_ids"]) == (positional["prompt_token_ids"],
                                                                     positional["token_ids"])
    clash = run_cli("run", "--model", ckpt, "other-model", "a question")
    assert clash.returncode != 0 and "two models" in clash.stderr and "Traceback" not in clash.stderr
    none = run_cli("run", "--prompt", "hi")
    assert none.returncode != 0 and "no model" in none.stderr and "Traceback" not in none.stderr


def test_no_question_at_a_terminal_says_how_to_give_one(monkeypatch):
    from localchat.app.cli import UserError, _question, build_parser

    class Terminal:
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    with pytest.raises(UserError, match="after the model name"):
        _question(build_parser().parse_args(["run", "demo"]))


def test_run_downscales_a_large_image_as_the_chat_page_does(tmp_path):
    import numpy as np
    from PIL import Image

    big = tmp_path / "photo.png"
    Image.fromarray(np.random.RandomState(0).randint(0, 255, (1400, 1600, 3), dtype=np.uint8)).save(big)
    out = run_cli("run", open_fixture("glm-bf16"), "--prompt", "What is this?", "--image", big, "--temperature", "0",
                  "--max-tokens", "2", "--json")
    assert out.returncode == 0, out.stderr
    assert "note: photo.png was 1600×1400; downscaled to 1539×1346" in out.stderr
    too_many = run_cli("run", open_fixture("glm-bf16"), "--prompt", "hi", *[a for _ in range(9) for a in ("--image", big)])
    assert too_many.returncode != 0 and "9 images attached; the limit is 8" in too_many.stderr
    assert "Traceback" not in too_many.stderr


def test_run_errors_are_one_line(tmp_path):
    missing = run_cli("run", tmp_path / "nope", "--prompt", "hi")
    assert missing.returncode != 0 and "nope" in missing.stderr and "Traceback" not in missing.stderr
    not_image = tmp_path / "x.png"
    not_image.write_text("not an image")
    bad = run_cli("run", open_fixture("glm-bf16"), "--prompt", "hi", "--image", not_image)
    assert bad.returncode != 0 and "not an image" in bad.stderr and "Traceback" not in bad.stderr
    incomplete = tmp_path / "ckpt"
    shutil.copytree(open_fixture("gpt-oss-mxfp4"), incomplete)
    (incomplete / "model-00001-of-00002.safetensors").unlink()
    broken = run_cli("run", incomplete, "--prompt", "hi")
    assert broken.returncode != 0 and "model-00001-of-00002.safetensors" in broken.stderr
    assert "Traceback" not in broken.stderr


def test_listening_beyond_localhost_needs_auth_and_a_key():
    out = run_cli("--listen", "0.0.0.0", "--model", "demo", "--no-browser", timeout=60)
    assert out.returncode == 2 and "--auth" in out.stderr and "--api-key" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_busy_port_is_said_before_the_model_loads():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = run_cli("--model", "no-such-model-is-loaded", "--port", port, "--no-browser", "--offline", timeout=60)
    assert out.returncode == 1 and f"port {port}" in out.stderr and "in use" in out.stderr
    assert "Traceback" not in out.stderr and "page http" not in out.stdout


def test_gpus_that_cannot_run_a_model_are_named_before_loading(monkeypatch):
    # an A100 runs gpt-oss but not FP8 weights; a V100 runs nothing (the planner's reasons)
    from localchat.app.cli import UserError, _model_dir, _run_model, build_parser
    from localchat.app.placement import check_checkpoint_fits, default_model
    from localchat.engine import planner
    a100 = [planner.GpuInfo("NVIDIA A100-SXM4-80GB", 80 << 30, 79 << 30, i, (8, 0)) for i in range(2)]
    monkeypatch.setattr(planner, "local_gpus", lambda: a100)
    assert default_model() == "gpt-oss-120b"
    args = build_parser().parse_args(["run", str(open_fixture("glm-fp8-block")), "--prompt", "hi"])
    _run_model(args)
    with pytest.raises(UserError, match=r"cannot run on GPU 0: FP8 weights need .* compute capability 8.9"):
        check_checkpoint_fits(args, Path(args.model))
    # a registry model before its download (none happens: the check comes first)
    registry = build_parser().parse_args(["run", "glm-4.5v-fp8", "--prompt", "hi"])
    _run_model(registry)
    with pytest.raises(UserError, match=r"glm-4.5v-fp8 cannot run on GPU 0: FP8 weights need"):
        _model_dir(registry)
    monkeypatch.setattr(planner, "local_gpus", lambda: [planner.GpuInfo("Tesla V100", 32 << 30, 31 << 30, 0, (7, 0))])
    with pytest.raises(UserError, match=r"compute capability 8.0 or newer .* Tesla V100 is 7.0"):
        default_model()


def test_run_quantizes_a_bf16_checkpoint_to_fp8_while_loading():
    out = run_cli("run", open_fixture("glm-bf16"), "--prompt", "Hello", "--temperature", "0", "--max-tokens", "4",
                  "--json", "--quantize", "fp8")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["token_ids"] and result["finish_reason"] in ("stop", "length")
    again = run_cli("run", open_fixture("gpt-oss-mxfp4"), "--prompt", "Hello", "--quantize", "fp8")
    assert again.returncode != 0 and "already quantized" in again.stderr and "Traceback" not in again.stderr
    # a registry model, before anything is downloaded
    registry = run_cli("run", "gpt-oss-20b", "--prompt", "Hello", "--quantize", "fp8")
    assert registry.returncode != 0 and "gpt-oss-20b is mxfp4 already" in registry.stderr


def test_a_model_that_needs_several_gpus_is_split_over_them_unless_told_otherwise(monkeypatch, capsys):
    # two 80 GB GPUs: GLM-4.5V-FP8 (102 GiB of weights) needs both, gpt-oss-20b one
    from localchat.app.cli import UserError, build_parser
    from localchat.app.placement import default_model, refuse_unrunnable
    from localchat.engine import planner
    h100 = [planner.GpuInfo("NVIDIA H100 80GB HBM3", 80 << 30, 79 << 30, i, (9, 0)) for i in range(2)]
    monkeypatch.setattr(planner, "local_gpus", lambda: h100)
    args = build_parser().parse_args([])
    args.model = default_model()
    refuse_unrunnable(args)  # the planner's pick runs where it was planned, not refused for GPU 0 alone
    assert (args.model, args.tp, args.gpus) == ("glm-4.5v-fp8", 2, [0, 1])
    assert "split over GPUs 0,1" in capsys.readouterr().err
    small = build_parser().parse_args(["--model", "gpt-oss-20b"])
    refuse_unrunnable(small)
    assert (small.tp, small.gpus) == (None, None)
    # GPU 0 taken (another model on it): one that fits a single GPU goes where there is room
    busy = [planner.GpuInfo("NVIDIA H100 80GB HBM3", 80 << 30, 5 << 30, 0, (9, 0)), h100[1]]
    monkeypatch.setattr(planner, "local_gpus", lambda: busy)
    moved = build_parser().parse_args(["--model", "gpt-oss-20b"])
    refuse_unrunnable(moved)
    assert (moved.tp, moved.gpus) == (None, [1]) and "goes on GPU 1" in capsys.readouterr().err
    monkeypatch.setattr(planner, "local_gpus", lambda: h100)
    # a GPU the user chose stays the choice, and the refusal says how to use both
    pinned = build_parser().parse_args(["--model", "glm-4.5v-fp8", "--gpus", "1"])
    with pytest.raises(UserError, match=r"does not fit GPU 1: .*this machine has 2 GPUs: --tp 2 splits"):
        refuse_unrunnable(pinned)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the model would be downloaded")
def test_a_registry_model_without_a_gpu_is_refused_before_its_download(tmp_path):
    out = run_cli("run", "gpt-oss-120b", "--prompt", "Hello", timeout=60)
    assert out.returncode == 2 and "gpt-oss-120b needs a CUDA GPU" in out.stderr and "--device cpu" in out.stderr
    assert "Traceback" not in out.stderr and "Fetching" not in out.stderr


@pytest.mark.parametrize("argv,message", [
    (["run", "demo", "hi", "--temperature", "-1"], "--temperature: must be at least 0"),
    (["run", "demo", "hi", "--max-tokens", "0"], "--max-tokens: must be at least 1"),
    (["run", "demo", "hi", "--top-p", "0"], "--top-p: must be above 0 and at most 1"),
    (["run", "demo", "hi", "--top-k", "x"], "--top-k: 'x' is not an integer"),
    (["--tp", "0"], "--tp: must be at least 1"),
    (["--port", "70000"], "--port: must be at least 0 and at most 65535"),
])
def test_out_of_range_flags_are_refused_by_name(argv, message, capsys):
    from localchat.app.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_json_answer_is_one_json_object():
    out = run_cli("run", "demo", "Three colours, as JSON", "--json-answer", "--seed", "3", "--max-tokens", "300")
    assert out.returncode == 0, out.stderr
    assert isinstance(json.loads(out.stdout), dict)
    cut = run_cli("run", "demo", "Three colours, as JSON", "--json-answer", "--max-tokens", "1")
    assert cut.returncode == 0 and "the JSON object was cut off: --max-tokens 1 ran out" in cut.stderr, cut


def test_a_json_schema_answer_follows_the_schema(tmp_path):
    schema = {"type": "object", "properties": {"colours": {"type": "array", "maxItems": 3, "items": {
        "enum": ["red", "green", "blue"]}}}, "required": ["colours"], "additionalProperties": False}
    path = tmp_path / "colours.json"
    path.write_text(json.dumps(schema))
    out = run_cli("run", "demo", "Three colours, as JSON", "--json-schema", str(path), "--seed", "3",
                  "--max-tokens", "300")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert list(answer) == ["colours"] and set(answer["colours"]) <= {"red", "green", "blue"}
    # a schema it cannot follow is refused before anything loads
    path.write_text(json.dumps({"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9]+"}}}))
    bad = run_cli("run", "demo", "x", "--json-schema", str(path))
    assert bad.returncode != 0 and "'pattern' at #/properties/zip is not enforced by localchat" in bad.stderr
    assert "Traceback" not in bad.stderr
    path.write_text("{not json")
    bad = run_cli("run", "demo", "x", "--json-schema", str(path))
    assert bad.returncode != 0 and "is not JSON" in bad.stderr


def test_a_conversation_on_standard_input_keeps_its_turns():
    out = run_cli("run", "demo", "--interactive", "--max-tokens", "8", "--temperature", "0",
                  stdin="hello there\n/image nope.png\nand again\n")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("(cut at --max-tokens)") == 2 and out.stdout.strip()  # two answers of 8 tokens
    assert "(no such image file: nope.png)" in out.stderr and "Traceback" not in out.stderr
    refused = run_cli("run", "demo", "--interactive", "--json", stdin="hi\n")
    assert refused.returncode != 0 and "leave them out of a conversation" in refused.stderr
