"""What the fused MoE is given and how it is tiled: the expert stacks (`MoeExperts`, described
once at load time), the launch configuration (`MoeConfig`) and its measured default per decode or
prefill size (`default_config`).

Gate and up may be two stacks (GLM checkpoints store one tensor per expert; the loader stacks
them) or views of one fused [E, 2I, H] tensor, concatenated (transformers' GLM layout) or
row-interleaved (gpt-oss); `split_gate_up` makes those views without copying.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..engine.weights.formats import DenseWeight, Fp8Weight, LinearWeight, Mxfp4Weight
from .gpu_facts import MEASURED_ARCH, GpuArch
from .moe_gemm import FMT_DENSE, FMT_FP8_BLK, FMT_FP8_ROW, FMT_MXFP4


@dataclass(frozen=True)
class MoeExperts:
    """gate, up: [E, I, H]; down: [E, H, I]; biases [E, I] / [E, H] or None.
    activation: "silu_glu" (GLM: silu(g) * u) or "swiglu_clamped" (gpt-oss, alpha/limit)."""

    gate: LinearWeight
    up: LinearWeight
    down: LinearWeight
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: str = "silu_glu"
    alpha: float = 1.702
    limit: float = 7.0

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.gate.shape[-2]

    @property
    def hidden_size(self) -> int:
        return self.gate.shape[-1]


@dataclass(frozen=True)
class MoeConfig:
    # pairs per program (row kernels: pairs of one expert, grouped by moe_align when above 1; the
    # packed-f16 MXFP4 kernels take 1 or 2, 2 on the TMA loads only) or rows of a tensor-core tile
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    mx_dot_scaled: bool = True  # MXFP4 through tl.dot_scaled, else the in-kernel bit decode
    gemv: bool = False  # row-streaming kernels for decode sizes; block_m=1 also skips moe_align
    mx_words: bool = False  # MXFP4 row streaming: decode int32 words of 8 codes (kernels/moe_gemv_words.py)
    prefetch: bool = False  # MXFP4 word decode: the next K chunk requested before the current one is used
    # registers a thread of the gate/up and down kernels may use (0: the compiler's choice), for
    # more programs an SM; down_max_registers, when set, holds the down kernel instead
    max_registers: int = 0
    mx_half2: bool = False  # MXFP4 row kernels on packed f16 FMAs, one pair per program (kernels/moe_gemv_half2.py)
    # MXFP4 tensor-core tiles decoding each expert's rows once for its block_m pairs, bf16
    # activations (kernels/moe_mx_mma.py)
    mx_mma: bool = False
    # dense/FP8 row kernels, one pair per program: the down kernel adds each token's rows itself
    # (the last of its pair programs per row block; no combine launch)
    fused_combine: bool = False
    # dense/FP8 row kernels and tensor-core tiles, mx_half2 and mx_mma: (block_n, block_k,
    # num_warps, num_stages) of the down GEMM, whose shape differs from gate/up's (GLM-4.5V: 4096
    # rows of 1408 against 2 x 1408 rows of 4096; gpt-oss: one matrix against two)
    down_tile: tuple[int, int, int, int] | None = None
    # FP8 tensor-core tiles (gemv False): both GEMMs' activations quantised to e4m3 with a scale a
    # row, so the dots run FP8 x FP8 instead of converting the weights to bf16 (fp8_activations)
    fp8_act: bool = False
    # dense/FP8 tensor-core tiles (gemv False): the tile the other way round, pairs as the MMA's M
    # and weight rows as its N (kernels/moe_gemm.py, PAIRS_MAJOR); block_m a multiple of 16
    pairs_major: bool = False
    # mx_half2: K steps after the last whole block_k (gpt-oss's 2880 = 11 * 256 + 64), so no
    # decoded code is masked off; block_k gives one masked step instead
    tail_k: int = 64
    # mx_half2 gate/up: each word's four activation pairs as one 16-byte load instead of four
    # 4-byte ones. H200, gpt-oss: one token's gate/up 18.6 -> 15.9 us; slower from 8 pairs (the
    # step 1-3% at 2-4 tokens) and in down at every size (bench/moe_breakdown.py; BENCHMARKS.md);
    # the TMA-fed gate/up (tma below) gains from it at 4-32 tokens
    wide_x: bool = False
    # mx_half2: gate/up's (tma) and down's (tma_down) weight words and scales brought in by the
    # TMA engine (kernels/moe_gemv_half2.py): K steps multiples of 512, scale rows stored 16-byte
    # aligned; tail_k 0 runs the last step past K (on the boxes' zero fill, or masked where read
    # through pointers) instead of a tail
    tma: bool = False
    tma_down: bool = False
    # registers a thread of the down kernel may use (0: max_registers). The MXFP4 two-pair TMA
    # down program holds 180 at 32 rows on two warps, five programs an SM, where its 23.6 KB of
    # buffers would allow nine (bench/NOTES-moe.md)
    down_max_registers: int = 0

    @property
    def down_launch(self) -> tuple[int, int, int, int]:
        """(block_n, block_k, num_warps, num_stages) of the down kernel: down_tile, else gate/up's."""
        return self.down_tile or (self.block_n, self.block_k, self.num_warps, self.num_stages)


