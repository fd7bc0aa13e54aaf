"""The CUDA path (Triton kernels, bf16) against the CPU reference path (float32) on the real
architectures at full width, a few layers deep, with random weights in the native formats."""
import contextlib
import json

import pytest
import torch
import torch.nn.functional as F

from localchat.engine.layers import moe as moe_layer
from localchat.engine.models import build_model
from localchat.engine.runtime.forward_batch import ForwardBatch
from localchat.engine.runtime.kv_cache import PagedKVCache
from localchat.engine.spec import ModelSpec
from localchat.engine.weights.dummy import dummy_weights, to_device
from localchat.engine.model_configs import CONFIG_DIR
from localchat.kernels.moe_routing import with_shared_expert

CONFIGS = CONFIG_DIR
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


def _weights_for(name, logits, ids, spec):
    if "glm" in name:
        scores = logits.sigmoid().gather(1, ids)
        if spec.moe.norm_topk_prob:
            scores = scores / scores.sum(-1, keepdim=True)
        return scores * spec.moe.routed_scaling_factor
    return torch.softmax(logits.gather(1, ids), dim=-1)


def _router_logits(name, args):
    """float32 router logits of a routing call: route_* take them; router_* (x, weight, bias)
    compute them inside their kernel, so they are recomputed here from the same operands."""
    if name.startswith("route_"):
        return args[0].float()
    x, w, b = args[:3]
    if "glm" in name:
        return F.linear(x.float(), w.float())
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)).float()


@contextlib.contextmanager
def recorded_routing(spec=None, replay=None):
    """Records the expert ids every MoE layer picks (sorted per token). With `replay` (ids
    recorded on another run), every layer routes to those experts instead, weighting them by its
    own router logits: two paths then differ only by arithmetic, not by a flipped near-tie."""
    calls = []
    replayed = iter(replay) if replay is not None else None

    def wrap(name, fn):
        def route(*args, **kwargs):
            weights, ids = fn(*args, **kwargs)
            shared = kwargs.get("shared_expert")
            if shared is not None:  # the folded shared expert's column: every token's, not a choice
                weights, ids = weights[:, :-1], ids[:, :-1]
            if replayed is not None:
                logits = _router_logits(name, args)
                ids = next(replayed).to(device=logits.device, dtype=ids.dtype)
                weights = _weights_for(name, logits, ids.long(), spec).to(weights.dtype)
            calls.append(ids.sort(dim=-1).values.cpu())
            return (weights, ids) if shared is None else with_shared_expert(weights, ids, shared)
        return route

    names = ("route_glm", "route_gpt_oss", "route_glm_ref", "route_gpt_oss_ref", "router_glm", "router_gpt_oss")
    saved = {n: getattr(moe_layer, n) for n in names}
    for n in names:
        setattr(moe_layer, n, wrap(n, saved[n]))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(moe_layer, n, fn)


def run_steps(model, spec, device, dtype, prompts, decode_tokens, image=None, rows=None):
    """Prefills several prompts in one batch, then decodes them together; returns logits per step.
    `rows` receives, per step, which packed tokens the logits rows belong to."""
    rows = [] if rows is None else rows
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
    rows.append([e - 1 for e in ends])
    logits = [model.logits(out[rows[-1]])]
    lens = [len(p) for p in prompts]
    for step in range(decode_tokens):
        toks = torch.tensor([1000 + 7 * step + i for i in range(len(prompts))], device=device)
        rope = torch.tensor([n + d for n, d in zip(lens, deltas)])
        batch = ForwardBatch.build([(t, n, 1) for t, n in zip(tables, lens)], rope, BLOCK, device)
        logits.append(model.logits(model.forward(model.embed(toks).to(dtype), batch, cache)))
        rows.append(list(range(len(prompts))))
        lens = [n + 1 for n in lens]
    return [l.float().cpu() for l in logits]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# Measured on one H200 (2026-12-02, 2 layers, same routing): bf16 models 1.3e-2 to 2.3e-2;
# the FP8 model 6e-2 to 1.1e-1, because FP8 prefill quantizes activations per token to e4m3
# (W8A8 through torch._scaled_mm, the scheme the FP8 checkpoint is made for).
TOLERANCE = {"gpt-oss-20b.json": 3e-2, "gpt-oss-120b.json": 3e-2, "glm-4.5v.json": 3e-2, "glm-4.5v-fp8.json": 1.5e-1}


