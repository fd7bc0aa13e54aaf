"""The GLM-4.5V vision tower's own pieces (its outputs against transformers are in test_parity.py)."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures import open_fixture  # noqa: E402
from localchat.engine.models import glm4v_vision  # noqa: E402
from localchat.engine.models.glm4v_vision import Glm4vVisionTower  # noqa: E402
from localchat.engine.weights.loader import load_weights, read_spec  # noqa: E402


def _tower():
    path = open_fixture("glm-bf16")
    spec = read_spec(path)
    return Glm4vVisionTower(spec.vision, load_weights(path, spec, dtype=torch.float32), "model.visual")


def test_position_tables_cached_per_grid_give_the_same_rows():
    tower = _tower()
    cpu = torch.device("cpu")
    grids = [(1, 4, 6), (2, 6, 4), (1, 8, 8), (1, 2, 10), (1, 4, 4), (1, 6, 6)]
    # each grid computed by a tower that has seen nothing else
    alone = {g: _tower()._position_embedding(torch.tensor([g]), cpu) for g in grids}
    for g in grids + grids[:2]:  # more grids than are kept, then the first ones again
        assert torch.equal(tower._position_embedding(torch.tensor([g]), cpu), alone[g])
        assert len(tower._positions) <= glm4v_vision.POSITION_CACHE
    # several images at once: their rows one after another, each frame repeating its grid's
    both = tower._position_embedding(torch.tensor([grids[1], grids[0]]), cpu)
    assert both.shape[0] == 2 * 6 * 4 + 4 * 6
    assert torch.equal(both, torch.cat([alone[grids[1]], alone[grids[0]]]))
    assert torch.equal(alone[(2, 6, 4)], _tower()._position_embedding(torch.tensor([[1, 6, 4]]), cpu).repeat(2, 1))


def test_attention_takes_sdpa_fused_kernels():
    # With 3-D inputs SDPA can only run its math path, which writes every [heads, n, n] score
    # matrix: 136 against 17 ms for a 1024x768 photo on an H100 (BENCHMARKS.md). Allowed only the
    # flash kernel, such a call raises.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    tower = _tower()
    grid = torch.tensor([[1, 4, 6], [1, 6, 4]])
    pixels = torch.randn(48, 3 * 2 * 14 * 14)
    with torch.no_grad():
        free = tower(pixels, grid)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fused = tower(pixels, grid)
    assert torch.equal(free, fused)
