"""GLM-4.5V's 3-axis rotary positions (temporal, height, width) for a prompt with images.

Text tokens advance all three axes together. The tokens of one image form a grid of
(h / merge) x (w / merge) LLM tokens, row-major: every token of the image gets the running start
(plus its frame index) on the temporal axis and start + row / start + column on the others; the text after it starts
at start + max(grid_h, grid_w) / merge.
"""
from __future__ import annotations

import torch

from ..spec import ImageTokens


def mrope_positions(input_ids: torch.Tensor, grid_thw: torch.Tensor | None, tokens: ImageTokens,
                    merge: int) -> tuple[torch.Tensor, int]:
    """input_ids [T], grid_thw [n_images, 3] in patches -> (positions [3, T] long, delta) where
    a token appended at slot s later sits at position s + delta on every axis."""
    ids = input_ids.tolist()
    out = torch.empty(3, len(ids), dtype=torch.long)
    grids = iter(grid_thw.tolist() if grid_thw is not None else [])
    pos, i = 0, 0
    while i < len(ids):
        if ids[i] != tokens.image:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(grids)
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if ids[i:i + n] != [tokens.image] * n:
            raise ValueError(f"image at token {i} should have {n} <|image|> tokens for grid {t}x{h}x{w}")
        tt = torch.arange(t).repeat_interleave(gh * gw)
        hh = torch.arange(gh).repeat_interleave(gw).repeat(t)
        ww = torch.arange(gw).repeat(gh * t)
        out[0, i:i + n] = tt + pos
        out[1, i:i + n] = hh + pos
        out[2, i:i + n] = ww + pos
        pos += max(gh, gw)
        i += n
    delta = int(out.max()) + 1 - len(ids) if len(ids) else 0
    return out.to(input_ids.device), delta
