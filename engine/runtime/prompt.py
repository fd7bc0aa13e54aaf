"""Chat messages -> prompt token ids (and pixels), with the checkpoint's own tokenizer, chat
template and image processor settings through transformers (image_patches.py computes what the
image processor computes).

The template renders each image as one `<|image|>` placeholder; it is expanded here to the
number of LLM tokens the image processor's grid gives (t * h * w / merge^2), exactly as the
GLM-4.5V processor does. The processor class itself is not used because it cannot be built
without torchvision; the image processor alone can.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..spec import ModelSpec
from .constrained import json_answer_prefix
from .image_inputs import ImageInputs
from .image_patches import PatchRecipe
from .request import ChatRequest, ImagePart, Message, TextPart, ToolCall
from .tool_calls import forced_call_prefix


@dataclass
class Prompt:
    """input_ids [T]; for GLM with images, image_pixels[i] [3, H_i, W_i] uint8, image i resized as
    the processor does (the image cache's own tensors, so a turn's prompt copies none of them; the
    step runner makes patches of only the images still to encode), image_grid_thw [n_images, 3]
    and image_recipe, which makes the patches."""

    input_ids: list[int]
    image_pixels: tuple[torch.Tensor, ...] = ()
    image_grid_thw: torch.Tensor | None = None
    image_hashes: tuple[str, ...] = field(default_factory=tuple)
    image_recipe: PatchRecipe | None = None

    @property
    def pixel_values(self) -> torch.Tensor | None:
        """Every image's patches in one tensor [sum N_i, C*T*P*P] float32 on the CPU, as the processor
        returns them for the images in one call; None without images."""
        return self.image_recipe.patches(self.image_pixels) if self.image_pixels else None


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_image_processor(path: str | Path):
    from transformers import AutoImageProcessor

    # Without torchvision transformers falls back to the PIL backend and says so at warning level.
    quiet = logging.getLogger("transformers").level
    try:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        return AutoImageProcessor.from_pretrained(str(path))
    finally:
        logging.getLogger("transformers").setLevel(quiet)


def _images(request: ChatRequest) -> list[ImagePart]:
    """The request's images in the order the chat template places them."""
    return [p for m in request.messages for p in m.content if isinstance(p, ImagePart)]


def _defuse(text: str, specials: tuple[str, ...]) -> str:
    """Text from a person (or an earlier answer) that spells a special token, e.g. "<|image|>",
    must stay text: a zero-width space after its first character stops the tokenizer matching it."""
    for tok in specials:
        if tok in text:
            text = text.replace(tok, tok[0] + "\u200b" + tok[1:])
    return text


def _arguments(call: ToolCall):
    """A call's arguments as the templates want them: a mapping (they write it out as JSON, or
    argument by argument); text that is not a JSON object stays text."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


def _hf_messages(messages: tuple[Message, ...], family: str, specials: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for m in messages:
        parts = []
        for p in m.content:
            if isinstance(p, ImagePart):
                parts.append({"type": "image"})
            elif isinstance(p, TextPart):
                parts.append({"type": "text", "text": _defuse(p.text, specials)})
        if family == "gpt_oss" or m.role != "user":
            # Only GLM user turns take images; other turns are plain strings for every template.
            content = "".join(p["text"] for p in parts if p["type"] == "text")
        else:
            content = parts
        msg = {"role": m.role, "content": content}
        if m.role == "assistant" and m.reasoning:
            msg["reasoning_content"] = m.reasoning  # GLM templates
            msg["thinking"] = m.reasoning  # gpt-oss template
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                                 for c in m.tool_calls]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return _one_call_a_message(out) if family == "gpt_oss" else out


def _one_call_a_message(messages: list[dict]) -> list[dict]:
    """gpt-oss's template renders one call per assistant message and names each result after the
    call before it: an assistant message with several calls becomes one message per call, each
    followed by its result (matched by tool_call_id). The template also refuses a call message
    with both text and thinking; the thinking is what the model wrote before calling, so it stays."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        calls = m.get("tool_calls") or []
        if m["role"] != "assistant" or not calls:
            out.append(m)
            i += 1
            continue
        if m.get("thinking"):
            m = {**m, "content": ""}
        results = []
        while i + 1 < len(messages) and messages[i + 1]["role"] == "tool":
            results.append(messages[i + 1])
            i += 1
        i += 1
        for n, call in enumerate(calls):
            # the thinking and text once, before the first call
            first = {k: v for k, v in m.items() if k != "tool_calls"} if n == 0 else {"role": "assistant", "content": ""}
            out.append({**first, "tool_calls": [call]})
            out += [r for r in results if r.get("tool_call_id") == call["id"]]
        out += [r for r in results if r.get("tool_call_id") not in {c["id"] for c in calls}]
    return out


