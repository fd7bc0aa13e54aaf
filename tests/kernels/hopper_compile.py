"""Compiles the decode-path Triton kernels for sm_90 (H100 / H200) with Triton's bundled ptxas,
without a GPU: run as a script (TRITON_INTERPRET unset) by test_hopper_compile.py. It proves
each specialization lowers to a cubin, not that it computes the right thing (the interpreter
tests and `pytest -m gpu` do that). Then the same for Ampere, Ada and Blackwell, each
with the kernels the launchers send there, in the shared memory a program gets there. Prints
one line per kernel; exits 1 if any fails. Every constexpr without a default must be given by
its case. Run under another Triton release (for
example `pip install triton==3.6.0` in a second environment, the release the H200 figures in
BENCHMARKS.md come from) it checks that release's compile too."""
import sys

from triton.backends.compiler import GPUTarget

from localchat.kernels.attention_decode import _decode_split_kernel
from localchat.kernels.attention_prefill import _prefill_kernel
from localchat.kernels.attention_short import _short_prefill_kernel
from localchat.kernels.fp8_linear import (_fp8_linear_kernel, _quant_groups_kernel, _quant_rows_kernel,
                                         _sum_splits_kernel)
from localchat.kernels.glu import _silu_mul_kernel
from localchat.kernels.gpu_facts import MEASURED_ARCH, GpuArch
from localchat.kernels.moe_align import _align_count_kernel, _align_scatter_kernel
from localchat.kernels.moe_config import default_config
from localchat.kernels.moe_gemm import (FMT_DENSE, FMT_FP8_ROW, moe_combine_kernel, moe_down_kernel,
                                        moe_gate_up_kernel)
from localchat.kernels.moe_gemv import moe_down_gemv_kernel, moe_gate_up_gemv_kernel
from localchat.kernels.moe_gemv_half2 import moe_down_half2_kernel, moe_gate_up_half2_kernel, mx_half2_x_kernel
from localchat.kernels.moe_gemv_pairs import moe_down_pairs_kernel, moe_gate_up_pairs_kernel
from localchat.kernels.moe_gemv_words import moe_down_words_kernel, moe_gate_up_words_kernel
from localchat.kernels.moe_mx_mma import moe_down_mma_kernel, moe_gate_up_mma_kernel
from localchat.kernels.moe_router import _router_kernel
from localchat.kernels.moe_routing import _route_kernel
from localchat.kernels.rmsnorm import _add_rms_norm_kernel
from localchat.kernels.rotary import _rotary_kernel
from localchat.kernels.row_gemv import row_gemv_kernel
from sass_tools import _types, compile_kernel, disassemble, main_loop, opcode, registers

# GPUs of other generations, each with the least shared memory a program gets on it: Ampere (8.6:
# RTX 30, A6000; an A100, 8.0, has more), Ada (RTX 40, L40), datacenter Blackwell (B200) and
# consumer Blackwell (RTX 50)
OTHER_GPUS = [GpuArch((8, 6), 101376), GpuArch((8, 9), 101376), GpuArch((10, 0), 232448),
              GpuArch((12, 0), 101376)]


WORDS = _types({"x_ptr": "*bf16", "a_ptr": "*bf16", "bg_ptr": "*bf16", "bu_ptr": "*bf16", "b_ptr": "*bf16",
                "out_ptr": "*bf16", "wg_ptr": "*i32", "wu_ptr": "*i32", "w_ptr": "*i32", "sg_ptr": "*u8",
                "su_ptr": "*u8", "s_ptr": "*u8", "part_ptr": "*fp32", "pair_weights_ptr": "*fp32",
                "pair_ptr": "*i64", "expert_ptr": "*i64", "alpha": "fp32", "limit": "fp32"})
WORDS_DOWN = _types({**{n: WORDS(n) for n in ("a_ptr", "b_ptr", "w_ptr", "s_ptr", "pair_weights_ptr", "pair_ptr",
                                              "expert_ptr")}, "out_ptr": "*fp32"})
