"""The engine against the transformers implementation on every tiny checkpoint, in float32.

Quantized checkpoints are read by the engine in their native format; transformers runs the same
model with the dequantized weights. Checked: prompt token ids (text, one image, two images),
prompt logits, and greedy continuations.
"""
import numpy as np
import pytest
import torch
from PIL import Image

from fixtures import FIXTURE_NAMES, load_oracle, open_fixture
from localchat.engine.models import build_model
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.engine.runtime.kv_cache import PagedKVCache
from localchat.engine.runtime.prompt import ChatFormatter
from localchat.engine.runtime.request import ChatRequest, ImagePart, Message, TextPart
from localchat.engine.spec import ModelSpec
from localchat.engine.weights.loader import load_weights

GLM = [n for n in FIXTURE_NAMES if n.startswith("glm")]
OSS = [n for n in FIXTURE_NAMES if n.startswith("gpt-oss")]
BLOCK = 16


def image(seed: int, size=(64, 48)) -> ImagePart:
    pixels = np.random.RandomState(seed).randint(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    import io
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return ImagePart.from_bytes(buf.getvalue())


def request(text: str, images=(), system: str | None = None) -> ChatRequest:
    msgs = [Message.text("system", system)] if system else []
    msgs.append(Message("user", (*images, TextPart(text))))
    return ChatRequest(tuple(msgs))


class EngineSide:
    """The engine's model loaded from a fixture, with a greedy loop over the paged cache."""

    def __init__(self, name: str):
        path = open_fixture(name)
        self.spec = ModelSpec.from_dir(path)
        self.model = build_model(self.spec, load_weights(path, self.spec, dtype=torch.float32))
        self.formatter = ChatFormatter(path, self.spec)

    def prefill(self, prompt, cache, table):
        ids = torch.tensor(prompt.input_ids)
        if self.spec.family == "glm4v_moe":
            feats = None
            if prompt.pixel_values is not None:
                feats = self.model.encode_images(prompt.pixel_values, prompt.image_grid_thw)
            rope, delta = self.model.rope_positions(ids, prompt.image_grid_thw)
            h = self.model.embed(ids, feats)
        else:
            rope, delta, h = torch.arange(len(ids)), 0, self.model.embed(ids)
        batch = ForwardBatch.build([(table, 0, len(ids))], rope, BLOCK, "cpu")
        return self.model.logits(self.model.forward(h, batch, cache)), delta

    def greedy(self, prompt, n: int):
        """Prompt logits [T, V] and n greedy tokens (end-of-sequence ids are not special here)."""
        cache = PagedKVCache(self.spec.num_layers, 32, BLOCK, self.spec.num_kv_heads, self.spec.head_dim,
                             torch.float32, "cpu")
        table = list(range(32))
        logits, delta = self.prefill(prompt, cache, table)
        tokens, pos = [int(logits[-1].argmax())], len(prompt.input_ids)
        for _ in range(n - 1):
            batch = ForwardBatch.build([(table, pos, 1)], torch.tensor([pos + delta]), BLOCK, "cpu")
            h = self.model.forward(self.model.embed(torch.tensor(tokens[-1:])), batch, cache)
            tokens.append(int(self.model.logits(h)[-1].argmax()))
            pos += 1
        return logits, tokens


_engines: dict[str, EngineSide] = {}


def engine(name: str) -> EngineSide:
    if name not in _engines:
        _engines[name] = EngineSide(name)
    return _engines[name]


def oracle_inputs(name, prompt):
    ids = torch.tensor([prompt.input_ids])
    kw = {}
    if prompt.pixel_values is not None:
        spec = engine(name).spec
        kw = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw,
                  mm_token_type_ids=(ids == spec.image_tokens.image).int())
    return ids, kw


def oracle_greedy(name, prompt, n):
    oracle = load_oracle(name)
    ids, kw = oracle_inputs(name, prompt)
    with torch.no_grad():
        logits = oracle(input_ids=ids, **kw).logits[0]
        tokens = []
        seq = ids
        for _ in range(n):
            nxt = int(oracle(input_ids=seq, **kw).logits[0, -1].argmax())
            tokens.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
            if "mm_token_type_ids" in kw:
                kw["mm_token_type_ids"] = torch.cat([kw["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.int)], 1)
    return logits, tokens


def hf_processor_ids(name, req, images):
    """Prompt ids as transformers' own GLM-4.5V processor builds them (its video half, which
    needs torchvision, is left out)."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

    class ImageOnlyProcessor(Glm4vProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    path = open_fixture(name)
    tok = AutoTokenizer.from_pretrained(path)
    proc = ImageOnlyProcessor(image_processor=AutoImageProcessor.from_pretrained(path), tokenizer=tok,
                              video_processor=None, chat_template=tok.chat_template)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": req.messages[-1].content[-1].text}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    out = proc(text=[text], images=[im.image for im in images] or None, return_tensors="pt")
    return out["input_ids"][0].tolist()


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", GLM)
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_glm_prompt_ids_logits_and_greedy(name, n_images):
    side = engine(name)
    images = [image(i, size=(64 + 16 * i, 48)) for i in range(n_images)]
    req = request("What is shown here? Answer briefly.", images)
    prompt = side.formatter.build(req)
    assert prompt.input_ids == hf_processor_ids(name, req, images)
    assert prompt.input_ids.count(side.spec.image_tokens.image) == sum(
        int(g.prod()) // 4 for g in (prompt.image_grid_thw if images else []))
    logits, tokens = side.greedy(prompt, 16)
    ref_logits, ref_tokens = oracle_greedy(name, prompt, 16)
    assert rel(logits, ref_logits) < 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize("name", OSS)
def test_gpt_oss_logits_and_greedy_past_the_sliding_window(name):
    side = engine(name)
    window = side.spec.sliding_window
    req = request("Count the colours of the rainbow, one per line, and explain each in a few words.",
                  system="Be concise.")
    prompt = side.formatter.build(req)
    assert len(prompt.input_ids) > 2 * window  # the prompt alone is longer than the window
    logits, tokens = side.greedy(prompt, 16)
    ref_logits, ref_tokens = oracle_greedy(name, prompt, 16)
    assert rel(logits, ref_logits) < 1e-4
    assert tokens == ref_tokens


def test_gpt_oss_prompt_is_rendered_by_the_checkpoint_template():
    side = engine("gpt-oss-mxfp4")
    req = ChatRequest((Message.text("user", "hi"),), reasoning_effort="high")
    text = side.formatter.render(req)
    assert "Reasoning: high" in text and text.rstrip().endswith("<|start|>assistant")


def test_glm_thinking_switch_reaches_the_template():
    side = engine("glm-bf16")
    on = side.formatter.render(ChatRequest((Message.text("user", "hi"),), thinking=True))
    off = side.formatter.render(ChatRequest((Message.text("user", "hi"),), thinking=False))
    assert "/nothink" in off and "<think></think>" in off and "/nothink" not in on


def test_text_that_spells_a_special_token_stays_text():
    side = engine("glm-bf16")
    prompt = side.formatter.build(request("what does <|image|> or <think> mean?", [image(0)]))
    assert prompt.input_ids.count(side.spec.image_tokens.image) == int(prompt.image_grid_thw.prod()) // 4
    think = side.formatter.tokenizer.convert_tokens_to_ids("<think>")
    assert think not in prompt.input_ids
