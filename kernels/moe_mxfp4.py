"""The MXFP4 experts' own launch paths of fused_moe (kernels/moe.py): the packed-f16 row kernels
at decode sizes (kernels/moe_gemv_half2.py, one pair a program, fed through pointers or the TMA
engine; kernels/moe_gemv_pairs.py, two pairs of one expert a program) and the tensor-core kernels
that decode each expert's rows once for all its pairs (kernels/moe_mx_mma.py)."""
from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ..engine.weights.formats import rows_aligned
from .moe_align import moe_align
from .moe_config import MoeConfig, MoeExperts
from .moe_gemv_half2 import act_scale_exp, moe_down_half2_kernel, moe_gate_up_half2_kernel, mx_half2_x_kernel
from .moe_gemv_pairs import moe_down_pairs_kernel, moe_gate_up_pairs_kernel
from .moe_launch import ACTIVATIONS, all_mxfp4, code_words, combine, down_bias, pair_rows_dtype, register_caps
from .moe_mx_mma import chunk_major, moe_down_mma_kernel, moe_gate_up_mma_kernel

TMA_ALIGN = 16  # bytes: the tensor-copy engine's row alignment


def tma_descriptors(words: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int):
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


def half2_experts(x: torch.Tensor, experts: MoeExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   cfg: MoeConfig, interpret: bool, gate, up, down, biases, out: torch.Tensor,
                   x_half2: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The experts on kernels/moe_gemv_half2.py: activations to f16 pairs (one launch, unless
    x_half2 brings them), gate/up with the clamped SwiGLU, down with the routing weight, then the
    sum of each token's rows into out [T, H] (the combine launch). gate (weight, scales, scale
    strides), up (weight, scales), down (weight, scales, scale strides) as moe.py's _kernel_weight gives
    them; biases as gate_up_biases. -> out."""
    t, h = x.shape
    k = topk_ids.shape[1]
    i = experts.intermediate_size
    if not (all_mxfp4(experts) and cfg.gemv and cfg.block_m in (1, 2) and experts.activation == "swiglu_clamped"):
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
    gate_words, up_words, stride_we, stride_wn = code_words(wg, wu)
    down_words, stride_de, stride_dn = code_words(wd)
    act = torch.empty((num_pairs, i), dtype=torch.float16, device=x.device)
    y = torch.empty((num_pairs, h), dtype=torch.float32, device=x.device)
    has_down_bias, bd, bd_stride = down_bias(experts, x)
    pair_weights = topk_weights.reshape(-1).to(torch.float32)
    gate_up_descs, down_descs = {}, {}
    if cfg.tma:
        (wg_desc, sg_desc), (wu_desc, su_desc) = (tma_descriptors(words, scales, cfg.block_n, cfg.block_k)
                                                  for words, scales in ((gate_words, sg), (up_words, su)))
        gate_up_descs = dict(wg_desc=wg_desc, wu_desc=wu_desc, sg_desc=sg_desc, su_desc=su_desc, TMA=True)
    if cfg.tma_down:
        w_desc, s_desc = tma_descriptors(down_words, sd, down_n, down_k)
        down_descs = dict(w_desc=w_desc, s_desc=s_desc, TMA=True)
    gate_up_regs, down_regs = register_caps(cfg)
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
        return combine(y, topk_ids, out)
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
    return combine(y, topk_ids, out)


def mma_experts(x: torch.Tensor, experts: MoeExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 cfg: MoeConfig, interpret: bool, gate, up, down, biases, out: torch.Tensor,
                 asm_decode: bool = True) -> torch.Tensor:
    """The experts on kernels/moe_mx_mma.py: activations to chunk-major order, pairs grouped by
    expert (moe_align), gate/up with the activation, down with the routing weight, then the sum of
    each token's rows into out [T, H]. Arguments as for half2_experts; asm_decode: the packed
    bf16 decode (Hopper and newer), else the float32 one. -> out."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e, i = experts.num_experts, experts.intermediate_size
    if not (all_mxfp4(experts) and not cfg.gemv and x.dtype == torch.bfloat16 and cfg.block_k % 32 == 0):
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
    gate_up_regs, down_regs = register_caps(cfg)
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
        xq, *code_words(wg, wu), sg, su, *s_strides, bg, bu, *bias_strides,
        act, sorted_ids, block_expert, num_pairs, i, h, k, float(experts.alpha), float(experts.limit),
        ACT=ACTIVATIONS[experts.activation], HAS_BIAS=experts.gate_bias is not None, INTERPRET=interpret,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages, OUT_CHUNK=down_k,
        ONE_DOT=one_dot, ASM_DECODE=asm_decode, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **gate_up_regs)
    y = torch.empty((num_pairs, h), dtype=pair_rows_dtype(x, cfg), device=x.device)
    has_down_bias, bd, bd_stride = down_bias(experts, x)
    moe_down_mma_kernel[(b_max, triton.cdiv(h, down_n))](
        act, *code_words(wd), sd, *sd_strides, bd, bd_stride, topk_weights.reshape(-1).to(torch.float32), y,
        y.stride(0), sorted_ids, block_expert, num_pairs, h, i, HAS_BIAS=has_down_bias, INTERPRET=interpret,
        BLOCK_M=cfg.block_m, BLOCK_N=down_n, BLOCK_K=down_k, STAGES=down_stages, ONE_DOT=one_dot,
        ASM_DECODE=asm_decode, num_warps=down_warps, num_stages=down_stages, **down_regs)
    return combine(y, topk_ids, out)