HALF2 = _types({"xq_ptr": "*i32", "x_inv_scale_ptr": "*fp32", "aq_ptr": "*i32", "wg_ptr": "*i32", "wu_ptr": "*i32",
                "w_ptr": "*i32", "sg_ptr": "*u8", "su_ptr": "*u8", "s_ptr": "*u8", "bg_ptr": "*bf16", "bu_ptr": "*bf16",
                "b_ptr": "*bf16", "out_ptr": "*fp16", "expert_ptr": "*i64", "pair_weights_ptr": "*fp32",
                "act_scale": "fp32", "a_inv_scale": "fp32", "alpha": "fp32", "limit": "fp32"})
HALF2_DOWN = _types({**{n: HALF2(n) for n in ("aq_ptr", "a_inv_scale", "w_ptr", "s_ptr", "b_ptr", "expert_ptr",
                                              "pair_weights_ptr")}, "y_ptr": "*fp32"})
ROTARY_ATTENTION = _types({n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "sinks_ptr", "out_ptr", "kn_ptr", "vn_ptr")}
                          | {"tables_ptr": "*i32", "lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_ml_ptr": "*fp32",
                             "qk_scale": "fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64"})
PAIRS = _types({**{n: HALF2(n) for n in ("xq_ptr", "x_inv_scale_ptr", "bg_ptr", "bu_ptr", "out_ptr", "act_scale",
                                         "alpha", "limit")}, "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"})
PAIRS_DOWN = _types({**{n: HALF2_DOWN(n) for n in ("aq_ptr", "a_inv_scale", "b_ptr", "pair_weights_ptr", "y_ptr")},
                     "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32"})
TILE_FP8 = _types({"x_ptr": "*bf16", "a_ptr": "*bf16", "wg_ptr": "*fp8e4nv", "wu_ptr": "*fp8e4nv",
                   "w_ptr": "*fp8e4nv", "sg_ptr": "*fp32", "su_ptr": "*fp32", "s_ptr": "*fp32", "bg_ptr": "*bf16",
                   "bu_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "sorted_ids_ptr": "*i32",
                   "block_expert_ptr": "*i32", "pair_weights_ptr": "*fp32", "alpha": "fp32", "limit": "fp32"})
TILE_MX = _types({**{n: TILE_FP8(n) for n in ("x_ptr", "bg_ptr", "bu_ptr", "out_ptr", "sorted_ids_ptr",
                                              "block_expert_ptr", "alpha", "limit")},
                  "wg_ptr": "*u8", "wu_ptr": "*u8", "sg_ptr": "*u8", "su_ptr": "*u8"})
MMA = _types({"xq_ptr": "*bf16", "aq_ptr": "*bf16", "wg_ptr": "*i32", "wu_ptr": "*i32", "w_ptr": "*i32",
              "sg_ptr": "*u8", "su_ptr": "*u8", "s_ptr": "*u8", "bg_ptr": "*bf16", "bu_ptr": "*bf16", "b_ptr": "*bf16",
              "out_ptr": "*bf16", "y_ptr": "*fp32", "pair_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
              "block_expert_ptr": "*i32", "alpha": "fp32", "limit": "fp32"})

TILE_BF16 = _types({**{n: TILE_FP8(n) for n in ("x_ptr", "bg_ptr", "bu_ptr", "out_ptr", "sorted_ids_ptr",
                                                "block_expert_ptr", "alpha", "limit", "sg_ptr", "su_ptr")},
                    "wg_ptr": "*bf16", "wu_ptr": "*bf16"})
# kernels that decode through e4m3 conversions (Ada and newer), and the MXFP4 tensor-core ones
# (their assembly decode, ASM_DECODE, from Hopper)
E4M3_DECODE = (moe_gate_up_half2_kernel, moe_down_half2_kernel, moe_gate_up_pairs_kernel, moe_down_pairs_kernel)
MMA_KERNELS = (moe_gate_up_mma_kernel, moe_down_mma_kernel)

PREFILL_ATTENTION = _types({n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "sinks_ptr")}
                           | {"tables_ptr": "*i32", "lens_ptr": "*i32", "cu_ptr": "*i32", "qk_scale": "fp32"})

SHORT_PREFILL = _types({**{n: PREFILL_ATTENTION(n) for n in _prefill_kernel.arg_names},
                       "mid_o_ptr": "*fp32", "mid_ml_ptr": "*fp32", "counts_ptr": "*i32"})

