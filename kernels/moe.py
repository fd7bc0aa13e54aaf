"""Fused MoE forward: x [T, H] -> sum over the k routed experts of w * down(act(gate, up)).

Pipeline (5 launches, all shapes fixed by T, k, E: safe inside a CUDA graph):
moe_align (group pairs by expert) -> moe_gate_up_kernel (gate and up GEMMs with the GLU fused)
-> moe_down_kernel (down GEMM, down bias and routing weight fused) -> moe_combine_kernel.
At decode sizes the row-streaming kernels (moe_gemv*.py) take one pair per program and skip
moe_align; for MXFP4 experts with gpt-oss's clamped SwiGLU they run on packed f16 FMAs
(moe_gemv_half2.py, one more small launch that scales the activations; from 4 tokens, where the
stacks' rows are 16-byte aligned as the loader stores them, fed by the TMA engine; with
MoeConfig.block_m 2, two pairs of one expert a program, grouped by moe_align:
moe_gemv_pairs.py). From two pairs per expert on, MXFP4 experts with bf16 activations run on
tensor-core kernels that decode each expert's rows once for all its pairs (moe_mx_mma.py; the
activations are first reordered by one copy). FP8 experts at prefill sizes (MoeConfig.fp8_act)
quantise each GEMM's input rows to e4m3 first, one launch each, for FP8 x FP8 tiles.
Routing (topk_weights, topk_ids) comes from kernels/moe_routing.py. The MXFP4 experts' packed-f16
and tensor-core launch paths are in moe_mxfp4.py, what all the paths share in moe_launch.py.

Weights stay in their checkpoint format (kernels/moe_gemm.py lists the four). The expert stacks
(`MoeExperts`), the launch configuration (`MoeConfig`) and its defaults are in moe_config.py; they
are imported here too, as callers of fused_moe need them.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton

from ..engine.weights.formats import DenseWeight, Fp8Weight, LinearWeight, Mxfp4Weight, rows_aligned
from .arrivals import arrival_counts
from .fp8_linear import quant_rows, quant_rows_ref
from .gpu_facts import compiled_on_gpu, gpu_arch
from .moe_align import moe_align
from .moe_config import MoeConfig, MoeExperts, default_config, gpt_oss_experts, split_gate_up  # noqa: F401
from .moe_gemm import FMT_DENSE, FMT_FP8_BLK, FMT_FP8_ROW, FMT_MXFP4, moe_down_kernel, moe_gate_up_kernel
from .moe_gemv import moe_down_gemv_kernel, moe_gate_up_gemv_kernel
from .moe_gemv_words import moe_down_words_kernel, moe_gate_up_words_kernel
from .moe_launch import (ACTIVATIONS, all_mxfp4, code_words, combine, down_bias, gate_up_biases, pair_rows_dtype,
                         register_caps)
from .moe_mxfp4 import TMA_ALIGN, half2_experts, mma_experts


def _kernel_weight(w: LinearWeight) -> tuple[int, torch.Tensor, torch.Tensor, tuple[int, int, int], tuple[int, int]]:
    """-> (format, weight [E, N, K'], scale, scale strides (e, n, k), scale block (bn, bk))."""
    if isinstance(w, DenseWeight):
        t = w.weight
        return FMT_DENSE, t, t, (0, 0, 0), (1, 1)
    if isinstance(w, Mxfp4Weight):
        e, n, kb, _ = w.blocks.shape
        t = w.blocks.reshape(e, n, kb * 16)
        s = w.scales
        return FMT_MXFP4, t, s, (s.stride(0), s.stride(1), s.stride(2)), (1, 32)
    e, n, _ = w.weight.shape
    if w.block is None:
        s = w.scale.to(torch.float32).expand(e, n, 1)[..., 0]
        return FMT_FP8_ROW, w.weight, s, (s.stride(0), s.stride(1), 0), (1, 1)
    s = w.scale if w.scale.dtype == torch.float32 else w.scale.to(torch.float32)
    return FMT_FP8_BLK, w.weight, s, (s.stride(0), s.stride(1), s.stride(2)), w.block


def _fp8_block_k_fits(block_k: int, gemv: bool, scale_block_k: int) -> bool:
    """A K step inside one FP8 scale block, or (row-streaming kernels) a whole number of
    power-of-two blocks, each scaled after its partial sum."""
    if scale_block_k % block_k == 0:
        return True
    pow2 = scale_block_k & (scale_block_k - 1) == 0
    return gemv and pow2 and block_k % scale_block_k == 0


def _check(t: torch.Tensor, what: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{what} must be contiguous along K (stride 1), got strides {t.stride()}")


def fp8_activations(x: torch.Tensor, experts: MoeExperts, num_pairs: int, config: MoeConfig | None) -> bool:
    """Whether fused_moe (with `config`, or its default when None) quantises the activations of
    both GEMMs to e4m3, a scale a row, for FP8 x FP8 tensor-core tiles: FP8 experts on the tile
    kernels with MoeConfig.fp8_act. The per-token dynamic scaling compressed-tensors FP8 checkpoints
    are made for (models.md B), as the dense FP8 linears do from 33 tokens."""
    return _quantises_rows(experts, num_pairs, x.device, x.element_size(), config)


def _quantises_rows(experts: MoeExperts, num_pairs: int, device: torch.device, elem_bytes: int,
                    config: MoeConfig | None) -> bool:
    weights = (experts.gate, experts.up, experts.down)
    if not all(isinstance(w, Fp8Weight) for w in weights):
        return False
    fmt = FMT_FP8_ROW if experts.gate.block is None else FMT_FP8_BLK
    cfg = config or default_config(num_pairs, experts.num_experts, fmt, compiled_on_gpu(device), elem_bytes,
                                   bf16=False, arch=gpu_arch(device))
    return cfg.fp8_act and not cfg.gemv


def takes_e4m3_input(experts: MoeExperts, num_tokens: int, pairs_per_token: int, x_dtype: torch.dtype,
                     device: torch.device) -> bool:
    """Whether fused_moe with its default configuration quantises these tokens' rows to e4m3 on
    the GPU (fp8_activations), and so can take them from the norm before it (fused_moe's x_e4m3).
    pairs_per_token: top-k, plus one for a shared expert stacked behind the routed ones."""
    elem_bytes = torch.finfo(x_dtype).bits // 8
    return compiled_on_gpu(device) and _quantises_rows(experts, num_tokens * pairs_per_token, device, elem_bytes,
                                                       None)


def _quantized_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]), x ~ q * scale."""
    return (quant_rows if compiled_on_gpu(x.device) else quant_rows_ref)(x)


def takes_half2_input(experts: MoeExperts, num_tokens: int, top_k: int, x_dtype: torch.dtype,
                      device: torch.device) -> bool:
    """Whether fused_moe with its default configuration runs these tokens on the packed-f16 row
    kernels, and so can take their input form from the norm before it (fused_moe's x_half2)."""
    if not (compiled_on_gpu(device) and x_dtype in (torch.bfloat16, torch.float16) and all_mxfp4(experts)
            and experts.activation == "swiglu_clamped"):
        return False
    return default_config(num_tokens * top_k, experts.num_experts, FMT_MXFP4, True, 2,
                          bf16=x_dtype == torch.bfloat16, arch=gpu_arch(device)).mx_half2


def fused_moe(x: torch.Tensor, experts: MoeExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: MoeConfig | None = None, x_half2: tuple[torch.Tensor, torch.Tensor] | None = None,
              x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H] (bf16/fp16/fp32; MXFP4 needs bf16/fp16), topk_weights [T, k] float32,
    topk_ids [T, k] int -> [T, H] in x.dtype. A pair whose id is -1 (an expert another rank holds
    under expert parallelism) adds nothing. x_half2: x already in the packed-f16 kernels' input
    form (xq [T, H] f16, inv_scale [T]: kernels/moe_gemv_half2.py, half2_input_ref), used when
    those kernels run (takes_half2_input), so their own conversion launch is skipped. x_e4m3:
    x's rows as quant_rows makes them (e4m3 [T, H], float32 [T, 1]), used where the tiles
    quantise their input (takes_e4m3_input) instead of that launch."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e, i = experts.num_experts, experts.intermediate_size
    if experts.hidden_size != h or experts.down.shape[-2:] != (h, i):
        raise ValueError(f"x [{t}, {h}] does not match experts gate {experts.gate.shape} / down {experts.down.shape}")
    fmt, wg, sg, s_strides, sblock = _kernel_weight(experts.gate)
    fmt_u, wu, su, s_strides_u, _ = _kernel_weight(experts.up)
    fmt_d, wd, sd, sd_strides, sdblock = _kernel_weight(experts.down)
    if fmt != fmt_u or wg.stride() != wu.stride() or s_strides != s_strides_u:
        raise ValueError("gate and up must share format and strides (views of one stack or equal stacks)")
    for tensor, name in ((wg, "gate"), (wd, "down")):
        _check(tensor, name)
    if fmt == FMT_MXFP4 and x.dtype == torch.float32:
        raise ValueError("MXFP4 experts need bf16 or fp16 activations")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    on_gpu = compiled_on_gpu(x.device)
    arch = gpu_arch(x.device)
    # the MXFP4 tensor-core kernels need bf16 activations and MXFP4 down weights as well
    mma_ok = x.dtype == torch.bfloat16 and fmt_d == FMT_MXFP4
    # the TMA loads read MXFP4 stacks whose rows all start on 16-byte boundaries (scale rows
    # stored padded by the loader; a view narrowed along K may not be)
    tma_ok = (fmt == fmt_d == FMT_MXFP4 and experts.activation == "swiglu_clamped"
              and all(rows_aligned(t, TMA_ALIGN) for t in (wg, wu, wd, sg, su, sd)))
    cfg = config or default_config(t * k, e, fmt, on_gpu, x.element_size(), bf16=mma_ok, tma=tma_ok, arch=arch)
    blk_ks = [b[1] for f, b in ((fmt, sblock), (fmt_d, sdblock)) if f == FMT_FP8_BLK]
    if config is None and cfg.mx_half2 and (experts.activation != "swiglu_clamped" or fmt_d != FMT_MXFP4):
        # the packed-f16 kernels bound the GLU output by the clamp; other experts decode words
        cfg = replace(cfg, mx_half2=False, mx_words=True)
    # the down tile's own K step, when it has one, against the down weights' scale block
    down_blk_k = sdblock[1] if cfg.down_tile and fmt_d == FMT_FP8_BLK else None
    if config is None:
        # default K steps inside one scale block, whatever the checkpoint's block size
        if not all(_fp8_block_k_fits(cfg.block_k, cfg.gemv, bk) for bk in blk_ks):
            cfg = replace(cfg, block_k=math.gcd(cfg.block_k, *blk_ks))
        if down_blk_k and not _fp8_block_k_fits(cfg.down_tile[1], cfg.gemv, down_blk_k):
            down_n, down_k, *down_launch = cfg.down_tile
            cfg = replace(cfg, down_tile=(down_n, math.gcd(down_k, down_blk_k), *down_launch))
    if not all(_fp8_block_k_fits(cfg.block_k, cfg.gemv, bk) for bk in blk_ks):
        raise ValueError(f"block_k {cfg.block_k} must divide the FP8 scale block {sblock} (row-streaming "
                         "kernels: or be a multiple of a power-of-two block)")
    if cfg.gemv and FMT_MXFP4 in (fmt, fmt_d) and cfg.block_k % 32:
        raise ValueError(f"the MXFP4 row-streaming kernels need block_k a multiple of 32, got {cfg.block_k}")
    if cfg.gemv and cfg.mx_words and FMT_MXFP4 in (fmt, fmt_d) and cfg.block_m > 4:
        raise ValueError(f"the MXFP4 word-decode kernels take at most 4 pairs per program, got block_m {cfg.block_m}")
    row_kernels = cfg.gemv and cfg.block_m == 1 and fmt_d != FMT_MXFP4
    tiles = not (cfg.gemv or cfg.mx_mma or cfg.mx_half2)
    if (cfg.fused_combine and not row_kernels) or (cfg.down_tile and not (row_kernels or cfg.mx_mma or cfg.mx_half2
                                                                          or tiles)):
        raise ValueError("fused_combine needs the dense or FP8 row kernels with one pair per program (gemv=True, "
                         "block_m=1); down_tile those, the MXFP4 packed-f16, the MXFP4 tensor-core kernels or "
                         "the tensor-core tiles")
    if down_blk_k and not _fp8_block_k_fits(cfg.down_tile[1], cfg.gemv, down_blk_k):
        raise ValueError(f"down_tile block_k {cfg.down_tile[1]} must divide the FP8 scale block {sdblock} or be a "
                         "multiple of a power-of-two block")
    if cfg.pairs_major and (cfg.gemv or cfg.mx_mma or cfg.mx_half2 or FMT_MXFP4 in (fmt, fmt_d) or cfg.block_m % 16):
        raise ValueError("pairs_major is a form of the dense and FP8 tensor-core tiles (gemv, mx_mma and mx_half2 "
                         f"off, no MXFP4 weights) with block_m a multiple of 16, got {cfg}")
    num_pairs = t * k
    has_bias, bg, bu, bias_strides = gate_up_biases(experts, x)
    if cfg.mx_mma:
        return mma_experts(x, experts, topk_weights, topk_ids, cfg, not on_gpu, (wg, sg, s_strides), (wu, su),
                            (wd, sd, sd_strides), (bg, bu, bias_strides), out, asm_decode=arch.hopper)
    if cfg.mx_half2:
        return half2_experts(x, experts, topk_weights, topk_ids, cfg, not on_gpu, (wg, sg, s_strides), (wu, su),
                              (wd, sd, sd_strides), (bg, bu, bias_strides), out, x_half2)
    if cfg.gemv and cfg.block_m == 1:
        # one program per pair, in pair order: no grouping pass needed
        block_expert = topk_ids.reshape(-1)
        sorted_ids, b_max, sorted_pairs = block_expert, num_pairs, False
    else:
        sorted_ids, block_expert = moe_align(topk_ids, e, cfg.block_m)
        b_max, sorted_pairs = block_expert.numel(), True
    act = torch.empty((num_pairs, i), dtype=x.dtype, device=x.device)
    x_fmt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x.dtype, "fp32")
    gate_up_regs, down_regs = register_caps(cfg)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    scales_biases = (sg, su, *s_strides, bg, bu, *bias_strides)
    gate_up_args = (x, x.stride(0), wg, wu, wg.stride(0), wg.stride(1), *scales_biases,
                    act, act.stride(0), sorted_ids, block_expert, num_pairs, i, h, k,
                    float(experts.alpha), float(experts.limit))
    gate_up_meta = dict(FORMAT=fmt, SBN=sblock[0], SBK=sblock[1], ACT=ACTIVATIONS[experts.activation],
                        HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch,
                        **gate_up_regs)
    words_up = cfg.gemv and cfg.mx_words and fmt == FMT_MXFP4
    words_down = cfg.gemv and cfg.mx_words and fmt_d == FMT_MXFP4
    x_bf16 = x.dtype == torch.bfloat16
    if words_up:
        moe_gate_up_words_kernel[(b_max, triton.cdiv(i, cfg.block_n))](
            x, x.stride(0), *code_words(wg, wu), *scales_biases,
            act, act.stride(0), sorted_ids, block_expert, num_pairs, i, h, k,
            float(experts.alpha), float(experts.limit), SORTED=sorted_pairs, X_BF16=x_bf16, PREFETCH=cfg.prefetch,
            ACT=ACTIVATIONS[experts.activation], HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, **launch, **gate_up_regs)
    elif cfg.gemv:
        moe_gate_up_gemv_kernel[(b_max, triton.cdiv(i, cfg.block_n))](
            *gate_up_args, SORTED=sorted_pairs, STAGES=cfg.num_stages, **gate_up_meta)
    else:
        x_scaled = fp8_activations(x, experts, num_pairs, cfg)
        if not x_scaled:
            xq, xs = x, x
        else:
            xq, xs = x_e4m3 if x_e4m3 is not None else _quantized_rows(x)
        moe_gate_up_kernel[(b_max, triton.cdiv(i, cfg.block_n))](
            xq, xq.stride(0), *gate_up_args[2:], xs, MX_DOT_SCALED=cfg.mx_dot_scaled, X_FMT=x_fmt,
            X_SCALED=x_scaled, PAIRS_MAJOR=cfg.pairs_major, **gate_up_meta)
    y = torch.empty((num_pairs, h), dtype=pair_rows_dtype(x, cfg), device=x.device)
    has_down_bias, bd, bd_stride = down_bias(experts, x)
    pair_weights = topk_weights.reshape(-1).to(torch.float32)
    down_args = (act, act.stride(0), wd, wd.stride(0), wd.stride(1), sd, *sd_strides,
                 bd, bd_stride, pair_weights, y, y.stride(0), sorted_ids, block_expert, num_pairs, h, i)
    down_meta = dict(FORMAT=fmt_d, SBN=sdblock[0], SBK=sdblock[1], HAS_BIAS=has_down_bias,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch, **down_regs)
    if words_down:
        moe_down_words_kernel[(b_max, triton.cdiv(h, cfg.block_n))](
            act, act.stride(0), *code_words(wd), *down_args[5:],
            SORTED=sorted_pairs, HAS_BIAS=has_down_bias, X_BF16=x_bf16, PREFETCH=cfg.prefetch,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch, **down_regs)
    elif cfg.gemv:
        down_n, down_k, down_warps, down_stages = cfg.down_launch
        row_blocks = triton.cdiv(h, down_n)
        arrivals = arrival_counts(x.device, t * row_blocks) if cfg.fused_combine else y
        down_meta.update(BLOCK_N=down_n, BLOCK_K=down_k, num_warps=down_warps, num_stages=down_stages)
        moe_down_gemv_kernel[(b_max, row_blocks)](*down_args, arrivals, out, out.stride(0), SORTED=sorted_pairs,
                                                  STAGES=down_stages, COMBINE=cfg.fused_combine, TOP_K=k,
                                                  **down_meta)
        if cfg.fused_combine:
            return out
    else:
        aq, a_scales = _quantized_rows(act) if x_scaled else (act, act)
        down_n, down_k, down_warps, down_stages = cfg.down_launch
        down_meta.update(BLOCK_N=down_n, BLOCK_K=down_k, num_warps=down_warps, num_stages=down_stages)
        moe_down_kernel[(b_max, triton.cdiv(h, down_n))](
            aq, aq.stride(0), *down_args[2:], a_scales, MX_DOT_SCALED=cfg.mx_dot_scaled, X_FMT=x_fmt,
            X_SCALED=x_scaled, PAIRS_MAJOR=cfg.pairs_major, **down_meta)
    return combine(y, topk_ids, out)


def expert_slice(w: LinearWeight, e: int) -> LinearWeight:
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[e])
    if isinstance(w, Mxfp4Weight):
        return Mxfp4Weight(w.blocks[e], w.scales[e])
    return Fp8Weight(w.weight[e], w.scale[e], w.block)


