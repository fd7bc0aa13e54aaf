"""`--model demo`: the tiny random-weight GLM checkpoint, its files, the engine on it and the CLI."""
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from safetensors import safe_open

from localchat.app.demo import DEMO_VERSION, ensure_demo
from localchat.engine.runtime.request import ChatRequest, Delta, Final, ImagePart, Message, SamplingParams, TextPart

SCRIPT = shutil.which("localchat", path=str(Path(sys.executable).parent)) or shutil.which("localchat")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo(tmp_path_factory.mktemp("demo"))


def test_demo_has_the_real_on_disk_layout_and_is_built_once(demo_dir):
    assert demo_dir.name == f"v{DEMO_VERSION}"
    index = json.loads((demo_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    expert = "model.language_model.layers.2.mlp.experts.7.down_proj.weight"
    bias = "model.language_model.layers.1.mlp.gate.e_score_correction_bias"
    with safe_open(str(demo_dir / index["weight_map"][expert]), "pt") as f:
        assert str(f.get_slice(expert).get_dtype()) == "BF16" and f.get_slice(expert).get_shape() == [64, 32]
    with safe_open(str(demo_dir / index["weight_map"][bias]), "pt") as f:
        assert f.get_slice(bias).get_dtype() == "F32"
    config = json.loads((demo_dir / "config.json").read_text())
    assert config["model_type"] == "glm4v_moe" and config["architectures"] == ["Glm4vMoeForConditionalGeneration"]
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        assert (demo_dir / name).is_file(), name
    stamp = (demo_dir / "config.json").stat().st_mtime_ns
    assert ensure_demo(demo_dir.parent) == demo_dir
    assert (demo_dir / "config.json").stat().st_mtime_ns == stamp  # cached, not rebuilt


def test_engine_on_cpu_answers_an_image_question_with_varied_tokens(demo_dir):
    from localchat.engine.runtime.engine import Engine

    engine = Engine(demo_dir, device="cpu", name="demo")
    try:
        info = engine.info()
        assert (info.name, info.family, info.supports_images, info.placement) == ("demo", "glm4v_moe", True, "cpu")
        buf = io.BytesIO()
        Image.new("RGB", (120, 90), (30, 160, 200)).save(buf, "PNG")
        request = ChatRequest((Message("user", (ImagePart.from_bytes(buf.getvalue()), TextPart("What is this?"))),),
                              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=80, seed=3))
        items = list(engine.submit(request))
    finally:
        engine.shutdown()
    final = items[-1]
    assert isinstance(final, Final) and final.finish_reason in ("stop", "length"), final
    image_id = json.loads((demo_dir / "config.json").read_text())["image_token_id"]
    assert final.prompt_token_ids.count(image_id) > 1  # the image was expanded to its grid's tokens
    ids = [t for d in items[:-1] if isinstance(d, Delta) for t in d.token_ids]
    # An answer that ends on the end-of-text token counts it but does not show it.
    assert len(ids) == final.completion_tokens - (final.finish_reason == "stop") >= 1
    assert len(set(ids)) > 5, ids  # varied text, not one token repeated
    reasoning = "".join(d.reasoning for d in items[:-1])
    text = "".join(d.text for d in items[:-1])
    assert reasoning.strip() and text.strip(), "the demo thinks first, then answers, as GLM does"
    assert "<think>" not in text + reasoning and "</think>" not in text + reasoning


def test_demo_without_thinking_answers_directly(demo_dir):
    from localchat.engine.runtime.engine import Engine

    engine = Engine(demo_dir, device="cpu", name="demo")
    try:
        request = ChatRequest((Message.text("user", "Hello"),), SamplingParams(max_tokens=40, seed=1), thinking=False)
        items = list(engine.submit(request))
    finally:
        engine.shutdown()
    assert not "".join(d.reasoning for d in items[:-1]) and "".join(d.text for d in items[:-1]).strip()


def test_cli_run_demo_json(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    out = subprocess.run([SCRIPT, "run", "demo", "--prompt", "hi", "--json", "--max-tokens", "8", "--seed", "1"],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] in ("stop", "length") and 1 <= len(result["token_ids"]) <= 8
    assert (tmp_path / "localchat" / "demo" / f"v{DEMO_VERSION}" / "config.json").is_file()


def test_serve_demo_shows_the_note(monkeypatch, tmp_path):
    from localchat.app import cli, ui

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    seen = {}
    monkeypatch.setattr(ui, "serve", lambda engine, **kw: seen.update(engine=engine, **kw))
    assert cli.main(["--model", "demo", "--no-browser", "--device", "cpu"]) == 0
    try:
        assert seen["demo_note"].startswith("Demo model: random weights")
        assert seen["engine"].info().name == "demo" and seen["open_browser"] is False
    finally:
        seen["engine"].shutdown()