def prompts_for(spec, g):
    prompts = [torch.randint(0, 20000, (n,), generator=g) for n in (37, 150)]
    image = None
    if spec.vision is not None:
        grid = torch.tensor([[1, 8, 12]])
        n_img = 8 * 12 // 4
        image = (torch.randn(8 * 12, 3 * 2 * 14 * 14, generator=g), grid)
        it = spec.image_tokens
        prompts[0] = torch.cat([prompts[0][:5], torch.tensor([it.image_start] + [it.image] * n_img + [it.image_end]),
                                prompts[0][5:]])
    return prompts, image


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(TOLERANCE))
def test_cuda_path_matches_cpu_reference(config):
    """bf16 on the GPU against float32 on the CPU. Random routers have near-ties that bf16
    rounding flips, so the CPU run routes every token to the experts the GPU run chose."""
    spec = truncated_spec(config)
    gpu_weights = dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=1)
    gpu = build_model(spec, gpu_weights, "cuda")
    cpu = build_model(spec, to_device(gpu_weights, "cpu", torch.float32), "cpu")
    prompts, image = prompts_for(spec, torch.Generator().manual_seed(0))
    with recorded_routing() as gpu_routes, torch.inference_mode():
        got = run_steps(gpu, spec, "cuda", torch.bfloat16, prompts, 4, image)
    with recorded_routing(spec, replay=gpu_routes):
        ref = run_steps(cpu, spec, "cpu", torch.float32, prompts, 4, image)
    errors = [rel_err(a, b) for a, b in zip(got, ref)]
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, ref))
    print(f"{config}: CUDA bf16 vs CPU float32, same routing: logits rel err {[f'{e:.1e}' for e in errors]}, "
          f"argmax agrees on {agree}/{sum(len(a) for a in got)} rows")
    assert max(errors) < TOLERANCE[config]


@contextlib.contextmanager
def torch_references():
    """Swaps every Triton kernel the layers call for its torch reference (same signature)."""
    from localchat.engine.layers import attention as attention_layer
    from localchat.engine.layers import linear as linear_layer
    from localchat.kernels import (attention_decode, attention_prefill, attention_short, fp8_linear, moe, moe_router,
                                   moe_routing)

    swaps = [(attention_layer, "paged_decode_attention", attention_decode.paged_decode_attention_ref),
             (attention_layer, "paged_prefill_attention", attention_prefill.paged_prefill_attention_ref),
             (attention_layer, "short_prefill_attention", attention_short.short_prefill_attention_ref),
             (linear_layer, "fp8_linear", fp8_linear.fp8_linear_ref),
             (moe_layer, "fused_moe", moe.fused_moe_ref),
             (moe_layer, "route_glm", moe_routing.route_glm_ref),
             (moe_layer, "route_gpt_oss", moe_routing.route_gpt_oss_ref),
             (moe_layer, "router_glm", moe_router.router_glm_ref),
             (moe_layer, "router_gpt_oss", moe_router.router_gpt_oss_ref)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
    for mod, name, fn in swaps:
        setattr(mod, name, fn)
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["gpt-oss-20b.json", "gpt-oss-120b.json", "glm-4.5v-fp8.json"])
def test_kernels_match_their_references_inside_the_model(config):
    """The same bf16 model on the GPU, once through the Triton kernels and once through their
    torch references: this isolates the kernels from bf16-versus-float32 differences."""
    spec = truncated_spec(config)
    model = build_model(spec, dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=2), "cuda")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 20000, (n,), generator=g) for n in (70, 150)]
    with torch.inference_mode():
        with recorded_routing() as kernel_routes:
            got = run_steps(model, spec, "cuda", torch.bfloat16, prompts, 4)
        with torch_references(), recorded_routing(spec, replay=kernel_routes):
            ref = run_steps(model, spec, "cuda", torch.bfloat16, prompts, 4)
    errors = [rel_err(a, b) for a, b in zip(got, ref)]
    print(f"{config}: kernels vs references, same routing: logits rel err {[f'{e:.1e}' for e in errors]}")
    assert max(errors) < TOLERANCE[config]


