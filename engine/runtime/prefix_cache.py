"""Content keys of full KV blocks, so a later request whose prompt starts the same way reuses the
cached K/V instead of prefilling it again (across turns of a chat and across chats).

Block i's key is a hash chained over every earlier block: sha256(key[i-1] | its token ids | the
sha256 of each image with tokens in it). The chain makes a key stand for the whole prefix up to
the block's end, which is what the block's K/V depend on. Image tokens all share one id, so the
image's content hash is what tells two pictures apart; the rotary positions of a prefix (M-RoPE
for GLM) are a function of the prefix's tokens and image grids alone, so equal keys also mean
equal positions.

With a split KV cache (kv_cache.py) the sliding group's blocks are registered in its own pool
under the same keys as the full blocks of the same tokens, so a sliding block that left a
sequence's window is remembered (the sliding pool's cached list) rather than lost. A prefix of
L blocks is then only usable when the sliding pool also still holds the blocks the first
recomputed token (at L * block_size) can see; otherwise L shrinks until it does (or to 0).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from .block_pool import BlockPool
from .kv_cache import first_window_block
from .prompt import Prompt


@dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its LLM tokens [start, end); `index` is its place in
    Prompt.image_pixels and its row in Prompt.image_grid_thw."""

    index: int
    start: int
    end: int
    sha256: str


def image_spans(prompt: Prompt, image_token_id: int | None, merge: int) -> list[ImageSpan]:
    """Where each image's tokens sit in the prompt (the prompt builder expanded each placeholder to
    t*h*w / merge^2 tokens of `image_token_id`, images in order)."""
    if prompt.image_grid_thw is None or image_token_id is None:
        return []
    ids = prompt.input_ids
    spans, cursor = [], 0
    for i, (t, h, w) in enumerate(prompt.image_grid_thw.tolist()):
        n = t * h * w // merge**2
        start = ids.index(image_token_id, cursor)
        if ids[start:start + n] != [image_token_id] * n:
            raise ValueError(f"image {i} should have {n} image tokens from token {start}")
        sha = prompt.image_hashes[i] if i < len(prompt.image_hashes) else f"unhashed-{i}"
        spans.append(ImageSpan(i, start, start + n, sha))
        cursor = start + n
    return spans


class BlockKeys:
    """The chained keys of one sequence's full blocks, computed as the blocks fill."""

    def __init__(self, block_size: int, spans: list[ImageSpan]):
        self.block_size = block_size
        self.spans = spans
        self.keys: list[bytes] = []

    def extend(self, tokens: list[int], num_full_blocks: int) -> list[bytes]:
        """Keys of blocks [0, num_full_blocks) of `tokens`; each key is computed once."""
        bs = self.block_size
        while len(self.keys) < num_full_blocks:
            i = len(self.keys)
            lo, hi = i * bs, (i + 1) * bs
            h = hashlib.sha256(self.keys[-1] if self.keys else b"localchat-kv")
            h.update(array("q", tokens[lo:hi]).tobytes())
            for s in self.spans:
                if s.start < hi and s.end > lo:
                    h.update(b"|img:" + s.sha256.encode())
            self.keys.append(h.digest())
        return self.keys[:num_full_blocks]


def match_prefix(pool: BlockPool, keys: list[bytes]) -> list[int]:
    """The longest run of leading blocks the pool still holds for `keys`; takes a reference to each."""
    blocks = []
    for k in keys:
        b = pool.lookup(k)
        if b is None:
            break
        pool.take_cached(b)
        blocks.append(b)
    return blocks


def match_windowed_prefix(pool: BlockPool, sliding: BlockPool, keys: list[bytes], block_size: int, window: int,
                          placeholder: int) -> tuple[list[int], list[int], int]:
    """The longest run of leading blocks usable with a sliding group: the full pool holds blocks
    0..L-1 and the sliding pool the blocks from first_window_block(L * block_size) to L - 1.
    Takes a reference to each block used. Returns (full blocks, sliding table with `placeholder`
    before the window, number of placeholder entries)."""
    found: list[int] = []  # the full pool's leading run
    for k in keys:
        b = pool.lookup(k)
        if b is None:
            break
        found.append(b)
    held = [sliding.lookup(k) for k in keys[:len(found)]]
    usable, first = 0, 0
    for n in range(len(found), 0, -1):
        start = first_window_block(n * block_size, window, block_size)
        if all(b is not None for b in held[start:n]):
            usable, first = n, start
            break
    blocks, windowed = found[:usable], held[first:usable]
    for b in blocks:
        pool.take_cached(b)
    for b in windowed:
        sliding.take_cached(b)
    return blocks, [placeholder] * first + windowed, first
