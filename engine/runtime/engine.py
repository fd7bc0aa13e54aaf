"""Engine: the one public entry for app/ (UI, API, CLI). Loads a checkpoint and serves chat
requests as streams of Deltas ending in one Final.

Requests run one at a time on a worker thread, in order of arrival; closing a stream aborts its
request before the next token.
"""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import torch

from ..models import build_model
from ..spec import ModelSpec
from ..weights.loader import load_weights
from .generate import StepTimes, generate
from .prompt import ChatFormatter
from .request import ChatRequest, Delta, Final, ModelInfo, StreamItem, Timings
from .sampling import Sampler
from .textstream import TextAssembler


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible to torch; "
                           "use --device cpu (slow, for small checkpoints) or check the NVIDIA driver")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]


class _Stream:
    def __init__(self, request: ChatRequest):
        self.request = request
        self.items: queue.Queue = queue.Queue()
        self.aborted = threading.Event()
        self.done = False

    def __iter__(self):
        while not self.done:
            item = self.items.get()
            if isinstance(item, Final):
                self.done = True
            yield item

    def close(self) -> None:
        self.aborted.set()


class Engine:
    def __init__(self, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto",
                 max_context: int | None = None, on_progress=None, name: str | None = None):
        self.path = Path(model_dir)
        self.name = name or self.path.name
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.spec = ModelSpec.from_dir(self.path)
        self.max_context = min(max_context or self.spec.max_position_embeddings, self.spec.max_position_embeddings)
        self.formatter = ChatFormatter(self.path, self.spec)
        weights = load_weights(self.path, self.spec, device=self.device, dtype=self.dtype, on_progress=on_progress)
        self.weights_bytes = sum(_nbytes(w) for w in weights.values())
        self.model = build_model(self.spec, weights, self.device)
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="localchat-engine", daemon=True)
        self._worker.start()

    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name, family=self.spec.family, context_length=self.max_context,
            supports_images=self.spec.vision is not None,
            reasoning="thinking" if self.spec.family == "glm4v_moe" else "effort",
            placement=str(self.device), weights_bytes=self.weights_bytes)

    def submit(self, request: ChatRequest) -> _Stream:
        stream = _Stream(request)
        self._jobs.put(stream)
        return stream

    def _run(self) -> None:
        while True:
            stream = self._jobs.get()
            try:
                self._serve(stream)
            except Exception as e:  # a failed request must not take the engine down with it
                stream.items.put(Final("error", 0, 0, Timings(), error=f"{type(e).__name__}: {e}"))

    def _serve(self, stream: _Stream) -> None:
        request, out = stream.request, stream.items
        if stream.aborted.is_set():
            out.put(Final("abort", 0, 0, Timings()))
            return
        prompt = self.formatter.build(request)
        sp = request.sampling
        sampler = Sampler(sp, self.device)
        text = TextAssembler(self.formatter.tokenizer, self.spec.family, request.thinking, sp.stop)
        times = StepTimes()
        generated: list[int] = []
        finish = "length"
        for token in generate(self.model, prompt, sampler, self.spec.eos_token_ids, sp.max_tokens,
                              self.device, self.dtype, times, self.max_context):
            if stream.aborted.is_set():
                finish = "abort"
                break
            generated.append(token)
            if token in self.spec.eos_token_ids:
                finish = "stop"
                break
            answer, reasoning = text.push(token)
            if answer or reasoning:
                out.put(Delta(answer, reasoning, (token,)))
            else:
                out.put(Delta(token_ids=(token,)))
            if text.stopped:
                finish = "stop"
                break
        answer, reasoning = text.finish()
        if answer or reasoning:
            out.put(Delta(answer, reasoning))
        rate = times.decoded_tokens / times.decode if times.decode > 0 else 0.0
        out.put(Final(finish, len(prompt.input_ids), len(generated),
                      Timings(times.image_encode, times.prefill, times.first_token, times.decode, rate),
                      prompt_token_ids=tuple(prompt.input_ids)))


def _nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in vars(w).values() if isinstance(t, torch.Tensor))
