"""The CUDA path (Triton kernels, bf16) against the CPU reference path (float32) on the real
architectures at full width, a few layers deep, with random weights in the native formats."""
import json
from pathlib import Path

import pytest
import torch

from localchat.engine.models import build_model
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.engine.runtime.kv_cache import PagedKVCache
from localchat.engine.spec import ModelSpec
from localchat.engine.weights.dummy import dummy_weights, to_device

CONFIGS = Path(__file__).parent.parent / "data" / "configs"
BLOCK = 16


def truncated_spec(name: str, layers: int = 2, vision_depth: int = 2) -> ModelSpec:
    cfg = json.loads((CONFIGS / name).read_text())
    text = cfg.get("text_config", cfg)
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    if "vision_config" in cfg:
        cfg["vision_config"]["depth"] = vision_depth
    return ModelSpec.from_config(cfg)


def run_steps(model, spec, device, dtype, prompts, decode_tokens, image=None):
    """Prefills several prompts in one batch, then decodes them together; returns logits per step."""
    cache = PagedKVCache(spec.num_layers, 64, BLOCK, spec.num_kv_heads, spec.head_dim, dtype, device)
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    ids = torch.cat(prompts).to(device)
    feats = None
    if image is not None:
        feats = model.encode_images(image[0].to(device), image[1].to(device))
    if spec.family == "glm4v_moe":
        pos = [model.rope_positions(p.to(device), image[1] if image is not None and i == 0 else None)
               for i, p in enumerate(prompts)]
        rope = torch.cat([p for p, _ in pos], dim=1)
        deltas = [d for _, d in pos]
        h = model.embed(ids, feats)
    else:
        rope = torch.cat([torch.arange(len(p)) for p in prompts])
        deltas = [0] * len(prompts)
        h = model.embed(ids)
    batch = ForwardBatch.build([(t, 0, len(p)) for t, p in zip(tables, prompts)], rope, BLOCK, device)
    out = model.forward(h.to(dtype), batch, cache)
    ends = batch.query_start_host[1:]
    logits = [model.logits(out[[e - 1 for e in ends]])]
    lens = [len(p) for p in prompts]
    for step in range(decode_tokens):
        toks = torch.tensor([1000 + 7 * step + i for i in range(len(prompts))], device=device)
        rope = torch.tensor([n + d for n, d in zip(lens, deltas)])
        batch = ForwardBatch.build([(t, n, 1) for t, n in zip(tables, lens)], rope, BLOCK, device)
        logits.append(model.logits(model.forward(model.embed(toks).to(dtype), batch, cache)))
        lens = [n + 1 for n in lens]
    return [l.float().cpu() for l in logits]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["gpt-oss-20b.json", "gpt-oss-120b.json", "glm-4.5v-fp8.json", "glm-4.5v.json"])
def test_cuda_path_matches_cpu_reference(config):
    spec = truncated_spec(config)
    gpu_weights = dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=1)
    gpu = build_model(spec, gpu_weights, "cuda")
    cpu = build_model(spec, to_device(gpu_weights, "cpu", torch.float32), "cpu")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 20000, (n,), generator=g) for n in (37, 150)]
    image = None
    if spec.vision is not None:
        grid = torch.tensor([[1, 8, 12]])
        n_img = 8 * 12 // 4
        image = (torch.randn(8 * 12, 3 * 2 * 14 * 14, generator=g), grid)
        it = spec.image_tokens
        prompts[0] = torch.cat([prompts[0][:5], torch.tensor([it.image_start] + [it.image] * n_img + [it.image_end]),
                                prompts[0][5:]])
    ref = run_steps(cpu, spec, "cpu", torch.float32, prompts, 4, image)
    with torch.inference_mode():
        got = run_steps(gpu, spec, "cuda", torch.bfloat16, prompts, 4, image)
    errors = [rel_err(a, b) for a, b in zip(got, ref)]
    print(f"{config}: logits rel err per step {[f'{e:.2e}' for e in errors]}")
    assert max(errors) < 3e-2
    for a, b in zip(got, ref):
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        assert agree >= 0.5