@pytest.mark.gpu
def test_norms_writing_e4m3_rows_change_no_logit():
    """GLM-4.5V-FP8 at a prefill size (450 tokens: q/k/v, layer 0's MLP and the experts all
    quantise their input rows): the norms handing them those rows give the logits of each GEMM
    quantising its own input, to the bit, with fewer quantisation launches."""
    from localchat.engine.layers.attention import SelfAttention
    from localchat.engine.layers.mlp import GatedMLP
    from localchat.engine.layers.moe import MoeBlock
    from localchat.kernels import fp8_linear as fp8_module
    from localchat.kernels import moe as moe_module

    spec = truncated_spec("glm-4.5v-fp8.json")
    model = build_model(spec, dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=3), "cuda")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 20000, (n,), generator=g) for n in (250, 200)]
    launches = {"quant_rows": 0}
    plain_quant, plain_moe_quant = fp8_module.quant_rows, moe_module.quant_rows

    def counted(x):
        launches["quant_rows"] += 1
        return plain_quant(x)

    def run():
        launches["quant_rows"] = 0
        with torch.inference_mode():
            return run_steps(model, spec, "cuda", torch.bfloat16, prompts, 1), launches["quant_rows"]

    run()  # the first forward also runs the one-time cuBLAS probes, which quantise rows of their own
    fp8_module.quant_rows, moe_module.quant_rows = counted, counted
    try:
        handed, handed_launches = run()
        blocks = (SelfAttention, GatedMLP, MoeBlock)
        saved = [b.takes_e4m3_input for b in blocks]
        for b in blocks:
            b.takes_e4m3_input = lambda self, *args: False
        try:
            own, own_launches = run()
        finally:
            for b, fn in zip(blocks, saved):
                b.takes_e4m3_input = fn
    finally:
        fp8_module.quant_rows, moe_module.quant_rows = plain_quant, plain_moe_quant
    # per layer: q/k/v and the MLP's gate/up (layer 0 dense, layer 1 experts) no longer quantise
    assert own_launches - handed_launches == 2 * spec.num_layers, (own_launches, handed_launches)
    for a, b in zip(handed, own):
        assert torch.equal(a, b)


def prefill_in_chunks(model, spec, prompt: torch.Tensor, starts: list[int], dtype, rows: int | None = None
                      ) -> torch.Tensor:
    """Prefills `prompt` as the engine does a long one: in chunks beginning at `starts` (the first
    0), each after the ones before it in the cache. Returns the logits of the last chunk's last
    `rows` rows (default: all of them), float32 on the CPU."""
    blocks = -(-len(prompt) // BLOCK)
    cache = PagedKVCache(spec.num_layers, blocks, BLOCK, spec.num_kv_heads, spec.head_dim, dtype, "cuda")
    table = list(range(blocks))
    ids = prompt.cuda()
    rope = model.rope_positions(ids, None)[0] if spec.family == "glm4v_moe" else torch.arange(len(prompt))
    for start, end in zip(starts, [*starts[1:], len(prompt)]):
        batch = ForwardBatch.build([(table, start, end - start)], rope[..., start:end], BLOCK, "cuda")
        h = model.forward(model.embed(ids[start:end]).to(dtype), batch, cache)
    return model.logits(h[-(rows or len(h)):]).float().cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["gpt-oss-120b.json", "glm-4.5v-fp8.json"])