CASES = []
for prefetch in (False, True):
    CASES.append((f"MXFP4 gate/up words, prefetch {prefetch}", moe_gate_up_words_kernel, WORDS,
                  dict(SORTED=False, ACT=1, HAS_BIAS=True, X_BF16=True, PREFETCH=prefetch, BLOCK_M=1, BLOCK_N=8,
                       BLOCK_K=256), 1, 3))
    CASES.append((f"MXFP4 down words, prefetch {prefetch}", moe_down_words_kernel, WORDS_DOWN,
                  dict(SORTED=False, HAS_BIAS=True, X_BF16=True, PREFETCH=prefetch, BLOCK_M=1, BLOCK_N=16,
                       BLOCK_K=256), 2, 3))
for bn, bk, warps in ((8, 256, 1), (16, 512, 4)):
    half2 = dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=bn, BLOCK_K=bk, STAGES=3, TAIL_K=64)
    CASES.append((f"MXFP4 gate/up half2 n{bn} k{bk}", moe_gate_up_half2_kernel, HALF2, half2, warps, 3))
    CASES.append((f"MXFP4 down half2 n{bn} k{bk}", moe_down_half2_kernel, HALF2_DOWN, half2, warps, 3))
CASES += [
    ("MXFP4 half2 activations", mx_half2_x_kernel,
     _types({"x_ptr": "*bf16", "xq_ptr": "*fp16", "inv_scale_ptr": "*fp32"}), dict(BLOCK_H=4096), 4, 1),
    ("residual add + RMSNorm writing the packed-f16 MoE input", _add_rms_norm_kernel,
     _types({"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
             "eps": "fp32", "xq_ptr": "*fp16", "inv_scale_ptr": "*fp32"}),
     dict(HAS_RESIDUAL=True, WEIGHT_FIRST=True, BLOCK_D=4096, HALF2=True), 8, 1),
    ("residual add + RMSNorm writing e4m3 rows", _add_rms_norm_kernel,
     _types({"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
             "eps": "fp32", "xq_ptr": "*fp8e4nv", "inv_scale_ptr": "*fp32"}),
     dict(HAS_RESIDUAL=True, WEIGHT_FIRST=False, BLOCK_D=4096, E4M3=True), 8, 1),
    ("MoE combine", moe_combine_kernel, _types({"y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": "*bf16"}),
     dict(TOP_K=4, BLOCK_H=1024), 4, 1),
    ("FP8 gate/up tile 16x64x128", moe_gate_up_kernel, TILE_FP8,
     dict(FORMAT=1, MX_DOT_SCALED=True, SBN=1, SBK=1, X_FMT="bf16", ACT=0, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64,
          BLOCK_K=128), 4, 4),
    ("FP8 down tile 16x64x128", moe_down_kernel, _types({**{n: TILE_FP8(n) for n in (
        "a_ptr", "w_ptr", "s_ptr", "b_ptr", "pair_weights_ptr", "sorted_ids_ptr", "block_expert_ptr")},
        "out_ptr": "*fp32"}),
     dict(FORMAT=1, MX_DOT_SCALED=True, SBN=1, SBK=1, X_FMT="bf16", HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64,
          BLOCK_K=128), 4, 4),
    # prefill sizes: e4m3 activations with a scale a row, FP8 x FP8 dots
    ("FP8 gate/up tile 64x128x128, e4m3 activations", moe_gate_up_kernel,
     _types({**{n: TILE_FP8(n) for n in ("wg_ptr", "wu_ptr", "sg_ptr", "su_ptr", "bg_ptr", "bu_ptr", "out_ptr",
                                        "sorted_ids_ptr", "block_expert_ptr", "alpha", "limit")},
             "x_ptr": "*fp8e4nv", "xs_ptr": "*fp32"}),
     dict(FORMAT=2, MX_DOT_SCALED=True, SBN=128, SBK=128, X_FMT="bf16", ACT=0, HAS_BIAS=False, BLOCK_M=64,
          BLOCK_N=128, BLOCK_K=128, X_SCALED=True), 8, 3),
    ("FP8 down tile 64x128x128, e4m3 activations", moe_down_kernel, _types({**{n: TILE_FP8(n) for n in (
        "w_ptr", "s_ptr", "b_ptr", "pair_weights_ptr", "sorted_ids_ptr", "block_expert_ptr")},
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "out_ptr": "*fp32"}),
     dict(FORMAT=1, MX_DOT_SCALED=True, SBN=1, SBK=1, X_FMT="bf16", HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128,
          BLOCK_K=128, X_SCALED=True), 8, 3),
    ("MXFP4 gate/up tile 16x128x128 (dot_scaled)", moe_gate_up_kernel, TILE_MX,
     dict(FORMAT=3, MX_DOT_SCALED=True, SBN=1, SBK=32, X_FMT="bf16", ACT=1, HAS_BIAS=True, BLOCK_M=16,
          BLOCK_N=128, BLOCK_K=128), 4, 3),
    # the MXFP4 tensor-core kernels: one warp (mma.sync) and one warpgroup (wgmma) tiles
    ("MXFP4 gate/up mma 8x32x128 w2", moe_gate_up_mma_kernel, MMA,
     dict(ACT=1, HAS_BIAS=True, INTERPRET=False, BLOCK_M=8, BLOCK_N=32, BLOCK_K=128, STAGES=3, OUT_CHUNK=128,
          ONE_DOT=False), 2, 3),
    ("MoE routing, gpt-oss", _route_kernel, _types({"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
                                                   "ids_ptr": "*i32", "scaling": "fp32"}),
     dict(TOP_K=4, E_PAD=128, K_PAD=4, SCORING=1, HAS_BIAS=False, RENORMALIZE=True), 4, 1),
    ("MoE routing, GLM-4.5V with its shared expert's column", _route_kernel,
     _types({"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
             "scaling": "fp32"}),
     dict(TOP_K=8, E_PAD=128, K_PAD=8, SCORING=0, HAS_BIAS=True, RENORMALIZE=True, HAS_EXTRA=True), 4, 1),
    ("MoE router in one launch, GLM-4.5V", _router_kernel,
     _types({"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "sel_bias_ptr": "*fp32", "partial_ptr": "*fp32",
             "arrivals_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32", "scaling": "fp32"}),
     dict(TOP_K=8, K_PAD=8, E_PAD=128, S_PAD=64, NUM_SPLITS=64, BLOCK_T=1, BLOCK_K=64, SCORING=0, HAS_BIAS=False,
          HAS_SEL_BIAS=True, RENORMALIZE=True, ROUND=False, HAS_EXTRA=True), 2, 1),
    # the chunked grouping as launched for 8192 pairs over 128 experts, BLOCK_M 64 (_align_by_chunks)
    ("MoE align counts per chunk", _align_count_kernel, _types({"ids_ptr": "*i32", "counts_ptr": "*i32"}),
     dict(E_PAD=128, CHUNK=64, SUB=64), 4, 1),
    ("MoE align scatter per chunk", _align_scatter_kernel,
     _types({"ids_ptr": "*i32", "counts_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32"}),
     dict(BLOCK_M=64, BM_PAD=64, E_PAD=128, CHUNK=64, SUB=64, ROWS=32, PAD_COLS=32, SLOTS=128, BLOCKS=2), 4, 1),
    ("FP8 linear K splits added", _sum_splits_kernel,
     _types({"part_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"}),
     dict(SPLIT_K=4, HAS_BIAS=True, BLOCK=1024), 4, 1),
    ("SiLU-gated product", _silu_mul_kernel, _types({"gu_ptr": "*bf16", "out_ptr": "*bf16"}), dict(BLOCK=1024), 4, 1),
    ("rotary + paged cache write, GLM-4.5V heads", _rotary_kernel,
     _types({n: "*bf16" for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "v_ptr", "kc_ptr", "vc_ptr")}
            | {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i32"}),
     dict(R=64, D=128, BLOCK_H=8, D_PAD=128, WRITE_CACHE=True), 2, 1),
    ("decode attention split, gpt-oss", _decode_split_kernel,
     _types({n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "sinks_ptr", "out_ptr")}
            | {"tables_ptr": "*i32", "lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_ml_ptr": "*fp32",
               "qk_scale": "fp32"}),
     dict(G=8, G_PAD=16, D=64, BLOCK_N=64, NUM_SPLITS=64, HAS_WINDOW=False, HAS_SINKS=True, ROTARY=False, R=2),
     4, 2),
    ("decode attention split with the new token's rotation and cache write, GLM-4.5V", _decode_split_kernel,
     ROTARY_ATTENTION,
     dict(G=12, G_PAD=16, D=128, BLOCK_N=64, NUM_SPLITS=64, HAS_WINDOW=False, HAS_SINKS=False, ROTARY=True, R=64),
     4, 2),
    # prefill: GLM-4.5V's heads (12 per KV head, head_dim 128) and gpt-oss's (sinks, sliding window)
    ("prefill attention, GLM-4.5V", _prefill_kernel, PREFILL_ATTENTION,
     dict(G=12, D=128, BLOCK_M=64, BLOCK_N=64, HAS_SINKS=False, HAS_WINDOW=False), 4, 2),
    ("prefill attention, gpt-oss", _prefill_kernel, PREFILL_ATTENTION,
     dict(G=8, D=64, BLOCK_M=64, BLOCK_N=64, HAS_SINKS=True, HAS_WINDOW=True), 4, 2),
    # the tiles prefill_tile takes for full-attention layers
    ("prefill attention, GLM-4.5V, 128x128 tiles", _prefill_kernel, PREFILL_ATTENTION,
     dict(G=12, D=128, BLOCK_M=128, BLOCK_N=128, HAS_SINKS=False, HAS_WINDOW=False), 8, 2),
    ("prefill attention, gpt-oss, 128x64 tiles", _prefill_kernel, PREFILL_ATTENTION,
     dict(G=8, D=64, BLOCK_M=128, BLOCK_N=64, HAS_SINKS=True, HAS_WINDOW=False), 8, 3),
    # short chunks after long contexts: query heads packed into the rows, keys split (and one split)
    # (the launcher's 32 x 64 tiles on 4 warps; parts evened over the programs, and not)
    ("short-chunk prefill attention, GLM-4.5V, 16 splits", _short_prefill_kernel, SHORT_PREFILL,
     dict(G=12, D=128, BLOCK_M=32, BLOCK_N=64, NUM_SPLITS=16, B_PAD=128, HAS_WINDOW=False, HAS_SINKS=False,
          BALANCED=True), 4, 2),
    ("short-chunk prefill attention, gpt-oss, one split", _short_prefill_kernel, SHORT_PREFILL,
     dict(G=8, D=64, BLOCK_M=32, BLOCK_N=64, NUM_SPLITS=1, B_PAD=16, HAS_WINDOW=True, HAS_SINKS=True,
          BALANCED=False), 4, 2),
    ("FP8 activations per token and 128 columns", _quant_groups_kernel,
     _types({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}), dict(BLOCK_G=8), 4, 1),
    ("FP8 activations per token", _quant_rows_kernel,
     _types({"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}), dict(BLOCK_K=16384), 8, 1),
    ("dense row GEMV", row_gemv_kernel,
     _types({"x_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16"}),
     dict(FORMAT=0, SBN=1, SBK=1, HAS_BIAS=True, M_PAD=1, BLOCK_N=4, BLOCK_K=256, STAGES=3), 4, 3),
    ("FP8 channel row GEMV", row_gemv_kernel,
     _types({"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"}),
     dict(FORMAT=1, SBN=1, SBK=1, HAS_BIAS=False, M_PAD=2, BLOCK_N=16, BLOCK_K=512, STAGES=3), 4, 3),
    ("FP8 block row GEMV, four scale blocks a step", row_gemv_kernel,
     _types({"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"}),
     dict(FORMAT=2, SBN=128, SBK=128, HAS_BIAS=False, M_PAD=1, BLOCK_N=16, BLOCK_K=512, STAGES=4), 4, 4),
]

# Row kernels whose K loop must come out software-pipelined (asynchronous copies into shared
# memory) at STAGES > 1: the compiler does so only for loops given num_stages explicitly, and a
# loop it leaves alone waits for every chunk's loads (1.4x slower at one token).
GEMV_FP8 = _types({"x_ptr": "*bf16", "wg_ptr": "*fp8e4nv", "wu_ptr": "*fp8e4nv", "sg_ptr": "*fp32", "su_ptr": "*fp32",
                   "bg_ptr": "*bf16", "bu_ptr": "*bf16", "out_ptr": "*bf16", "pair_ptr": "*i64", "expert_ptr": "*i64",
                   "alpha": "fp32", "limit": "fp32"})
GEMV_FP8_DOWN = _types({"a_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16",
                        "pair_weights_ptr": "*fp32", "out_ptr": "*fp32", "pair_ptr": "*i64", "expert_ptr": "*i64",
                        "arrivals_ptr": "*i32", "sum_ptr": "*bf16"})


def _tma_types(base, rows: int):
    """base's argument types plus host tensor descriptors of the codes ([1, rows, 64] int32 words)
    and the scales ([1, rows, 16] bytes): K steps of 512."""
    descs = {n: f"tensordesc<i32[1, {rows}, 64]>" for n in ("wg_desc", "wu_desc", "w_desc")}
    descs.update({n: f"tensordesc<u8[1, {rows}, 16]>" for n in ("sg_desc", "su_desc", "s_desc")})
    return lambda name: descs.get(name) or base(name)


TMA_ROWS = [
    ("MXFP4 gate/up half2 TMA n32 k512 w2, 3 stages", moe_gate_up_half2_kernel, _tma_types(HALF2, 32),
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=32, BLOCK_K=512, STAGES=3, TAIL_K=0, WIDE_X=True, TMA=True), 2, 3),
    ("MXFP4 down half2 TMA n32 k512 w2, 3 stages", moe_down_half2_kernel, _tma_types(HALF2_DOWN, 32),
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=32, BLOCK_K=512, STAGES=3, TAIL_K=0, TMA=True), 2, 3),
    # two pairs of an expert per program: a loop for two pairs and one for one, both on TMA copies
    ("MXFP4 gate/up two pairs TMA n32 k512 w2, 3 stages", moe_gate_up_pairs_kernel, _tma_types(PAIRS, 32),
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=32, BLOCK_K=512, STAGES=3, WIDE_X=True), 2, 3),
    ("MXFP4 down two pairs TMA n32 k512 w2, 3 stages", moe_down_pairs_kernel, _tma_types(PAIRS_DOWN, 32),
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=32, BLOCK_K=512, STAGES=3), 2, 3),
]

