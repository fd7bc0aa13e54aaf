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
Routing (topk_weights, topk_ids) comes from kernels/moe_routing.py.

Weights stay in their checkpoint format (kernels/moe_gemm.py lists the four). The expert stacks
(`MoeExperts`), the launch configuration (`MoeConfig`) and its defaults are in moe_config.py; they
are imported here too, as callers of fused_moe need them.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..engine.weights.formats import DenseWeight, Fp8Weight, LinearWeight, Mxfp4Weight, rows_aligned
from .arrivals import arrival_counts
from .fp8_linear import quant_rows, quant_rows_ref
from .gpu_facts import compiled_on_gpu, gpu_arch
from .moe_align import moe_align
from .moe_config import MoeConfig, MoeExperts, default_config, gpt_oss_experts, split_gate_up  # noqa: F401
from .moe_gemm import (ACT_SILU_GLU, ACT_SWIGLU_OAI, FMT_DENSE, FMT_FP8_BLK, FMT_FP8_ROW, FMT_MXFP4,
                       moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel)
from .moe_gemv import moe_down_gemv_kernel, moe_gate_up_gemv_kernel
from .moe_gemv_half2 import act_scale_exp, moe_down_half2_kernel, moe_gate_up_half2_kernel, mx_half2_x_kernel
from .moe_gemv_pairs import moe_down_pairs_kernel, moe_gate_up_pairs_kernel
from .moe_gemv_words import moe_down_words_kernel, moe_gate_up_words_kernel
from .moe_mx_mma import chunk_major, moe_down_mma_kernel, moe_gate_up_mma_kernel

