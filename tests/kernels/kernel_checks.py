"""Shared checks for the kernel tests."""
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# relative-error bounds per activation dtype (inputs rounded to it, float32 accumulation)
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def random_routing(t: int, e: int, k: int):
    """Routing weights [T, k] (positive, summing to 1) and k distinct expert ids [T, k] per token."""
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.rand(t, k, device=DEV) + 0.1
    return w / w.sum(-1, keepdim=True), ids


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere in out gives inf."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def quantize_fp8_rows(w: torch.Tensor):
    """w [..., N, K] float -> (e4m3 weight, float32 scale [..., N, 1])."""
    scale = w.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return (w / scale).to(torch.float8_e4m3fn), scale.to(torch.float32)


def quantize_fp8_blocks(w: torch.Tensor, bn: int = 128, bk: int = 128):
    """w [..., N, K] -> (e4m3 weight, scale [..., ceil(N/bn), ceil(K/bk)]), edge blocks partial."""
    *lead, n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, nb * bn, kb * bk, dtype=w.dtype, device=w.device)
    padded[..., :n, :k] = w
    blocks = padded.view(*lead, nb, bn, kb, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / 448.0  # [..., nb, kb]
    expanded = scale.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    return (w / expanded).to(torch.float8_e4m3fn), scale.to(torch.float32)


def random_mxfp4(*lead_n_k, device="cpu", scale_lo=118, scale_hi=123):
    """Random MXFP4 stack: blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]."""
    *lead, n, k = lead_n_k
    blocks = torch.randint(0, 256, (*lead, n, k // 32, 16), dtype=torch.uint8, device=device)
    scales = torch.randint(scale_lo, scale_hi, (*lead, n, k // 32), dtype=torch.uint8, device=device)
    return blocks, scales


def eager_time_ms(fn, reps: int = 10, warmups: int = 2) -> float:
    """Median milliseconds of fn called eagerly (for work that a CUDA graph cannot hold, or long
    enough that launch gaps do not matter), after `warmups` calls."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def cuda_time_us(fn, iters: int = 20, reps: int = 10) -> float:
    """Median microseconds per call of fn, replayed from a CUDA graph holding `iters` calls
    (graph replay removes the host launch gaps a decode step will not have either)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(iters):
                fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(times)[len(times) // 2]


def paged_cache(lens, hkv, d, block_size, dtype, spare_blocks=3):
    """Random caches whose blocks are handed out in a shuffled order, so a wrong table lookup
    reads another sequence's keys."""
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + spare_blocks
    k = torch.randn(num_blocks, block_size, hkv, d, device=DEV).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, device=DEV).to(dtype)
    tables = torch.randperm(num_blocks, device=DEV)[: len(lens) * max_blocks].view(len(lens), max_blocks)
    return k, v, tables.to(torch.int32).contiguous(), torch.tensor(lens, dtype=torch.int32, device=DEV)


# (sinks, window) of the prefill attention tests: neither, gpt-oss's sinks with and without a
# window, a window alone
PREFILL_MASKS = [(False, None), (True, None), (True, 7), (False, 12)]


def prefill_case(ctx_lens, q_lens, hkv, group, d, block_size, dtype, sinks: bool, window):
    """The arguments of a paged prefill attention call (q, caches, tables, context lens, query
    starts, longest chunk, scale, sinks, window): each sequence's last q_lens[i] of ctx_lens[i]
    tokens are its queries, hkv * group query heads of d."""
    k, v, tables, ctx = paged_cache(ctx_lens, hkv, d, block_size, dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), hkv * group, d, device=DEV).to(dtype)
    s = torch.randn(hkv * group, device=DEV) if sinks else None
    return q, k, v, tables, ctx, cu, max(q_lens), d ** -0.5, s, window


def random_glm_weights(fmt: str, e: int, i: int, h: int, *, dtype=torch.float32, block=(128, 128), device=DEV):
    """GLM-shaped expert stacks [gate, up] [E, I, H] and down [E, H, I] with random weights in
    `fmt`: "dense" (in dtype), "fp8_channel", or "fp8_block" (scales on `block`)."""
    from localchat.engine.weights.formats import DenseWeight, Fp8Weight

    ws = [torch.randn(e, *s, device=device) / s[1] ** 0.5 for s in ((i, h), (i, h), (h, i))]
    if fmt == "dense":
        return [DenseWeight(w.to(dtype)) for w in ws]
    if fmt == "fp8_channel":
        return [Fp8Weight(*quantize_fp8_rows(w)) for w in ws]
    return [Fp8Weight(*quantize_fp8_blocks(w, *block), block=block) for w in ws]


def with_aligned_scale_rows(experts):
    """MXFP4 experts with their scale rows stored 16-byte aligned, as the loader stores them (the
    TMA-fed kernels need it)."""
    from dataclasses import replace

    from localchat.engine.weights.formats import aligned_scale_rows

    return replace(experts, gate=aligned_scale_rows(experts.gate), up=aligned_scale_rows(experts.up),
                   down=aligned_scale_rows(experts.down))


def random_gpt_oss_experts(e: int, i: int, h: int, *, bias_dtype=torch.float32, device=DEV):
    """gpt-oss experts: MXFP4 gate_up [E, 2I, H] (rows interleaved) and down [E, H, I] with biases."""
    from localchat.engine.weights.formats import Mxfp4Weight
    from localchat.kernels.moe import gpt_oss_experts

    return gpt_oss_experts(Mxfp4Weight(*random_mxfp4(e, 2 * i, h, device=device)),
                           torch.randn(e, 2 * i, device=device, dtype=bias_dtype),
                           Mxfp4Weight(*random_mxfp4(e, h, i, device=device)),
                           torch.randn(e, h, device=device, dtype=bias_dtype))