# The TMA row programs held to fewer registers (MoeConfig max_registers / down_max_registers) for
# more programs an SM: (case of TMA_ROWS, registers), each to fit without spilling in its K loop.
# One-pair gate/up 184: five programs an SM instead of four; both downs 160: six instead of five
# (at 152 the one-pair down spills in the loop under Triton 3.9, not 3.6).
REGISTER_CAPS = [(TMA_ROWS[0], 184), (TMA_ROWS[1], 160), (TMA_ROWS[3], 160)]
# kernels held to a register count by how they are written, not by a cap: the engine's decode
# attention at GLM-4.5V's shapes fits four programs of four warps an SM at 128 (three at the 154
# it held with the new key counted after the key loop; bench/NOTES-attention.md)
REGISTER_BUDGETS = [
    (("decode attention split with the new token's rotation and cache write, GLM-4.5V, as launched",
      _decode_split_kernel, ROTARY_ATTENTION,
      dict(G=12, G_PAD=16, D=128, BLOCK_N=64, NUM_SPLITS=64, HAS_WINDOW=False, HAS_SINKS=False, ROTARY=True, R=64),
      4, 2), 128),
]

PIPELINED = [
    # the MXFP4 tensor-core tiles at prefill sizes: one dot a K step (wgmma)
    ("MXFP4 gate/up mma 64x64x128 w4 (prefill)", moe_gate_up_mma_kernel, MMA,
     dict(ACT=1, HAS_BIAS=True, INTERPRET=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, STAGES=3, OUT_CHUNK=128,
          ONE_DOT=True), 4, 3),
    ("MXFP4 gate/up mma 128x64x128 w4 (long prefill)", moe_gate_up_mma_kernel, MMA,
     dict(ACT=1, HAS_BIAS=True, INTERPRET=False, BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, STAGES=3, OUT_CHUNK=128,
          ONE_DOT=True), 4, 3),
    ("MXFP4 down mma 128x64x128 w4", moe_down_mma_kernel, MMA,
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, STAGES=3, ONE_DOT=True), 4, 3),
] + [
    (f"MXFP4 gate/up half2 n8 k256 w1, 3 stages, 16-byte activation loads {wide}", moe_gate_up_half2_kernel, HALF2,
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=8, BLOCK_K=256, STAGES=3, TAIL_K=64, WIDE_X=wide), 1, 3)
    for wide in (False, True)
] + [
    # default_config's TMA tiles: 32 rows on two warps
    *TMA_ROWS,
    # GLM-4.5V's o_proj at 3-32 tokens: K split over 4 programs, their partials added by a second launch
    ("FP8 linear tile 32x32x256, K split", _fp8_linear_kernel,
     _types({"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*fp32"}),
     dict(FORMAT=1, SBN=1, SBK=1, HAS_BIAS=False, BLOCK_M=32, BLOCK_N=32, BLOCK_K=256, SPLIT_K=4), 4, 3),
    # its prefill tile (more than 32 tokens)
    ("FP8 linear tile 64x64x128", _fp8_linear_kernel,
     _types({"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16"}),
     dict(FORMAT=1, SBN=1, SBK=1, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1), 4, 3),
    ("FP8 gate/up row kernel n32 k256 w4, 3 stages", moe_gate_up_gemv_kernel, GEMV_FP8,
     dict(FORMAT=1, SBN=1, SBK=1, SORTED=False, ACT=0, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=32, BLOCK_K=256,
          STAGES=3), 4, 3),
    ("FP8 down row kernel n64 k256 w4, 3 stages, token sums", moe_down_gemv_kernel, GEMV_FP8_DOWN,
     dict(FORMAT=2, SBN=128, SBK=128, SORTED=False, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=64, BLOCK_K=256, STAGES=3,
          COMBINE=True, TOP_K=8), 4, 3),
]


