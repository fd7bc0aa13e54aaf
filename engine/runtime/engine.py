"""Engine: the one public entry for app/ (UI, API, CLI). Loads a checkpoint and serves chat
requests as streams of Deltas ending in one Final.

`submit` may be called from any thread. The prompt is built in the caller's thread; one engine
thread then runs the scheduler (its loop: engine_loop.py): continuous batching of all running
requests over a paged KV cache with prefix reuse (see scheduler.py). Closing a stream aborts its
request; its blocks go back to the pool before the next step.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from pathlib import Path

import torch

from ..spec import ModelSpec
from .block_pool import BlockPool
from .constrained import JsonVocabulary, json_answer_for, strict_calls
from .context_fit import fit_to_context
from .chunk_graphs import ChunkGraphs
from .decode_graphs import DecodeGraphs
from .kv_budget import plan_kv_blocks
from .kv_cache import build_kv_cache
from .loading import describe_weights, load_model, resolve_device, resolve_dtype
from .prefix_cache import image_spans
from .prompt import ChatFormatter
from .request import ChatRequest, Final, ModelInfo, Timings
from .logprobs import TokenNames
from .sampling import Sampler
from .scheduler import Scheduler
from .sequence import EngineStream, Sequence
from .engine_loop import EngineLoop
from .step_runner import StepRunner
from .textstream import TextAssembler

log = logging.getLogger(__name__)


class Engine(EngineLoop):
    """Serving options (keyword-only): block_size tokens per KV block; num_blocks or max_kv_tokens
    size the KV pool (default: the GPU memory left after the weights, or 16k tokens on CPU); with
    sliding-window layers (gpt-oss) they size the full-attention layers' pool, which bounds each
    conversation's context, and num_sliding_blocks the sliding layers' pool (default: what the
    windows of max_running chats need, kv_budget.py; 0 keeps every layer in one pool, without
    releasing what the windows passed);
    max_batch_tokens is the per-step token budget (prefill chunk size; default 8192 on a GPU, 512 on
    the CPU), max_batch_tokens_while_decoding that of a step in which other chats are answering
    (default 2048 on a GPU, so their tokens keep coming while a long prompt is read; on the CPU
    max_batch_tokens); max_running caps the sequences decoded together. cuda_graphs (default: on
    for CUDA, on every rank) replays decode steps from captured graphs; each batch-size bucket is
    captured on first use, or all by `warmup()`. chunk_graphs (default: as cuda_graphs) does the
    same for the other steps of up to 256 tokens (a short turn, a prompt's tail beside other
    chats' tokens), by token-count bucket (chunk_graphs.py).
    decode_ahead (default on, with graphs in one process) launches each decode step before the
    previous one's tokens reach the host, so sampling, streaming and scheduling on the host
    overlap the GPU's next step instead of leaving it idle (not while a running request's tokens
    are chosen on the host: penalties, JSON mode).

    tp > 1 splits the model over tp processes, one per GPU (`gpus`, default 0..tp-1; on the CPU,
    tp processes), each reading only its slices of the checkpoint; ep splits the routed experts
    whole across them instead of slicing every expert (engine/parallel/). quantize "fp8" stores a
    bf16 checkpoint's decoder projections as FP8 with a scale per row while loading
    (weights/loader.py)."""

    workers = None  # the other ranks' processes (engine.parallel.group.WorkerGroup) when tp > 1

    def __init__(self, model_dir: str | Path, *, device: str = "auto", dtype: str = "auto",
                 max_context: int | None = None, on_progress=None, name: str | None = None,
                 tp: int = 1, ep: bool = False, gpus: list[int] | None = None, quantize: str | None = None,
                 **serving):
        path = Path(model_dir)
        spec = ModelSpec.from_dir(path)
        formatter = ChatFormatter(path, spec)
        self.path = path
        loaded = load_model(path, spec, device=device, dtype=dtype, on_progress=on_progress, tp=tp, ep=ep, gpus=gpus,
                            quantize=quantize)
        self.workers = loaded.workers
        try:
            self._setup(spec, loaded.model, formatter, loaded.device, loaded.dtype, name or path.name, max_context,
                        loaded.weights_bytes, weights_format=loaded.weights_format, **serving)
        except BaseException:
            if self.workers is not None:
                self.workers.close()
            raise

    @classmethod
    def from_model(cls, spec: ModelSpec, model, formatter, *, device: str = "cpu", dtype: str = "auto",
                   max_context: int | None = None, name: str = "model", weights_bytes: int = 0,
                   **serving) -> "Engine":
        """An engine over an already built model (tests, benchmarks); `formatter` is a ChatFormatter."""
        self = cls.__new__(cls)
        self.path = None
        dev = resolve_device(device)
        self._setup(spec, model, formatter, dev, resolve_dtype(dtype, dev), name, max_context, weights_bytes,
                    **serving)
        return self

    def _setup(self, spec, model, formatter, device, dtype, name, max_context, weights_bytes, *,
               block_size: int = 16, num_blocks: int | None = None, max_kv_tokens: int | None = None,
               num_sliding_blocks: int | None = None, max_batch_tokens: int | None = None,
               max_batch_tokens_while_decoding: int | None = None, max_running: int = 64,
               kv_headroom_bytes: int | None = None, cuda_graphs: bool | None = None,
               chunk_graphs: bool | None = None, decode_ahead: bool = True,
               weights_format: str | None = None) -> None:
        self.spec, self.model, self.formatter = spec, model, formatter
        self.token_names = TokenNames(formatter.tokenizer)  # the engine thread's, for logprob entries
        self.json_vocabulary = JsonVocabulary(formatter.tokenizer, spec.vocab_size, spec.eos_token_ids, device)
        self.weights_format = weights_format or describe_weights(spec, dtype)
        self.device, self.dtype, self.name = device, dtype, name
        self.weights_bytes = weights_bytes
        self.max_context = min(max_context or spec.max_position_embeddings, spec.max_position_embeddings)
        self.block_size = block_size
        # 8192 on a GPU: a long prompt's first token 11-23% sooner than in 2048-token chunks (H100:
        # gpt-oss-120b 16K tokens 923 -> 714 ms, 32K 2107 -> 1703 ms; H200: GLM-4.5V-FP8 16K 1238
        # -> 1100 ms; BENCHMARKS.md "Prefill chunks"): each chunk reads every layer's weights once,
        # for more tokens. Other chats answering at the time wait a step between tokens, so their
        # steps hold 2048 (gpt-oss-120b on an H100: ~0.1 s a step against ~0.36 s for 8192).
        self.max_batch_tokens = max_batch_tokens or (8192 if device.type == "cuda" else 512)
        while_decoding = max_batch_tokens_while_decoding
        if while_decoding is None:  # the scheduler refuses a value outside 1..max_batch_tokens
            while_decoding = min(2048, self.max_batch_tokens) if device.type == "cuda" else self.max_batch_tokens
        kv_heads = getattr(model, "kv_heads", spec.num_kv_heads)  # this rank's share under tensor parallelism
        plan = plan_kv_blocks(spec, dtype, device, block_size, max_context=self.max_context,
                              max_batch_tokens=self.max_batch_tokens, max_running=max_running,
                              num_blocks=num_blocks, max_kv_tokens=max_kv_tokens,
                              num_sliding_blocks=num_sliding_blocks, headroom_bytes=kv_headroom_bytes,
                              kv_heads=kv_heads, mem_info=self.workers.mem_info if self.workers else None)
        n = plan.num_blocks
        use_graphs = cuda_graphs if cuda_graphs is not None else device.type == "cuda"
        use_chunks = chunk_graphs if chunk_graphs is not None else use_graphs
        # With graphs, one block beyond the pool: the scratch block that padded rows write to (the
        # sliding group always has one: its placeholder, see kv_cache.py).
        self.cache = build_kv_cache(spec, n + int(use_graphs or use_chunks), block_size, kv_heads, dtype, device,
                                    plan.num_sliding_blocks)
        self.pool = BlockPool(n)
        self.sliding_pool = BlockPool(plan.num_sliding_blocks) if plan.num_sliding_blocks else None
        self.scheduler = Scheduler(self.pool, block_size, self.max_batch_tokens, max_running, self.sliding_pool,
                                   spec.sliding_window if self.sliding_pool is not None else None,
                                   max_batch_tokens_while_decoding=while_decoding)
        graphs = chunks = None
        max_blocks, mrope = -(-self.context_limit // block_size), spec.family == "glm4v_moe"
        if use_graphs:
            graphs = DecodeGraphs(model, self.cache, dtype, device, max_batch=max_running, max_blocks=max_blocks,
                                  scratch_block=n, mrope=mrope)
        if use_chunks:
            chunks = ChunkGraphs(model, self.cache, dtype, device, max_tokens=while_decoding, max_seqs=max_running,
                                 max_blocks=max_blocks, scratch_block=n, mrope=mrope)
        if self.workers is not None:  # every rank replays its own graphs; the collectives are inside
            self.runner = self.workers.step_runner(model, self.cache, device, dtype, graphs, chunks)
        else:
            self.runner = StepRunner(model, self.cache, device, dtype, graphs, chunks)
        log.info("KV cache: %d blocks of %d tokens%s (%.2f GiB)", n, block_size,
                 f", {plan.num_sliding_blocks} for the sliding-window layers" if self.sliding_pool else "",
                 self.cache.nbytes / 2**30)
        # Runs of decode steps launched one ahead of the host (single process, captured graphs).
        self.decode_ahead = decode_ahead and use_graphs and self.workers is None
        self._ids = itertools.count()
        self._format_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()  # Sequence, a callable for the engine thread, or None
        self._stopped = False
        self._fatal: str | None = None  # why the engine cannot serve any more (health())
        self._worker = threading.Thread(target=self._run, name="localchat-engine", daemon=True)
        self._worker.start()

    # ---- public API -------------------------------------------------------------------------

    @property
    def context_limit(self) -> int:
        """The most tokens one conversation may hold: the model's context or the whole KV pool."""
        return min(self.max_context, self.pool.num_blocks * self.block_size)

    def info(self) -> ModelInfo:
        # Every tensor-parallel rank allocates a cache shaped like rank 0's (its share of the KV heads).
        ranks = self.workers.world_size if self.workers else 1
        kv_bytes = self.cache.nbytes * ranks
        return ModelInfo(
            name=self.name, family=self.spec.family, context_length=self.context_limit,
            supports_images=self.spec.vision is not None,
            reasoning="thinking" if self.spec.family == "glm4v_moe" else "effort",
            placement=self.workers.placement if self.workers else str(self.device), weights_bytes=self.weights_bytes,
            kv_cache_bytes=kv_bytes, kv_cache_tokens=self.pool.num_blocks * self.block_size,
            kv_window_tokens=self.sliding_pool.num_blocks * self.block_size if self.sliding_pool else None,
            sampling=self.spec.sampling, weights_format=self.weights_format, vocab_size=self.spec.vocab_size)

    def submit(self, request: ChatRequest) -> EngineStream:
        """Queues a request; returns its stream at once. Refusals arrive as a Final("error")."""
        stream = EngineStream(request)
        if self._stopped or self._fatal:
            stream.items.put(Final("error", 0, 0, Timings(), error=self._fatal or "the engine has been shut down"))
            return stream
        try:
            seq = self._sequence(stream)
        except RequestTooLong as e:
            stream.items.put(Final("error", len(e.prompt_ids), 0, Timings(), tuple(e.prompt_ids), error=str(e)))
            return stream
        except Exception as e:  # a bad request must reach its own stream, not the caller's thread
            stream.items.put(Final("error", 0, 0, Timings(), error=f"{type(e).__name__}: {e}"))
            return stream
        self._inbox.put(seq)
        return stream

    def warmup(self) -> float:
        """On a GPU: compiles the prefill kernels for the usual prompt-chunk sizes and captures the
        decode graph of every batch-size bucket and the chunk graph of every token-count bucket now
        (a server does this before its first request, so no chat waits for either). Returns the
        seconds it took (0 on the CPU)."""
        if self.device.type != "cuda":
            return 0.0
        start = time.perf_counter()
        # a full chunk, and sizes on both sides of the kernels' tile choices (kernels/moe_config.py)
        usual = (self.max_batch_tokens, 2048, 512, 128, 32, 8)
        sizes = sorted({min(n, self.max_batch_tokens) for n in usual}, reverse=True)

        def work() -> None:
            self.runner.warm_prefill(self.pool, sizes, self.sliding_pool)
            self.runner.capture_graphs()

        try:
            self.run_on_engine_thread(work)
        except Exception as e:
            raise RuntimeError(f"warming up the engine failed ({type(e).__name__}: {e}); "
                               "start with CUDA graphs off to run decode steps eagerly") from e
        return time.perf_counter() - start

    def run_on_engine_thread(self, fn) -> None:
        """Runs fn() on the engine's thread, which owns the GPU work (its streams, graphs and
        cache), between two steps; waits for it and raises what it raised."""
        done, failure = threading.Event(), []

        def work() -> None:
            try:
                fn()
            except Exception as e:
                failure.append(e)
            finally:
                done.set()

        self._inbox.put(work)
        done.wait()
        if failure:
            raise failure[0]

    def health(self) -> str | None:
        """None while the engine serves; after a failure it cannot recover from (engine/runtime/
        failures.py), why and what to do. Every request is refused from then on."""
        return self._fatal

    def counters(self) -> dict[str, int]:
        """Running totals for tests and benchmarks. The sliding_* figures are the sliding-window
        layers' pool (all 0 without one)."""
        c = self.runner.counters
        sliding = self.sliding_pool
        return {"steps": c.steps, "graph_steps": c.graph_steps, "chunk_graph_steps": c.chunk_graph_steps,
                "ahead_steps": c.ahead_steps,
                "computed_tokens": c.computed_tokens, "images_encoded": c.images_encoded,
                "images_skipped": c.images_skipped, "preemptions": self.scheduler.preemptions,
                "prefix_hit_tokens": self.scheduler.prefix_hit_tokens, "evictions": self.pool.evictions,
                "free_blocks": self.pool.num_free, "num_blocks": self.pool.num_blocks,
                "sliding_free_blocks": sliding.num_free if sliding else 0,
                "sliding_num_blocks": sliding.num_blocks if sliding else 0,
                "sliding_evictions": sliding.evictions if sliding else 0}

    def decode_step_times(self) -> dict[int, tuple[int, float]]:
        """Batch size -> (decode steps replayed from a graph, their total seconds including
        sampling and streaming): the steady-state step time at each batch size."""
        return dict(self.runner.counters.decode_by_batch)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread; requests still in flight end with Final("abort")."""
        self._stopped = True
        self._inbox.put(None)
        self._worker.join(timeout)
        if self.workers is not None:
            self.workers.close()

    # ---- request intake ---------------------------------------------------------------------

    def _sequence(self, stream: EngineStream) -> Sequence:
        request = stream.request
        sp = request.sampling
        if sp.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1 (got {sp.max_tokens})")
        if any(not 0 <= token < self.spec.vocab_size for token, _ in sp.logit_bias):
            raise ValueError(f"logit_bias names a token id outside this model's vocabulary (0 to "
                             f"{self.spec.vocab_size - 1})")
        limit = self.context_limit
        self.formatter.prepare_images(request)  # outside the lock: other requests' prompts need not wait
        with self._format_lock:
            # None unless JSON mode or a forced call's arguments
            json_answer = json_answer_for(request, self.json_vocabulary, self.spec.family)
            calls = strict_calls(request, self.json_vocabulary, self.spec.family)
            prompt, dropped = fit_to_context(request, self.formatter.build, limit)
        n = len(prompt.input_ids)
        if n >= limit:
            if limit < self.max_context:
                why = (f"the KV cache holds {limit} tokens ({self.pool.num_blocks} blocks of {self.block_size}); "
                       "shorten the conversation, or start the engine with a larger KV cache (more free GPU "
                       "memory, or the num_blocks / max_kv_tokens options)")
            else:
                why = f"this model's context holds {limit}; shorten the conversation or start a new chat"
            raise RequestTooLong(f"the prompt has {n} tokens and leaves no room to answer: {why}", prompt.input_ids)
        mrope = None
        spans = []
        if self.spec.family == "glm4v_moe":
            ids = torch.tensor(prompt.input_ids, dtype=torch.long)
            mrope = self.model.rope_positions(ids, prompt.image_grid_thw)
            mrope = (mrope[0].cpu(), mrope[1])
            if self.spec.vision is not None:
                spans = image_spans(prompt, self.spec.image_tokens.image, self.spec.vision.spatial_merge_size)
        with self._format_lock:
            text = TextAssembler(self.formatter.tokenizer, self.spec.family, self.formatter.thinks(request), sp.stop,
                                 request.tools, prefix=self.formatter.answer_prefix(request),
                                 plain=request.response_format != "text")
        sampler = Sampler(sp, self.device, prompt_len=len(prompt.input_ids))
        return Sequence(next(self._ids), stream, prompt, sampler, text, limit=limit, eos_ids=self.spec.eos_token_ids,
                        block_size=self.block_size, spans=spans, mrope=mrope, dropped_messages=dropped,
                        token_names=self.token_names, json_answer=json_answer, strict_calls=calls)


class RequestTooLong(ValueError):
    def __init__(self, message: str, prompt_ids: list[int]):
        super().__init__(message)
        self.prompt_ids = prompt_ids