def _template_tool(tool: dict) -> dict:
    """An OpenAI tool entry with every field the templates read (gpt-oss's writes the description
    and the parameters' properties unguarded)."""
    fn = dict(tool.get("function", tool))
    fn.setdefault("description", "")
    if not isinstance(fn.get("parameters"), dict):
        fn["parameters"] = {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


class ChatFormatter:
    def __init__(self, path: str | Path, spec: ModelSpec):
        self.spec = spec
        self.tokenizer = load_tokenizer(path)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{path} has no chat template (tokenizer_config.json or chat_template.jinja); "
                             "the checkpoint is incomplete: download it again")
        self.image_inputs = (ImageInputs(PatchRecipe.from_processor(load_image_processor(path)))
                             if spec.vision is not None else None)
        added = [t.content for t in self.tokenizer.added_tokens_decoder.values()]
        self.special_texts = tuple(sorted({t for t in added if len(t) > 1}, key=len, reverse=True))

    def answer_prefix(self, request: ChatRequest) -> str:
        """The part of the answer the prompt already holds: the start of a forced call, or in JSON
        mode gpt-oss's final-channel header ("" when the model decides). The output parser must
        read a forced call's start before the generated text."""
        if request.response_format != "text":
            return json_answer_prefix(self.spec.family)
        return forced_call_prefix(self.spec.family, request.forced_call, request.tools)

    def thinks(self, request: ChatRequest) -> bool:
        """Whether GLM thinks before answering. A forced call starts the answer, so the think block
        before it is closed empty (gpt-oss likewise goes to the call's channel, skipping analysis);
        so does JSON mode, whose constraint holds for the answer only."""
        return request.thinking and request.forced_call is None and request.response_format == "text"

    def render(self, request: ChatRequest) -> str:
        prefix = self.answer_prefix(request)
        kwargs = {"enable_thinking": self.thinks(request)} if self.spec.family == "glm4v_moe" else {
            "reasoning_effort": request.reasoning_effort}
        if request.tools:
            kwargs["tools"] = [_template_tool(t) for t in request.tools]
        return self.tokenizer.apply_chat_template(
            _hf_messages(request.messages, self.spec.family, self.special_texts), tokenize=False,
            add_generation_prompt=True, **kwargs) + prefix

    def prepare_images(self, request: ChatRequest) -> None:
        """Runs the image processor on the request's images not yet seen, so that build (which the
        engine calls under its tokenizer lock) finds their patches kept."""
        images = _images(request)
        if images and self.image_inputs is not None:
            self.image_inputs(images)

    def build(self, request: ChatRequest) -> Prompt:
        images = _images(request)
        if images and self.image_inputs is None:
            raise ValueError(f"{self.spec.family} does not read images; send text only or use a GLM-4.5V model")
        ids = self.tokenizer(self.render(request), add_special_tokens=False)["input_ids"]
        if not images:
            return Prompt(ids)
        pixels, grid = self.image_inputs(images)
        merge = self.spec.vision.spatial_merge_size
        image_id = self.spec.image_tokens.image
        if ids.count(image_id) != len(images):
            raise ValueError(f"the chat template rendered {ids.count(image_id)} image placeholders for "
                             f"{len(images)} images")
        counts = iter((grid.prod(-1) // merge**2).tolist())
        expanded: list[int] = []
        for t in ids:
            expanded.extend([image_id] * next(counts) if t == image_id else [t])
        return Prompt(expanded, pixels, grid, tuple(p.sha256 for p in images), self.image_inputs.recipe)
