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
    a token appended at slot s later sits at position s + delta on every axis. Text runs are
    filled a run at a time: a long conversation's prompt is mostly text, and this runs on the
    submitting thread before the request is queued."""
    ids = input_ids.cpu()
    num = ids.numel()
    image_at = (ids == tokens.image).nonzero().flatten().tolist()
    out = torch.empty(3, num, dtype=torch.long)
    pos, i, k = 0, 0, 0  # next position, next token, next of image_at
    for t, h, w in grid_thw.tolist() if grid_thw is not None else []:
        if k == len(image_at):
            break
        start = image_at[k]
        out[:, i:start] = torch.arange(pos, pos + start - i)
        pos += start - i
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if image_at[k:k + n] != list(range(start, start + n)):
            raise ValueError(f"image at token {start} should have {n} <|image|> tokens for grid {t}x{h}x{w}")
        out[0, start:start + n] = torch.arange(t).repeat_interleave(gh * gw) + pos
        out[1, start:start + n] = torch.arange(gh).repeat_interleave(gw).repeat(t) + pos
        out[2, start:start + n] = torch.arange(gw).repeat(gh * t) + pos
        pos += max(gh, gw)
        i, k = start + n, k + n
    if k < len(image_at):
        raise ValueError(f"the prompt has {len(image_at) - k} <|image|> tokens from token {image_at[k]} on "
                         "that no image grid covers")
    out[:, i:] = torch.arange(pos, pos + num - i)
    delta = int(out.max()) + 1 - num if num else 0
    return out.to(input_ids.device), delta