def fused_moe_ref(x: torch.Tensor, experts: MoeExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: MoeConfig | None = None, x_half2: tuple[torch.Tensor, torch.Tensor] | None = None,
                  x_e4m3: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per-expert loop in float32 over exactly dequantised weights; the activation between the
    two GEMMs is rounded to x.dtype as the kernel stores it. Pairs of expert -1 add nothing.
    Where fused_moe quantises the activations to e4m3 (fp8_activations: FP8 experts at prefill
    sizes), so does this, the same way. config, x_half2 and x_e4m3 (forms of x the caller had
    already) are otherwise launch details: taken, not used."""
    t, h = x.shape
    k = topk_ids.shape[1]
    x_scaled = fp8_activations(x, experts, t * k, config)
    xf = _dequantized_rows(x) if x_scaled else x.to(torch.float32)
    out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    for e in flat_ids.unique().tolist():
        if e < 0:
            continue
        pairs = (flat_ids == e).nonzero().flatten()
        tokens = pairs // k
        g = xf[tokens] @ expert_slice(experts.gate, e).dequantize().T
        u = xf[tokens] @ expert_slice(experts.up, e).dequantize().T
        if experts.gate_bias is not None:
            g = g + experts.gate_bias[e].to(torch.float32)
            u = u + experts.up_bias[e].to(torch.float32)
        if experts.activation == "silu_glu":
            a = torch.nn.functional.silu(g) * u
        else:
            g = g.clamp(max=experts.limit)
            u = u.clamp(-experts.limit, experts.limit)
            a = g * torch.sigmoid(experts.alpha * g) * (u + 1.0)
        a = _dequantized_rows(a.to(x.dtype)) if x_scaled else a.to(x.dtype).to(torch.float32)
        y = a @ expert_slice(experts.down, e).dequantize().T
        if experts.down_bias is not None:
            y = y + experts.down_bias[e].to(torch.float32)
        w = topk_weights.reshape(-1)[pairs].to(torch.float32)
        out.index_add_(0, tokens, y * w[:, None])
    return out.to(x.dtype)


def _dequantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] through the e4m3 row quantisation and back, float32."""
    q, scale = quant_rows_ref(x)
    return q.to(torch.float32) * scale
