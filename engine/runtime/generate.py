"""Generation for one sequence with a private paged KV cache: prefill the prompt (images first),
then decode token by token until an end-of-sequence id or the token budget."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .forward_batch import ForwardBatch
from .kv_cache import PagedKVCache
from .prompt import Prompt
from .sampling import Sampler


@dataclass
class StepTimes:
    """Seconds spent in each phase; filled in while the generator runs."""

    image_encode: float = 0.0
    prefill: float = 0.0
    first_token: float = 0.0
    decode: float = 0.0
    decoded_tokens: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BLOCK_SIZE = 16


class ContextTooLong(ValueError):
    pass


def generate(model, prompt: Prompt, sampler: Sampler, eos_ids: tuple[int, ...], max_tokens: int,
             device: torch.device, dtype: torch.dtype, times: StepTimes | None = None,
             max_context: int | None = None) -> Iterator[int]:
    """Yields generated token ids (the end-of-sequence id included, as the last one)."""
    times = times if times is not None else StepTimes()
    spec = model.spec
    limit = min(max_context or spec.max_position_embeddings, spec.max_position_embeddings)
    n = len(prompt.input_ids)
    if n >= limit:
        raise ContextTooLong(f"the prompt has {n} tokens; this model's context holds {limit}. "
                             "Shorten the conversation or start a new chat.")
    max_tokens = min(max_tokens, limit - n)
    ids = torch.tensor(prompt.input_ids, dtype=torch.long, device=device)
    blocks = -(-(n + max_tokens) // BLOCK_SIZE)
    cache = PagedKVCache(spec.num_layers, blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, dtype, device)
    table = list(range(blocks))

    with torch.inference_mode():
        t0 = time.perf_counter()
        features = None
        if prompt.pixel_values is not None:
            features = model.encode_images(prompt.pixel_values.to(device), prompt.image_grid_thw.to(device))
            _sync(device)
        t1 = time.perf_counter()
        times.image_encode = t1 - t0
        if spec.family == "glm4v_moe":
            positions, delta = model.rope_positions(ids, prompt.image_grid_thw)
            h = model.embed(ids, features)
        else:
            positions, delta = torch.arange(n, device=device), 0
            h = model.embed(ids)
        h = model.forward(h.to(dtype), ForwardBatch.build([(table, 0, n)], positions, BLOCK_SIZE, device), cache)
        logits = model.logits(h[-1:])[0]
        _sync(device)
        t2 = time.perf_counter()
        times.prefill = t2 - t1
        context = ids
        token = sampler(logits, context)
        times.first_token = time.perf_counter() - t2
        t_decode = time.perf_counter()
        for step in range(max_tokens):
            yield token
            if token in eos_ids or step == max_tokens - 1:
                break
            slot = n + step
            tok = torch.tensor([token], dtype=torch.long, device=device)
            context = torch.cat((context, tok))
            batch = ForwardBatch.build([(table, slot, 1)], torch.tensor([slot + delta]), BLOCK_SIZE, device)
            h = model.forward(model.embed(tok).to(dtype), batch, cache)
            token = sampler(model.logits(h)[0], context)
            times.decoded_tokens += 1
            times.decode = time.perf_counter() - t_decode