def _takes(arch: GpuArch, fn, types) -> bool:
    """Whether the launchers send this kernel to a GPU of `arch` (kernels/moe_config.py
    default_config, kernels/gpu_facts.py): FP8 operands and the packed-f16 MXFP4 kernels (e4m3
    conversions) from Ada, descriptor (TMA) loads from Hopper."""
    arg_types = [str(types(n)) for n in fn.arg_names]
    if (any("fp8" in t for t in arg_types) or fn in E4M3_DECODE) and not arch.fp8:
        return False
    return arch.hopper or not any(t.startswith("tensordesc") for t in arg_types)


def _check(name: str, compile_case, arch: GpuArch, pipelined: bool, descriptors: bool, more=None) -> bool:
    """Compiles one case, checks it (and more(kernel), which asserts) and prints a line; -> whether
    it passed."""
    try:
        kernel = compile_case()
        if more is not None:
            more(kernel)
        # f16 -> bf16 in one step compiles to F2F, a slow conversion instruction: at one per
        # weight value it bound the FP8 tensor-core tiles (bench/NOTES-moe.md)
        assert "cvt.bf16.f16" not in kernel.asm["ptx"], "direct f16 -> bf16 conversion (F2F)"
        if pipelined:
            assert "async_copy_global_to_local" in kernel.asm["ttgir"], "K loop not software-pipelined"
        if pipelined and arch.hopper:
            # ptxas waits after every wgmma of a loop when it cannot keep them in flight (the
            # loop's accumulators also defined on a path that skips it, or too few registers)
            loop = main_loop(disassemble(kernel))
            mmas = sum(opcode(ins).endswith("GMMA") for ins in loop)
            waits = sum(ins.startswith("WARPGROUP.DEPBAR") for ins in loop)
            assert not mmas or waits < mmas, f"{waits} waits for {mmas} wgmma in the K loop"
            # a step's dot started from zero and added to the sums afterwards (an FP8 dot whose
            # result is added rather than accumulated in place) is waited for before the next
            restarts = sum(opcode(ins).endswith("GMMA") and ", RZ" in ins for ins in loop)
            assert not restarts, f"{restarts} wgmma in the K loop start from a zero accumulator"
        if descriptors:
            assert "async_tma_copy_global_to_local" in kernel.asm["ttgir"], "descriptor loads not TMA copies"
        shared = kernel.metadata.shared
        assert shared <= arch.shared_memory, f"{shared} bytes of shared memory, {arch.shared_memory} on the GPU"
        print(f"ok     {name}")
        return True
    except Exception as e:  # report every kernel, then fail
        print(f"FAILED {name}: {type(e).__name__}: {str(e)[:400]}")
        return False