ACTIVATIONS = {"silu_glu": ACT_SILU_GLU, "swiglu_clamped": ACT_SWIGLU_OAI}


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
    if not (compiled_on_gpu(device) and x_dtype in (torch.bfloat16, torch.float16) and _all_mxfp4(experts)
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
    has_bias, bg, bu, bias_strides = _gate_up_biases(experts, x)
    if cfg.mx_mma:
        return _mma_experts(x, experts, topk_weights, topk_ids, cfg, not on_gpu, (wg, sg, s_strides), (wu, su),
                            (wd, sd, sd_strides), (bg, bu, bias_strides), out, asm_decode=arch.hopper)
    if cfg.mx_half2:
        return _half2_experts(x, experts, topk_weights, topk_ids, cfg, not on_gpu, (wg, sg, s_strides), (wu, su),
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
    gate_up_regs, down_regs = _register_caps(cfg)
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
            x, x.stride(0), *_code_words(wg, wu), *scales_biases,
            act, act.stride(0), sorted_ids, block_expert, num_pairs, i, h, k,
            float(experts.alpha), float(experts.limit), SORTED=sorted_pairs, X_BF16=x_bf16, PREFETCH=cfg.prefetch,
            ACT=ACTIVATIONS[experts.activation], HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, **launch, **gate_up_regs)
    elif cfg.gemv:
        moe_gate_up_gemv_kernel[(b_max, triton.cdiv(i, cfg.block_n))](
            *gate_up_args, SORTED=sorted_pairs, STAGES=cfg.num_stages, **gate_up_meta)
    else:
        x_scaled = fp8_activations(x, experts, num_pairs, cfg)
        xq, xs = (x_e4m3 if x_e4m3 is not None else _quantized_rows(x)) if x_scaled else (x, x)
        moe_gate_up_kernel[(b_max, triton.cdiv(i, cfg.block_n))](
            xq, xq.stride(0), *gate_up_args[2:], xs, MX_DOT_SCALED=cfg.mx_dot_scaled, X_FMT=x_fmt,
            X_SCALED=x_scaled, PAIRS_MAJOR=cfg.pairs_major, **gate_up_meta)
    y = torch.empty((num_pairs, h), dtype=_pair_rows_dtype(x, cfg), device=x.device)
    has_down_bias, bd, bd_stride = _down_bias(experts, x)
    pair_weights = topk_weights.reshape(-1).to(torch.float32)
    down_args = (act, act.stride(0), wd, wd.stride(0), wd.stride(1), sd, *sd_strides,
                 bd, bd_stride, pair_weights, y, y.stride(0), sorted_ids, block_expert, num_pairs, h, i)
    down_meta = dict(FORMAT=fmt_d, SBN=sdblock[0], SBK=sdblock[1], HAS_BIAS=has_down_bias,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, **launch, **down_regs)
    if words_down:
        moe_down_words_kernel[(b_max, triton.cdiv(h, cfg.block_n))](
            act, act.stride(0), *_code_words(wd), *down_args[5:],
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
    return _combine(y, topk_ids, out)


def _register_caps(cfg: MoeConfig) -> tuple[dict, dict]:
    """The maxnreg launch options of the gate/up and the down kernels: max_registers for both,
    unless down_max_registers holds down."""
    down = cfg.down_max_registers or cfg.max_registers
    return (dict(maxnreg=cfg.max_registers) if cfg.max_registers else {}), (dict(maxnreg=down) if down else {})


def _gate_up_biases(experts: MoeExperts, x: torch.Tensor):
    """-> (has biases, gate bias, up bias, their (expert, row) strides); x stands in for absent
    biases (never read)."""
    if experts.gate_bias is None:
        return False, x, x, (0, 0)
    bg, bu = experts.gate_bias, experts.up_bias
    if bg.stride() != bu.stride():
        raise ValueError("gate and up biases must share strides")
    return True, bg, bu, (bg.stride(0), bg.stride(1))


def _down_bias(experts: MoeExperts, x: torch.Tensor) -> tuple[bool, torch.Tensor, int]:
    """-> (has a down bias, the bias [E, H] or x standing in for it (never read), its expert stride)."""
    if experts.down_bias is None:
        return False, x, 0
    return True, experts.down_bias, experts.down_bias.stride(0)


def _all_mxfp4(experts: MoeExperts) -> bool:
    return all(isinstance(w, Mxfp4Weight) for w in (experts.gate, experts.up, experts.down))


def _code_words(*codes: torch.Tensor):
    """MXFP4 code stacks [E, N, K/2] uint8 of equal strides -> their int32 views (words of 8 codes)
    followed by the expert and row strides in 16-byte groups (rows are whole 32-value groups), as
    the word-reading kernels take them."""
    words = [c.view(torch.int32) for c in codes]
    return (*words, words[0].stride(0) // 4, words[0].stride(1) // 4)


TMA_ALIGN = 16  # bytes: the tensor-copy engine's row alignment


def _tma_descriptors(words: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int):
    """Tensor descriptors of one MXFP4 stack for the packed-f16 kernels' TMA loads: codes as
    int32 words [E, N, K / 8] in boxes [1, block_n, block_k / 8], E8M0 scales [E, N, K / 32] in
    boxes [1, block_n, block_k / 32]."""
    if block_k % 512:
        raise ValueError(f"the TMA row kernels need block_k a multiple of 512 (16-byte scale boxes), got {block_k}")
    for t, what in ((words, "codes"), (scales, "scales")):
        if not rows_aligned(t, TMA_ALIGN):
            raise ValueError(f"the TMA loads need the MXFP4 {what} at 16-byte aligned rows (strides "
                             f"{tuple(t.stride())} of {t.element_size()}-byte elements); store the scales with "
                             "engine.weights.formats.aligned_scale_rows")
    return (TensorDescriptor.from_tensor(words, [1, block_n, block_k // 8]),
            TensorDescriptor.from_tensor(scales, [1, block_n, block_k // 32]))


def _pair_rows_dtype(x: torch.Tensor, cfg: MoeConfig) -> torch.dtype:
    """The dtype the down GEMM writes each pair's row in, for the combine to sum. The tiles
    (prefill sizes) write bf16 for bf16 activations: every row is written once and read once, and
    at 2048 tokens float32 rows were ~0.3 GB a GLM-4.5V layer (each row is one rounding further
    from the float32 sum; the layer's output is bf16 anyway). The row kernels (decode sizes) keep
    float32, where the rows are few."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 and not cfg.gemv else torch.float32


def _combine(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = the sum of each token's k rows of y [T * k, H] (float32 or bf16, routing
    weights applied), summed in float32 in a fixed order."""
    t, h = out.shape
    block_h = min(1024, triton.next_power_of_2(h))
    moe_combine_kernel[(t, triton.cdiv(h, block_h))](y, topk_ids, out, h, TOP_K=topk_ids.shape[1], BLOCK_H=block_h)
    return out


def _half2_experts(x: torch.Tensor, experts: MoeExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   cfg: MoeConfig, interpret: bool, gate, up, down, biases, out: torch.Tensor,
                   x_half2: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The experts on kernels/moe_gemv_half2.py: activations to f16 pairs (one launch, unless
    x_half2 brings them), gate/up with the clamped SwiGLU, down with the routing weight, then the
    sum of each token's rows into out [T, H] (the combine launch). gate (weight, scales, scale
    strides), up (weight, scales), down (weight, scales, scale strides) as _kernel_weight gives
    them; biases as _gate_up_biases. -> out."""
    t, h = x.shape
    k = topk_ids.shape[1]
    i = experts.intermediate_size
    if not (_all_mxfp4(experts) and cfg.gemv and cfg.block_m in (1, 2) and experts.activation == "swiglu_clamped"):
        raise ValueError("mx_half2 needs MXFP4 experts with the clamped SwiGLU (gpt-oss) on the row kernels with "
                         "one or two pairs per program (gemv=True, block_m 1 or 2)")
    if cfg.block_m == 2 and not (cfg.tma and cfg.tma_down and cfg.tail_k == 0):
        raise ValueError("mx_half2 with two pairs of an expert per program (block_m=2) reads through the TMA "
                         "engine: it needs tma=True, tma_down=True and tail_k=0")
    if (x.dtype not in (torch.bfloat16, torch.float16) or cfg.block_k % 32 or cfg.tail_k % 32
            or cfg.down_launch[1] % 32 or cfg.tail_k < (0 if cfg.tma or cfg.tma_down else 32)):
        raise ValueError(f"mx_half2 needs bf16/fp16 activations, K steps and tail_k multiples of 32 (tail_k 0 only "
                         f"with tma or tma_down), got {x.dtype}, {cfg.block_k}, {cfg.down_launch[1]}, {cfg.tail_k}")
    (wg, sg, s_strides), (wu, su), (wd, sd, sd_strides) = gate, up, down
    bg, bu, bias_strides = biases
    down_n, down_k, down_warps, down_stages = cfg.down_launch
    num_pairs = t * k
    expert_ids = topk_ids.reshape(-1)
    if x_half2 is not None:
        xq, x_inv_scale = x_half2
        if xq.shape != (t, h) or xq.dtype != torch.float16 or not xq.is_contiguous() or x_inv_scale.shape != (t,):
            raise ValueError(f"x_half2 must be ([{t}, {h}] contiguous float16, [{t}] float32), got "
                             f"{tuple(xq.shape)} {xq.dtype} / {tuple(x_inv_scale.shape)}")
    else:
        xq = torch.empty((t, h), dtype=torch.float16, device=x.device)
        x_inv_scale = torch.empty((t,), dtype=torch.float32, device=x.device)
        mx_half2_x_kernel[(t,)](x, x.stride(0), xq, x_inv_scale, h, BLOCK_H=triton.next_power_of_2(h))
    act_exp = act_scale_exp(experts.limit)
    gate_words, up_words, stride_we, stride_wn = _code_words(wg, wu)
    down_words, stride_de, stride_dn = _code_words(wd)
    act = torch.empty((num_pairs, i), dtype=torch.float16, device=x.device)
    y = torch.empty((num_pairs, h), dtype=torch.float32, device=x.device)
    has_down_bias, bd, bd_stride = _down_bias(experts, x)
    pair_weights = topk_weights.reshape(-1).to(torch.float32)
    gate_up_descs, down_descs = {}, {}
    if cfg.tma:
        (wg_desc, sg_desc), (wu_desc, su_desc) = (_tma_descriptors(words, scales, cfg.block_n, cfg.block_k)
                                                  for words, scales in ((gate_words, sg), (up_words, su)))
        gate_up_descs = dict(wg_desc=wg_desc, wu_desc=wu_desc, sg_desc=sg_desc, su_desc=su_desc, TMA=True)
    if cfg.tma_down:
        w_desc, s_desc = _tma_descriptors(down_words, sd, down_n, down_k)
        down_descs = dict(w_desc=w_desc, s_desc=s_desc, TMA=True)
    gate_up_regs, down_regs = _register_caps(cfg)
    if cfg.block_m == 2:
        sorted_ids, block_expert = moe_align(topk_ids, experts.num_experts, 2)
        blocks = block_expert.numel()
        moe_gate_up_pairs_kernel[(triton.cdiv(i, cfg.block_n), blocks)](
            xq.view(torch.int32), x_inv_scale, wg_desc, wu_desc, sg_desc, su_desc, bg, bu, *bias_strides, act,
            float(2.0 ** act_exp), sorted_ids, block_expert, num_pairs, i, h, k, float(experts.alpha),
            float(experts.limit), HAS_BIAS=experts.gate_bias is not None, INTERPRET=interpret, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, STAGES=cfg.num_stages, WIDE_X=cfg.wide_x, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **gate_up_regs)
        moe_down_pairs_kernel[(triton.cdiv(h, down_n), blocks)](
            act.view(torch.int32), float(2.0 ** -act_exp), w_desc, s_desc, bd, bd_stride,
            pair_weights, y, y.stride(0), sorted_ids, block_expert, num_pairs, h, i,
            HAS_BIAS=has_down_bias, INTERPRET=interpret, BLOCK_N=down_n, BLOCK_K=down_k, STAGES=down_stages,
            num_warps=down_warps, num_stages=down_stages, **down_regs)
        return _combine(y, topk_ids, out)
    moe_gate_up_half2_kernel[(num_pairs, triton.cdiv(i, cfg.block_n))](
        xq.view(torch.int32), x_inv_scale, gate_words, up_words, stride_we, stride_wn, sg, su, *s_strides, bg, bu,
        *bias_strides, act, float(2.0 ** act_exp), expert_ids, i, h, k, float(experts.alpha), float(experts.limit),
        HAS_BIAS=experts.gate_bias is not None, INTERPRET=interpret, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        STAGES=cfg.num_stages, TAIL_K=min(cfg.tail_k, cfg.block_k), WIDE_X=cfg.wide_x,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **gate_up_descs, **gate_up_regs)
    moe_down_half2_kernel[(num_pairs, triton.cdiv(h, down_n))](
        act.view(torch.int32), float(2.0 ** -act_exp), down_words, stride_de, stride_dn, sd, *sd_strides, bd,
        bd_stride, pair_weights, y, y.stride(0), expert_ids, h, i, HAS_BIAS=has_down_bias, INTERPRET=interpret,
        BLOCK_N=down_n, BLOCK_K=down_k, STAGES=down_stages, TAIL_K=min(cfg.tail_k, down_k),
        num_warps=down_warps, num_stages=down_stages, **down_descs, **down_regs)
    return _combine(y, topk_ids, out)


def _mma_experts(x: torch.Tensor, experts: MoeExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 cfg: MoeConfig, interpret: bool, gate, up, down, biases, out: torch.Tensor,
                 asm_decode: bool = True) -> torch.Tensor:
    """The experts on kernels/moe_mx_mma.py: activations to chunk-major order, pairs grouped by
    expert (moe_align), gate/up with the activation, down with the routing weight, then the sum of
    each token's rows into out [T, H]. Arguments as for _half2_experts; asm_decode: the packed
    bf16 decode (Hopper and newer), else the float32 one. -> out."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e, i = experts.num_experts, experts.intermediate_size
    if not (_all_mxfp4(experts) and not cfg.gemv and x.dtype == torch.bfloat16 and cfg.block_k % 32 == 0):
        raise ValueError("mx_mma needs MXFP4 experts, bf16 activations and block_k a multiple of 32 on the tile "
                         f"kernels (gemv=False), got {x.dtype}, block_k {cfg.block_k}, gemv={cfg.gemv}")
    down_n, down_k, down_warps, down_stages = cfg.down_launch
    if not interpret and (cfg.block_k % 128 or down_k % 128 or cfg.block_m < 8):
        # K steps of 64 with 4 or 8 pairs per block computed wrong sums on an H200 (Triton 3.6)
        raise ValueError(f"mx_mma on a GPU needs block_k a multiple of 128 and block_m >= 8, got block_k "
                         f"{cfg.block_k} (down {down_k}), block_m {cfg.block_m}")
    (wg, sg, s_strides), (wu, su), (wd, sd, sd_strides) = gate, up, down
    bg, bu, bias_strides = biases
    num_pairs = t * k
    sorted_ids, block_expert = moe_align(topk_ids, e, cfg.block_m)
    b_max = block_expert.numel()
    gate_up_regs, down_regs = _register_caps(cfg)
    # one dot a K step from 64 pairs a block (prefill sizes): 10-25% shorter at 1024-4096 tokens;
    # the decode-size tiles (8-32 pairs a block) lost 5-25% with it (H100, bench/bench_moe_prefill.py),
    # so they keep four dots of a quarter step each
    one_dot = cfg.block_m >= 64
    xq = chunk_major(x, cfg.block_k)
    act_row = triton.cdiv(i, down_k) * down_k
    act = torch.empty((num_pairs, act_row), dtype=x.dtype, device=x.device)
    if act_row != i:  # the last chunk's unused columns meet zero weights: they must not be NaN
        act[:, act_row - down_k:].zero_()
    moe_gate_up_mma_kernel[(b_max, triton.cdiv(i, cfg.block_n))](
        xq, *_code_words(wg, wu), sg, su, *s_strides, bg, bu, *bias_strides,
        act, sorted_ids, block_expert, num_pairs, i, h, k, float(experts.alpha), float(experts.limit),
        ACT=ACTIVATIONS[experts.activation], HAS_BIAS=experts.gate_bias is not None, INTERPRET=interpret,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages, OUT_CHUNK=down_k,
        ONE_DOT=one_dot, ASM_DECODE=asm_decode, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **gate_up_regs)
    y = torch.empty((num_pairs, h), dtype=_pair_rows_dtype(x, cfg), device=x.device)
    has_down_bias, bd, bd_stride = _down_bias(experts, x)
    moe_down_mma_kernel[(b_max, triton.cdiv(h, down_n))](
        act, *_code_words(wd), sd, *sd_strides, bd, bd_stride, topk_weights.reshape(-1).to(torch.float32), y,
        y.stride(0), sorted_ids, block_expert, num_pairs, h, i, HAS_BIAS=has_down_bias, INTERPRET=interpret,
        BLOCK_M=cfg.block_m, BLOCK_N=down_n, BLOCK_K=down_k, STAGES=down_stages, ONE_DOT=one_dot,
        ASM_DECODE=asm_decode, num_warps=down_warps, num_stages=down_stages, **down_regs)
    return _combine(y, topk_ids, out)


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
