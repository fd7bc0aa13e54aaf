"""Decode steps replayed from captured CUDA graphs against the same steps run eagerly, on the real
architectures at full width (2 layers, random weights in the native formats)."""
import pytest
import torch

from localchat.engine.models import build_model
from localchat.engine.runtime.decode_graphs import DecodeGraphs
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.engine.runtime.kv_cache import PagedKVCache
from localchat.engine.weights.dummy import dummy_weights

from .test_model_cuda import BLOCK, rel_err, truncated_spec

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("config", ["gpt-oss-120b.json", "glm-4.5v-fp8.json"])
def test_graph_replay_matches_eager_decode(config):
    spec = truncated_spec(config)
    model = build_model(spec, dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=3), "cuda")
    mrope = spec.family == "glm4v_moe"
    # Four sequences fill the bucket of 4 exactly, so both paths launch the same kernels with the
    # same split counts and must agree to the bit; padding itself is tested on CPU.
    lens = [37, 150, 90, 64]
    blocks = 16
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(lens))]
    caches = [PagedKVCache(spec.num_layers, blocks * len(lens) + 1, BLOCK, spec.num_kv_heads, spec.head_dim,
                           torch.bfloat16, "cuda") for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randint(0, 20000, (n,), generator=g) for n in lens]).cuda()
    rope = torch.cat([torch.arange(n) for n in lens])
    if mrope:
        rope = rope.expand(3, -1)
    with torch.inference_mode():
        batch = ForwardBatch.build([(t, 0, n) for t, n in zip(tables, lens)], rope, BLOCK, "cuda")
        model.forward(model.embed(ids), batch, caches[0])
        caches[1].k.copy_(caches[0].k)
        caches[1].v.copy_(caches[0].v)
        graphs = DecodeGraphs(model, caches[1], torch.bfloat16, torch.device("cuda"), max_batch=8,
                              max_blocks=blocks, scratch_block=blocks * len(lens), mrope=mrope)
        errors, agree = [], 0
        for step in range(6):
            toks = [1000 + 7 * step + i for i in range(len(lens))]
            pos = torch.tensor(lens)
            pos = pos.expand(3, -1) if mrope else pos
            eager_batch = ForwardBatch.build([(t, n, 1) for t, n in zip(tables, lens)], pos, BLOCK, "cuda")
            eager = model.logits(model.forward(model.embed(torch.tensor(toks, device="cuda")), eager_batch,
                                               caches[0]))
            replayed = graphs.run(toks, pos, [t[n // BLOCK] * BLOCK + n % BLOCK for t, n in zip(tables, lens)],
                                  [n + 1 for n in lens], tables).clone()
            errors.append(rel_err(replayed.float().cpu(), eager.float().cpu()))
            agree += int((replayed.argmax(-1) == eager.argmax(-1)).sum())
            lens = [n + 1 for n in lens]
    print(f"{config}: graph replay vs eager decode, logits rel err {[f'{e:.1e}' for e in errors]}, "
          f"argmax {agree}/{6 * len(lens)}, captured {sorted(graphs.graphs)} in {graphs.capture_seconds:.1f} s")
    assert graphs.replays >= 5 and 4 in graphs.graphs
    assert max(errors) < 1e-3 and agree == 6 * len(lens)