def _prefill_tiles(arch: GpuArch):
    """default_config's tiles for GLM-4.5V's experts at 1024 tokens (8192 pairs), FP8 channel scales
    and bf16: the widest pipelined operands, which must keep to the GPU's shared memory."""
    cases = []
    for kind, fmt, types in (("FP8", FMT_FP8_ROW, TILE_FP8), ("bf16", FMT_DENSE, TILE_BF16)):
        if fmt == FMT_FP8_ROW and not arch.fp8:
            continue
        cfg = default_config(8192, 128, fmt, True, 2, bf16=fmt == FMT_DENSE, arch=arch)
        if cfg.fp8_act:  # e4m3 activations with a scale a row
            types = _types({**{n: types(n) for n in moe_gate_up_kernel.arg_names}, "x_ptr": "*fp8e4nv",
                            "xs_ptr": "*fp32"})
        tile = dict(FORMAT=fmt, MX_DOT_SCALED=True, SBN=1, SBK=1, X_FMT="bf16", HAS_BIAS=False, BLOCK_M=cfg.block_m,
                    BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, X_SCALED=cfg.fp8_act, PAIRS_MAJOR=cfg.pairs_major)
        label = (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}, {cfg.num_stages} stages"
                 + (", e4m3 activations" if cfg.fp8_act else "") + (", pairs-major" if cfg.pairs_major else ""))
        cases.append((f"{kind} gate/up tile {label}", moe_gate_up_kernel, types, dict(tile, ACT=0), cfg.num_warps,
                      cfg.num_stages))
        if cfg.fp8_act:
            down_types = _types({**{n: TILE_FP8(n) for n in moe_down_kernel.arg_names}, "a_ptr": "*fp8e4nv",
                                 "as_ptr": "*fp32", "out_ptr": "*bf16"})
            down_n, down_k, down_warps, down_stages = cfg.down_launch
            cases.append((f"{kind} down tile {cfg.block_m}x{down_n}x{down_k}, {down_stages} stages (of {label})",
                          moe_down_kernel, down_types, dict(tile, BLOCK_N=down_n, BLOCK_K=down_k), down_warps,
                          down_stages))
    return cases