def test_one_chunk_of_8192_tokens_matches_four_of_2048(config):
    """The engine's default chunk on a GPU (8192 tokens: every kernel of a layer at 65-74K
    (token, expert) pairs, the largest grids and offsets it launches) against the same prompt in
    four chunks of 2048, whose kernels the other tests check against their references; both with
    the same experts per token, so only arithmetic can differ."""
    spec = truncated_spec(config)
    model = build_model(spec, dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=5), "cuda")
    prompt = torch.randint(0, 20000, (8192,), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode(), recorded_routing() as routes:
        whole = prefill_in_chunks(model, spec, prompt, [0], torch.bfloat16, rows=2048)
    per_chunk = [ids[c:c + 2048] for c in range(0, 8192, 2048) for ids in routes]  # chunk by chunk, layer by layer
    with torch.inference_mode(), recorded_routing(spec, replay=per_chunk):
        chunked = prefill_in_chunks(model, spec, prompt, [0, 2048, 4096, 6144], torch.bfloat16)
    err = rel_err(whole, chunked)
    agree = (whole.argmax(-1) == chunked.argmax(-1)).float().mean().item()
    print(f"{config}: the last 2048 of 8192 tokens, one chunk vs four: logits rel err {err:.1e}, "
          f"argmax agrees on {agree:.1%} of rows")
    assert torch.isfinite(whole).all() and err < TOLERANCE[config]


@pytest.mark.gpu
@pytest.mark.parametrize("config, prefix, forced", [("glm-4.5v.json", 8200, False), ("gpt-oss-20b.json", 8200, True)])
def test_long_prefix_chunk_goes_through_cudnn(config, prefix, forced):
    """A prompt's 2048-token chunk after a long cached prefix (read in two shorter chunks, which
    stay on the paged kernel) takes cuDNN's attention on gathered keys in every full-attention
    layer (engine/layers/attention.py; for gpt-oss, whose heads of 64 the engine keeps on the
    paged kernel, forced, to run its sinks through the same path), and its logits match the same
    chunk through the paged Triton kernel."""
    from localchat.engine.layers import attention as attention_layer

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the engine takes cuDNN's prefill attention on Hopper only")
    spec = truncated_spec(config)
    model = build_model(spec, dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=3), "cuda")
    prompt = torch.randint(0, 20000, (prefix + 2048,), generator=torch.Generator().manual_seed(2))
    calls = []
    through_cudnn, pays = attention_layer.cudnn_prefill_attention, attention_layer.cudnn_prefill_pays
    saved_takes = attention_layer._takes_cudnn

    def counted(*args, **kwargs):
        calls.append(kwargs["context_lens_host"])
        return through_cudnn(*args, **kwargs)

    try:
        attention_layer.cudnn_prefill_attention = counted
        if forced:
            attention_layer.cudnn_prefill_pays = lambda *a: a[4][0] - a[5][0] >= prefix
        with torch.inference_mode(), recorded_routing() as routes:
            got = prefill_in_chunks(model, spec, prompt, [0, prefix // 2, prefix], torch.bfloat16)
        attention_layer._takes_cudnn = lambda *a, **k: False
        with torch.inference_mode(), recorded_routing(spec, replay=routes):
            ref = prefill_in_chunks(model, spec, prompt, [0, prefix // 2, prefix], torch.bfloat16)
    finally:
        attention_layer.cudnn_prefill_attention, attention_layer.cudnn_prefill_pays = through_cudnn, pays
        attention_layer._takes_cudnn = saved_takes
    full_layers = sum(t != "sliding" for t in spec.layer_types)
    assert calls == [[len(prompt)]] * full_layers  # the second chunk, in every full-attention layer
    err = rel_err(got, ref)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{config}: 2048 queries after {prefix} cached keys, cuDNN vs paged kernel: logits rel err {err:.1e}, "
          f"argmax agrees on {agree:.1%} of rows")
    assert err < TOLERANCE[config]


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["glm-4.5v.json", "gpt-oss-20b.json"])
def test_short_turn_after_prefix_takes_short_kernel(config, monkeypatch):
    """A 20-token turn after 3000 cached tokens (a short turn late in a chat) takes the short-chunk
    kernel in every full-attention layer, its keys split (sliding-window layers keep the paged
    kernel), and its logits match the same turn through the paged Triton kernel."""
    from localchat.engine.layers import attention as attention_layer

    spec = truncated_spec(config)
    model = build_model(spec, dummy_weights(spec, device="cuda", dtype=torch.bfloat16, seed=4), "cuda")
    prompt = torch.randint(0, 20000, (3020,), generator=torch.Generator().manual_seed(3))
    calls, short, splits = [], attention_layer.short_prefill_attention, attention_layer.short_prefill_splits
    monkeypatch.setattr(attention_layer, "short_prefill_attention",
                        lambda *a, **k: calls.append(k["num_splits"]) or short(*a, **k))
    monkeypatch.setattr(attention_layer, "SHORT_CHUNK_KERNEL", True)
    with torch.inference_mode(), recorded_routing() as routes:
        got = prefill_in_chunks(model, spec, prompt, [0, 2048, 3000], torch.bfloat16)
    monkeypatch.setattr(attention_layer, "SHORT_CHUNK_KERNEL", False)
    with torch.inference_mode(), recorded_routing(spec, replay=routes):
        ref = prefill_in_chunks(model, spec, prompt, [0, 2048, 3000], torch.bfloat16)
    full_layers = sum(t != "sliding" for t in spec.layer_types)
    assert calls == [splits(3020)] * full_layers and calls[0] > 1
    err = rel_err(got, ref)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{config}: 20 queries after 3000 cached keys, short-chunk vs paged kernel: logits rel err {err:.1e}, "
          f"argmax agrees on {agree:.1%} of rows")
    assert err < TOLERANCE[config]