def _rows(w: LinearWeight, rows: slice) -> LinearWeight:
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight[:, rows])
    if isinstance(w, Mxfp4Weight):
        return Mxfp4Weight(w.blocks[:, rows], w.scales[:, rows])
    if w.block is not None:
        bn = w.block[0]
        if rows.step not in (None, 1) or rows.start % bn:
            raise ValueError(f"block-scaled FP8 gate/up rows can only be split on {bn}-row block "
                             "boundaries; pass gate and up as two stacks instead")
        stop = None if rows.stop is None else triton.cdiv(rows.stop, bn)
        return Fp8Weight(w.weight[:, rows], w.scale[:, rows.start // bn: stop], w.block)
    scale = w.scale if w.scale.shape[-2] == 1 else w.scale[:, rows]
    return Fp8Weight(w.weight[:, rows], scale, None)


def split_gate_up(gate_up: LinearWeight, interleaved: bool) -> tuple[LinearWeight, LinearWeight]:
    """[E, 2I, H] -> (gate, up) views. interleaved: even rows gate, odd rows up (gpt-oss,
    models.md C.3); else gate rows first, then up rows (transformers' fused GLM layout)."""
    two_i = gate_up.shape[-2]
    if interleaved:
        return _rows(gate_up, slice(0, None, 2)), _rows(gate_up, slice(1, None, 2))
    return _rows(gate_up, slice(0, two_i // 2)), _rows(gate_up, slice(two_i // 2, None))


def gpt_oss_experts(gate_up: LinearWeight, gate_up_bias: torch.Tensor, down: LinearWeight,
                    down_bias: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> MoeExperts:
    """gate_up [E, 2I, H] with interleaved rows, gate_up_bias [E, 2I], down [E, H, I]."""
    gate, up = split_gate_up(gate_up, interleaved=True)
    return MoeExperts(gate, up, down, gate_up_bias[:, 0::2], gate_up_bias[:, 1::2], down_bias,
                      "swiglu_clamped", alpha, limit)


SHARED_MEMORY_BUDGET = 200 * 1024
# what a tile may need beyond its pipelined operands (barriers)
SHARED_MEMORY_MARGIN = 2 * 1024


# Registers a thread for the MXFP4 TMA down kernel from 12 tokens (0: the compiler's choice).
MXFP4_DOWN_REGISTERS = 160


# Pairs an expert from which FP8 experts take e4m3 activations (the reasons at its use below).
FP8_ACT_MIN_PAIRS = 8


def default_config(num_pairs: int, num_experts: int, fmt: int, on_gpu: bool, elem_bytes: int = 2,
                   bf16: bool = True, tma: bool = False, arch: GpuArch = MEASURED_ARCH) -> MoeConfig:
    """Tile sizes by the expected pairs per expert (uniform routing). Each choice below is the
    fastest measured at that load on an H200 (bench/bench_moe_sweep.py, bench/moe_breakdown.py,
    bench/NOTES-moe.md). The row kernels' num_stages is the depth of the compiler's software
    pipeline over K (asynchronous copies of the weight and activation chunks); one-warp programs
    on pointer loads gain from it, multi-warp ones lost. MXFP4: the packed-f16 row kernels up to one pair per expert
    (gpt-oss-120b to 32 tokens, gpt-oss-20b to 8; fused_moe falls back to the word-decode kernels for
    experts other than gpt-oss's clamped SwiGLU); from 16 pairs, where the stacks allow it (tma:
    rows 16-byte aligned), their TMA-fed versions on two warps, to 1.5 pairs per expert (gpt-oss-120b
    to 48 tokens, gpt-oss-20b to 12), two pairs of an expert a program from 3/8; then with bf16
    activations the tensor-core kernels that decode each expert once for its pairs
    (moe_mx_mma.py), more pairs per block as the pairs per expert grow; fp16 activations take the
    dot_scaled tiles there. FP8: pipelined row kernels up to one pair per expert (GLM-4.5V to 16 tokens; 64 rows
    a program from two tokens; at one token the down kernel sums each token's rows and has its
    own tile), then tiles (at 8 and 16 tokens the 16x64 tile measured 10-23% slower than
    the row kernels).

    arch: the GPU's features (kernels/gpu_facts.py). Before Hopper no TMA (tma is ignored) and the
    MXFP4 tensor-core kernels decode in float32; before Ada (no e4m3 conversions) the MXFP4 row
    kernels are the word-decode ones; pipelined tiles keep to the GPU's shared memory. Those
    choices are compiled for those GPUs (tests/kernels/hopper_compile.py), not measured on them."""
    if not on_gpu:
        return MoeConfig(16, 32, 64 if fmt == FMT_MXFP4 else 32, 1, 1)
    per_expert = num_pairs / max(num_experts, 1)
    tma_rows = tma and arch.hopper and num_pairs >= 16
    row_kernels_up_to = (1.5 if tma_rows else 1) if bf16 else 4  # pairs per expert
    if fmt == FMT_MXFP4 and per_expert <= row_kernels_up_to:
        if not arch.fp8:
            # the packed-f16 kernels convert through e4m3; the word-decode kernels' one-token
            # tile (the default before the packed-f16 kernels, bench/NOTES-moe.md)
            return MoeConfig(1, 8, 256, 1, 3, gemv=True, mx_words=True)
        if tma_rows:
            # words and scales through the TMA engine from 4 tokens (gpt-oss): faster than the
            # pointer kernels at 4-32 tokens, slower at 1-2 (bench/NOTES-moe.md). 32 rows a program
            # on two warps (16 rows a warp, as one-warp programs of 16 rows, which hold ~9 warps an
            # SM; each program reads a pair's activations once for twice the rows): gpt-oss-120b
            # 5-9% shorter at 4-32 tokens than 16 rows on one warp. From 3/8 of a pair per expert
            # and 32 pairs, pairs of one expert two to a program (moe_gemv_pairs.py): gpt-oss-120b
            # at 12 / 16 / 32 tokens 2% / 5% / 10% shorter than one pair a program; gpt-oss-20b at
            # 8 / 12 tokens 3% / 13% shorter than one pair a program / the tensor-core tiles, even
            # at 16 (bench/NOTES-moe.md, "Two warps of 16 rows")
            # From 48 pairs (12 tokens) the down kernel is held to MXFP4_DOWN_REGISTERS a thread
            # (six programs an SM instead of five): gpt-oss-120b at 12 / 16 / 32 / 48 tokens 1.2% /
            # 1.5% / 1.8% / 2.4% shorter; at 4 and 8 tokens no gain (H100, bench/NOTES-moe.md,
            # "Registers a thread for more programs an SM")
            pairs = 2 if per_expert >= 0.375 and num_pairs >= 32 else 1
            down_registers = MXFP4_DOWN_REGISTERS if num_pairs >= 48 else 0
            return MoeConfig(pairs, 32, 512, 2, 3, gemv=True, mx_half2=True, wide_x=True, tma=True, tma_down=True,
                             tail_k=0, down_tile=(32, 512, 2, 3), down_max_registers=down_registers)
        if per_expert <= 0.5:
            # three stages and 16-byte activation loads in gate/up for one token's pairs (few
            # programs, each keeping more K steps in flight); from 8 pairs two stages measured 6%
            # faster (gpt-oss-120b, 2 and 4 tokens)
            one_token = num_pairs <= 4
            return MoeConfig(1, 8, 256, 1, 3 if one_token else 2, gemv=True, mx_half2=True, wide_x=one_token)
        return MoeConfig(1, 16, 256, 1, 2, gemv=True, mx_half2=True)
    if fmt == FMT_MXFP4 and bf16:
        # (pairs per expert, tile) measured best on an H200 at 2-16 pairs per expert (bench/NOTES-moe.md,
        # "Tensor-core MXFP4"); above, 64-pair blocks taking a K step in one dot (kernels/moe_mx_mma.py),
        # measured on an H100 (bench/bench_moe_prefill.py; BENCHMARKS.md, "Prefill: gpt-oss's MXFP4
        # experts"): 64 pairs by 64 rows to 64 pairs per expert (gpt-oss-120b 1024-2048 tokens),
        # then 128 by 64 (4096 tokens: 9-11% shorter than 64 by 64)
        if per_expert <= 4:  # one-warp gate/up programs, a four-warp down tile
            return MoeConfig(8, 16, 128, 1, 3, mx_mma=True, down_tile=(128, 128, 4, 3))
        for most, tile in ((8, (16, 32, 128, 2, 3)), (16, (32, 64, 128, 4, 3)), (64, (64, 64, 128, 4, 3))):
            if per_expert <= most:
                return MoeConfig(*tile, mx_mma=True)
        return MoeConfig(128, 64, 128, 4, 3, mx_mma=True)
    if fmt != FMT_MXFP4 and per_expert <= 1:
        if fmt in (FMT_FP8_ROW, FMT_FP8_BLK):
            # one token's pairs (GLM-4.5V: 8, or 9 with its shared expert folded in): each token's
            # rows summed by the down kernel (no combine launch), down on a tile of its own; from two
            # tokens 64 rows a program, which measured 11-13% faster at 2 tokens (channel scales; gate/up
            # 60 -> 48 us), 1-3% at 4, within 1% at 6, and 1-6% slower at 3 (bench/NOTES-moe.md;
            # whole model at batch 2 / 4: +8% / +6%)
            if per_expert <= 0.1:
                return MoeConfig(1, 16, 256, 2, 3, gemv=True, fused_combine=True, down_tile=(32, 256, 4, 2))
            return MoeConfig(1, 64, 256, 4, 3, gemv=True)
        return MoeConfig(1, 16, 256, 4, 1, gemv=True)
    block_k = 256 if fmt == FMT_MXFP4 else 128
    if fmt == FMT_MXFP4 and per_expert <= 16:
        cfg = MoeConfig(16, 128, 128, 4, 3)
    elif fmt != FMT_MXFP4 and per_expert <= 4:
        cfg = MoeConfig(16, 64, 128, 4, 4)
    elif fmt == FMT_DENSE and per_expert <= 16:
        cfg = MoeConfig(16, 32, block_k, 4, 4)
    elif per_expert <= 48:
        # FP8 at 16 pairs per expert (GLM-4.5V, 256 tokens): 32x64 908 us, 16x32 1176 us
        cfg = MoeConfig(32, 64, block_k, 4, 4)
    elif fmt == FMT_FP8_ROW and arch.fp8 and arch.mma_from_shared:
        # FP8 channel scales on wgmma GPUs above 48 pairs per expert: the tiles turned pairs-major,
        # gate/up 128 pairs by 128 rows (of each), down 128 by 256 (wgmma 64x128 and 64x256 where
        # the 64x128 tiles the other way round issued 64x64), four stages. H100, GLM-4.5V shapes,
        # gate/up + down kernel time (bench/bench_moe_prefill.py --kernels; BENCHMARKS.md,
        # "Prefill: GLM-4.5V's FP8 experts"): 1024 tokens 923 -> 858 us, 2048 1342 -> 1035, 4096
        # 2157 -> 1517. Block scales keep the tiles below: their per-step scaling spills there.
        cfg = MoeConfig(128, 128, 128, 8, 4, pairs_major=True, down_tile=(256, 128, 8, 4))
    else:
        # FP8 at 64 pairs per expert (GLM-4.5V, 1024 tokens): K step 128 2092 us, 64 2506 us
        cfg = MoeConfig(64, 128, 64 if fmt == FMT_DENSE else 128, 8, 3)
    # FP8 weights from 8 pairs per expert: the activations quantised to e4m3 a row at a time and
    # the dots FP8 x FP8, instead of the weights converted to bf16 in registers. H100, GLM-4.5V
    # shapes, channel / block scales (bench/bench_moe_prefill.py): 1024 tokens 2539 -> 1383 /
    # 2206 -> 1299 us, 4096 tokens 6762 -> 3215 / 5584 -> 2981 us; at 256 tokens (16 pairs per
    # expert) channel scales 844 -> 646 us of gate/up + down kernel time since the FP8 dots sum in
    # place (1124 -> 1189 before), block scales 1165 -> 967; at 64 tokens 960 -> 818 / 898 -> 898,
    # mixed. At 8 and 12 pairs an expert the kernels are 10-15% shorter with e4m3 activations too.
    # Steps that size replay captured chunk graphs (engine/runtime/chunk_graphs.py), where the two
    # quantisation launches cost no host time; there, on an H200 (GLM-4.5V-FP8, 12 layers,
    # `bench/bench_chunk_graphs.py glm-4.5v-fp8 --layers 12 --fp8-act-min-pairs 8` against 16), a
    # 128-token prompt (8-10 pairs an expert at its graph's token count) reached its first token
    # in 7.0 ms against 9.2-9.4 alone and 9.4-9.5 against 12.3 beside 8 answering chats; 16, 64 and
    # 240 tokens, whose graphs fall on the same side of both thresholds, within 5%.
    fp8_act = fmt in (FMT_FP8_ROW, FMT_FP8_BLK) and arch.fp8 and per_expert >= FP8_ACT_MIN_PAIRS
    # Pipelined tiles must fit in shared memory (227 KiB a program on Hopper, 99 KiB on Ada and
    # consumer Blackwell): fewer stages for wide (fp32) operands or a smaller GPU. Where the
    # tensor cores read both operands from shared memory (Hopper's wgmma) every stage has a
    # buffer; with mma.sync (Ampere, Ada, consumer Blackwell) the compiler keeps stages - 1
    # (sm_89 / sm_120 compiles, tests/kernels/hopper_compile.py).
    x_bytes = 1 if fp8_act else elem_bytes
    w_bytes = {FMT_DENSE: elem_bytes, FMT_MXFP4: 0.5}.get(fmt, 1)
    budget = min(SHARED_MEMORY_BUDGET, arch.shared_memory - SHARED_MEMORY_MARGIN)

    def fitted(stages: int, block_n: int, block_k: int, stacks: int) -> int:
        stage_bytes = block_k * (cfg.block_m * x_bytes + stacks * block_n * w_bytes)
        while stages > 1 and (stages if arch.mma_from_shared else stages - 1) * stage_bytes > budget:
            stages -= 1
        return stages

    down_tile = None
    if cfg.down_tile:
        down_n, down_k, down_warps, down_stages = cfg.down_tile
        down_tile = (down_n, down_k, down_warps, fitted(down_stages, down_n, down_k, 1))
    return MoeConfig(cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps,
                     fitted(cfg.num_stages, cfg.block_n, cfg.block_k, 2), fp8_act=fp8_act,
                     pairs_major=cfg.pairs_major, down_tile=down_tile)