def check_target(arch: GpuArch, label: str = "") -> int:
    """Compiles every case the launchers send to a GPU of `arch`; -> the number that failed."""
    target = GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)
    failed = 0
    cases = [("plain", c) for c in CASES] + [("pipelined", c) for c in PIPELINED + _prefill_tiles(arch)]
    for kind, (name, fn, types, constexprs, warps, stages) in cases:
        if not _takes(arch, fn, types):
            continue
        if fn in MMA_KERNELS:
            constexprs = {**constexprs, "ASM_DECODE": arch.hopper}
        descriptors = any(str(types(n)).startswith("tensordesc") for n in fn.arg_names)
        # pipelined cases as launched: aligned pointers and strides make the loads vectorizable
        failed += not _check(label + name, lambda: compile_kernel(fn, types, constexprs, warps, stages,
                                                                  divisible=kind != "plain", target=target),
                             arch, kind == "pipelined", descriptors)
    return failed


def main() -> int:
    failed = check_target(MEASURED_ARCH)
    for (name, fn, types, constexprs, warps, stages), cap in REGISTER_CAPS:
        def within_cap(kernel, cap=cap):
            held = registers(kernel)
            assert held <= cap, f"{held} registers"
            spills = [ins for ins in main_loop(disassemble(kernel)) if opcode(ins) in ("LDL", "STL")]
            assert not spills, f"{len(spills)} local-memory loads / stores in the K loop"

        failed += not _check(f"{name}, at most {cap} registers",
                             lambda: compile_kernel(fn, types, constexprs, warps, stages, divisible=True,
                                                    max_registers=cap),
                             MEASURED_ARCH, True, True, more=within_cap)
    for (name, fn, types, constexprs, warps, stages), budget in REGISTER_BUDGETS:
        def within_budget(kernel, budget=budget):
            assert registers(kernel) <= budget, f"{registers(kernel)} registers"

        failed += not _check(f"{name}: at most {budget} registers", lambda: compile_kernel(
            fn, types, constexprs, warps, stages, divisible=True), MEASURED_ARCH, True, False, more=within_budget)
    for arch in OTHER_GPUS:
        major, minor = arch.capability
        failed += check_target(arch, f"sm_{major}{minor}: ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
