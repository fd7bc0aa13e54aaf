"""One forward step over a packed batch: the planned tokens of every sequence (prefill chunks
and decode tokens mixed) -> logits for the sequences whose last token was fed.

Steps that only decode (one token per sequence, no image features) replay a captured CUDA graph
when `graphs` is given (decode_graphs.py); other steps of few tokens replay one of `chunks`
(chunk_graphs.py); the rest run eagerly. Images are encoded here, once
per admission, right before the first chunk that needs them; images whose tokens all lie in
reused prefix blocks are not encoded at all.

With a split KV cache (kv_cache.py) every step also carries each sequence's sliding-group table.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .chunk_graphs import ChunkGraphs
from .decode_graphs import DecodeGraphs, DecodeInputs
from .forward_batch import ForwardBatch
from .kv_cache import PagedKVCache, SplitKVCache, slot_of
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class StepCounters:
    steps: int = 0
    graph_steps: int = 0  # decode steps replayed from a captured graph
    chunk_graph_steps: int = 0  # other steps replayed from a captured graph (chunk_graphs.py)
    ahead_steps: int = 0  # of those, steps launched before the previous step's tokens were on the host
    computed_tokens: int = 0  # tokens fed to the model (prefill and decode)
    images_encoded: int = 0
    images_skipped: int = 0  # images wholly inside reused prefix blocks
    # batch size -> (graph decode steps, their seconds from launch to streamed tokens)
    decode_by_batch: dict[int, tuple[int, float]] = field(default_factory=dict)

    def record_decode(self, batch: int, seconds: float) -> None:
        steps, total = self.decode_by_batch.get(batch, (0, 0.0))
        self.decode_by_batch[batch] = (steps + 1, total + seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepRunner:
    # Whether a failed graph step must fail the step rather than fall back to eager launches: under
    # tensor parallelism every rank must run the same kernels and collectives.
    fails_together = False

    def __init__(self, model, cache: PagedKVCache | SplitKVCache, device: torch.device, dtype: torch.dtype,
                 graphs: DecodeGraphs | None = None, chunks: ChunkGraphs | None = None):
        self.model = model
        self.cache = cache
        self.split = cache.sliding is not None
        self.device = device
        self.dtype = dtype
        self.graphs = graphs
        self.chunks = chunks
        self.vision = model.spec.vision is not None
        self.counters = StepCounters()

    def _plan_images(self, seq: Sequence) -> None:
        """Encodes the images of `seq` that still have tokens to prefill (once per admission)."""
        seq.vision_planned = True
        todo = seq.images_to_encode()
        self.counters.images_skipped += len(seq.spans) - len(todo)
        if not todo:
            return
        t0 = time.perf_counter()
        p = seq.prompt
        pixels = p.image_recipe.patches([p.image_pixels[s.index] for s in todo], self.device)
        grid = p.image_grid_thw[[s.index for s in todo]]
        seq.features = self.model.encode_images(pixels, grid.to(self.device))
        seq.feature_base, row = {}, 0
        for s in todo:
            seq.feature_base[s.index] = row
            row += s.end - s.start
        _sync(self.device)
        seq.clock.image_encode += time.perf_counter() - t0
        self.counters.images_encoded += len(todo)

    def graph_ready(self, plan: list[tuple[Sequence, int]]) -> bool:
        """True when every sequence feeds its one last token and needs no image features."""
        g = self.graphs
        if g is None or len(plan) > g.max_batch:
            return False
        for seq, n in plan:
            if n != 1 or seq.num_computed + 1 != len(seq.tokens):
                return False
            if -(-len(seq.tokens) // self.cache.block_size) > g.max_blocks:
                return False
            if seq.spans and seq.num_computed < seq.spans[-1].end:
                return False
        return True

    def graph_inputs(self, plan: list[tuple[Sequence, int]]) -> DecodeInputs:
        """A decode-only plan as the inputs of DecodeGraphs.run (picklable, for the other ranks)."""
        seqs = [seq for seq, _ in plan]
        return self.decode_inputs(seqs, [seq.tokens[seq.num_computed] for seq in seqs],
                                  [seq.num_computed for seq in seqs])

    def decode_inputs(self, seqs: list[Sequence], token_ids: list[int] | torch.Tensor, pos: list[int]) -> DecodeInputs:
        """Inputs of a decode step feeding token_ids [B] (host ids or a device tensor) at positions
        pos [B] of their sequences."""
        bs = self.cache.block_size
        positions = torch.tensor([seq.position_at(p) for seq, p in zip(seqs, pos)])  # [B] or [B, 3]
        sliding_slots = sliding_tables = None
        if self.split:
            sliding_slots = [slot_of(seq.sliding_blocks, p, bs) for seq, p in zip(seqs, pos)]
            sliding_tables = [seq.sliding_blocks for seq in seqs]
        return DecodeInputs(token_ids, positions.T.contiguous() if positions.dim() == 2 else positions,
                            [slot_of(seq.blocks, p, bs) for seq, p in zip(seqs, pos)],
                            [p + 1 for p in pos], [seq.blocks for seq in seqs], sliding_slots, sliding_tables)

    def run_ahead(self, seqs: list[Sequence], token_ids: torch.Tensor) -> torch.Tensor:
        """Launches the decode step after the one in flight, from a captured graph: each sequence
        feeds the token that step is choosing (token_ids [B], on the device) at position
        len(seq.tokens); its table must already reach that slot (Scheduler.reserve_ahead).
        Returns the float32 logits [B, V] (still being computed; overwritten by the next step)."""
        logits = self.graphs.run(*self.decode_inputs(seqs, token_ids, [len(seq.tokens) for seq in seqs]))
        self._count_graph_step(len(seqs))
        self.counters.ahead_steps += 1
        return logits

    def _run_graph(self, plan: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        logits = self.graphs.run(*self.graph_inputs(plan))
        self._count_graph_step(len(plan))
        return [seq for seq, _ in plan], logits

    def _count_graph_step(self, batch: int) -> None:
        self.counters.steps += 1
        self.counters.graph_steps += 1
        self.counters.computed_tokens += batch

    def forward(self, inputs: "StepInputs") -> torch.Tensor | None:
        """Runs prepared step inputs (under tensor parallelism, on every rank)."""
        return self.execute(inputs)

    def warm_prefill(self, pool, sizes: list[int], sliding_pool=None) -> list[int]:
        """Runs one prefill of each token count in `sizes` through the model, in blocks borrowed
        from `pool` (and `sliding_pool` with a split cache) and given back, so the kernels those
        prompt chunks use are compiled before the first chat. Returns the sizes that ran (those
        whose blocks were free)."""
        done = []
        bs = self.cache.block_size
        pools = [pool] + ([sliding_pool] if self.split else [])
        for t in sizes:
            n = -(-t // bs)
            if any(n > p.num_free for p in pools):
                continue
            tables = [p.allocate(n) for p in pools]
            try:
                positions = torch.arange(t)
                if self.model.spec.family == "glm4v_moe":
                    positions = positions.expand(3, -1)
                vocab = self.model.spec.vocab_size
                ids = [(1000 + i) % vocab for i in range(t)]
                sliding = tables[1:] or None
                self.forward(StepInputs(ids, [(tables[0], 0, t)], positions, None, [t - 1], sliding))
            finally:
                for p, blocks in zip(pools, tables):
                    p.free(blocks)
            done.append(t)
        return done

    def capture_graphs(self) -> float:
        """Captures every decode and chunk graph bucket now; returns the seconds spent capturing so far."""
        seconds = 0.0
        for graphs in (self.graphs, self.chunks):
            if graphs is not None:
                graphs.capture_all()
                seconds += graphs.capture_seconds
        return seconds

    def run(self, plan: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor | None]:
        """plan: (sequence, tokens to feed) pairs. Returns the sequences to sample from now and
        their float32 logits [len(those), vocab] in the same order."""
        if self.graph_ready(plan):
            try:
                return self._run_graph(plan)
            except Exception as e:  # a kernel that cannot be captured must not stop the chat
                log.warning("decode graph failed (%s: %s); decoding eagerly from now on", type(e).__name__, e)
                self.graphs = None
        inputs, sampling = self.prepare(plan)
        return sampling, self.execute(inputs)

    def prepare(self, plan: list[tuple[Sequence, int]]) -> tuple["StepInputs", list[Sequence]]:
        """The host-side half of a step: encodes the images it needs, gathers the model inputs."""
        ids: list[int] = []
        positions, features, entries, last_rows, sampling = [], [], [], [], []
        sliding = [] if self.split else None
        for seq, n in plan:
            lo, hi = seq.num_computed, seq.num_computed + n
            if seq.spans and not seq.vision_planned:
                self._plan_images(seq)
            ids += seq.tokens[lo:hi]
            positions.append(seq.rope_positions(lo, hi))
            if seq.spans:
                f = seq.image_features(lo, hi)
                if f is not None:
                    features.append(f)
                if hi >= seq.spans[-1].end:
                    seq.features = None  # every image token is in the cache now
            entries.append((seq.blocks, lo, n))
            if sliding is not None:
                sliding.append(seq.sliding_blocks)
            if hi == len(seq.tokens):
                last_rows.append(len(ids) - 1)
                sampling.append(seq)
        self.counters.steps += 1
        self.counters.computed_tokens += len(ids)
        inputs = StepInputs(ids, entries, torch.cat(positions, dim=-1), torch.cat(features) if features else None,
                            last_rows, sliding)
        return inputs, sampling

    def execute(self, inputs: "StepInputs") -> torch.Tensor | None:
        """The device half: embed, forward over the paged cache, logits of `last_rows`; from a
        captured chunk graph where one takes the step."""
        size = self.chunks.bucket(inputs) if self.chunks is not None else None
        if size is not None:
            logits = self._replay_chunk(inputs, size)
            if logits is not None:
                _sync(self.device)
                return logits
        token_ids = torch.tensor(inputs.token_ids, dtype=torch.long, device=self.device)
        batch = ForwardBatch.build(inputs.entries, inputs.positions, self.cache.block_size, self.device,
                                   inputs.sliding_tables)
        with torch.inference_mode():
            if self.vision:
                h = self.model.embed(token_ids, inputs.features)
            else:
                h = self.model.embed(token_ids)
            h = self.model.forward(h.to(self.dtype), batch, self.cache)
            logits = None
            if inputs.last_rows:
                rows = torch.tensor(inputs.last_rows, dtype=torch.long, device=self.device)
                logits = self.model.logits(h.index_select(0, rows))
        _sync(self.device)
        return logits

    def _replay_chunk(self, inputs: "StepInputs", size: int) -> torch.Tensor | None:
        """The step's logits from the chunk graph of `size` tokens; None (graphs off from now on)
        where that failed, so the caller runs it eagerly: the graph writes nothing the eager step
        does not write again."""
        try:
            logits = self.chunks.run(inputs, size)
        except Exception as e:  # a kernel that cannot be captured must not stop the chat
            if self.fails_together:
                raise
            log.warning("chunk graph failed (%s: %s); running such steps eagerly from now on", type(e).__name__, e)
            self.chunks = None
            return None
        self.counters.chunk_graph_steps += 1
        return logits


@dataclass
class StepInputs:
    """One step's model inputs, gathered on the host (picklable: they go to the other ranks
    under tensor parallelism).

    token_ids: [T] ids of the new tokens, all sequences packed; entries: (block table, tokens
    already cached, new tokens) per sequence; positions: [T] or [3, T] rotary positions (CPU);
    features: [n_image_tokens, hidden] features of the image tokens among them, or None;
    last_rows: rows of the packed axis whose logits are wanted; sliding_tables: each sequence's
    sliding-group table with a split KV cache, else None.
    """

    token_ids: list[int]
    entries: list[tuple[list[int], int, int]]
    positions: torch.Tensor
    features: torch.Tensor | None
    last_rows: list[int]
    sliding_tables: list[list[int]] | None = None
