"""GLM-4.5V's 3-axis rotary positions (engine/models/mrope.py) against their definition token by
token: text advances all axes together, an image's tokens take (frame, row, column) offsets from
the running start, and the text after it starts max(rows, columns) further on."""
import random

import pytest
import torch

from localchat.engine.models.mrope import mrope_positions
from localchat.engine.spec import ImageTokens

TOKENS = ImageTokens(image=900, image_start=901, image_end=902, video=903, video_start=904, video_end=905)
MERGE = 2


def positions_by_token(ids: list[int], grids: list[tuple[int, int, int]]) -> tuple[list[list[int]], int]:
    axes, pos, i, grids = [[], [], []], 0, 0, iter(grids)
    while i < len(ids):
        if ids[i] != TOKENS.image:
            for axis in axes:
                axis.append(pos)
            pos, i = pos + 1, i + 1
            continue
        t, h, w = next(grids)
        gh, gw = h // MERGE, w // MERGE
        for f in range(t):
            for r in range(gh):
                for c in range(gw):
                    axes[0].append(pos + f)
                    axes[1].append(pos + r)
                    axes[2].append(pos + c)
        pos, i = pos + max(gh, gw), i + t * gh * gw
    return axes, (max(max(a) for a in axes) + 1 - len(ids)) if ids else 0


def prompt(rng: random.Random, images: int, adjacent: bool):
    """Text runs (possibly empty) around `images` images of random grids and frames."""
    ids, grids = [rng.randrange(800) for _ in range(rng.randrange(0 if adjacent else 1, 40))], []
    for _ in range(images):
        t, h, w = rng.choice([1, 1, 2]), 2 * rng.randrange(1, 6), 2 * rng.randrange(1, 6)
        grids.append((t, h, w))
        ids += [TOKENS.image] * (t * (h // MERGE) * (w // MERGE))
        if not adjacent:
            ids += [TOKENS.image_end] + [rng.randrange(800) for _ in range(rng.randrange(1, 30))]
    return ids, grids


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("adjacent", [False, True])
def test_mrope_positions_match_the_definition(seed, adjacent):
    rng = random.Random(seed)
    ids, grids = prompt(rng, seed % 4, adjacent)
    out, delta = mrope_positions(torch.tensor(ids), torch.tensor(grids) if grids else None, TOKENS, MERGE)
    want, want_delta = positions_by_token(ids, grids)
    assert out.tolist() == want and delta == want_delta


def test_mrope_positions_of_text_alone():
    out, delta = mrope_positions(torch.arange(30000) % 800, None, TOKENS, MERGE)
    assert torch.equal(out, torch.arange(30000).expand(3, -1)) and delta == 0
    out, delta = mrope_positions(torch.tensor([], dtype=torch.long), None, TOKENS, MERGE)
    assert out.shape == (3, 0) and delta == 0


@pytest.mark.parametrize("ids,grids", [
    ([1, 900, 900, 900, 2], [(1, 4, 4)]),  # an image one token short of its grid
    ([1, 900, 900, 900, 900, 2, 900], [(1, 4, 4)]),  # image tokens that no grid covers
])
def test_mrope_positions_refuse_tokens_and_grids_that_disagree(ids, grids):
    with pytest.raises(ValueError, match="image"):
        mrope_positions(torch.tensor(ids), torch.tensor(grids), TOKENS, MERGE)
