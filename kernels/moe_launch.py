"""What the fused MoE's launch paths share (kernels/moe.py, kernels/moe_mxfp4.py): the activation
codes, the bias and register-cap arguments, the MXFP4 stacks as int32 code words, the dtype the
down GEMM writes each pair's row in, and the combine launch that sums them per token."""
from __future__ import annotations

import torch
import triton

from ..engine.weights.formats import Mxfp4Weight
from .moe_config import MoeConfig, MoeExperts
from .moe_gemm import ACT_SILU_GLU, ACT_SWIGLU_OAI, moe_combine_kernel

ACTIVATIONS = {"silu_glu": ACT_SILU_GLU, "swiglu_clamped": ACT_SWIGLU_OAI}


def register_caps(cfg: MoeConfig) -> tuple[dict, dict]:
    """The maxnreg launch options of the gate/up and the down kernels: max_registers for both,
    unless down_max_registers holds down."""
    down = cfg.down_max_registers or cfg.max_registers
    return (dict(maxnreg=cfg.max_registers) if cfg.max_registers else {}), (dict(maxnreg=down) if down else {})


def gate_up_biases(experts: MoeExperts, x: torch.Tensor):
    """-> (has biases, gate bias, up bias, their (expert, row) strides); x stands in for absent
    biases (never read)."""
    if experts.gate_bias is None:
        return False, x, x, (0, 0)
    bg, bu = experts.gate_bias, experts.up_bias
    if bg.stride() != bu.stride():
        raise ValueError("gate and up biases must share strides")
    return True, bg, bu, (bg.stride(0), bg.stride(1))


def down_bias(experts: MoeExperts, x: torch.Tensor) -> tuple[bool, torch.Tensor, int]:
    """-> (has a down bias, the bias [E, H] or x standing in for it (never read), its expert stride)."""
    if experts.down_bias is None:
        return False, x, 0
    return True, experts.down_bias, experts.down_bias.stride(0)


def all_mxfp4(experts: MoeExperts) -> bool:
    return all(isinstance(w, Mxfp4Weight) for w in (experts.gate, experts.up, experts.down))


def code_words(*codes: torch.Tensor):
    """MXFP4 code stacks [E, N, K/2] uint8 of equal strides -> their int32 views (words of 8 codes)
    followed by the expert and row strides in 16-byte groups (rows are whole 32-value groups), as
    the word-reading kernels take them."""
    words = [c.view(torch.int32) for c in codes]
    return (*words, words[0].stride(0) // 4, words[0].stride(1) // 4)


def pair_rows_dtype(x: torch.Tensor, cfg: MoeConfig) -> torch.dtype:
    """The dtype the down GEMM writes each pair's row in, for the combine to sum. The tiles
    (prefill sizes) write bf16 for bf16 activations: every row is written once and read once, and
    at 2048 tokens float32 rows were ~0.3 GB a GLM-4.5V layer (each row is one rounding further
    from the float32 sum; the layer's output is bf16 anyway). The row kernels (decode sizes) keep
    float32, where the rows are few."""
    return torch.bfloat16 if x.dtype == torch.bfloat16 and not cfg.gemv else torch.float32


def combine(y: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = the sum of each token's k rows of y [T * k, H] (float32 or bf16, routing
    weights applied), summed in float32 in a fixed order."""
    t, h = out.shape
    block_h = min(1024, triton.next_power_of_2(h))
    moe_combine_kernel[(t, triton.cdiv(h, block_h))](y, topk_ids, out, h, TOP_K=topk_ids.shape[1], BLOCK_H=block_h)
    return out
