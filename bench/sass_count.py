"""Instructions per weight value in the main loop of the MXFP4 MoE kernels (word decode, packed
f16, tensor-core tiles), offline: compiles for sm_90 with Triton's bundled ptxas (no GPU needed),
disassembles with its cuobjdump, finds the longest innermost loop and divides its
instruction count by the weight values one thread handles per trip (a tensor-core tile's values
serve all of its pairs). At 32 tokens gpt-oss-120b's MoE is bound by instruction issue
(bench/NOTES-moe.md), so this count is what its time follows there.

    python bench/sass_count.py            (with TRITON_INTERPRET unset)
"""
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from hopper_compile import HALF2, HALF2_DOWN, MMA, PAIRS, PAIRS_DOWN, WORDS, WORDS_DOWN, _tma_types  # noqa: E402
from sass_tools import loads_waited_in_trip, main_loop, opcode, sass  # noqa: E402

from localchat.kernels.moe_gemv_half2 import moe_down_half2_kernel, moe_gate_up_half2_kernel  # noqa: E402
from localchat.kernels.moe_gemv_words import moe_down_words_kernel, moe_gate_up_words_kernel  # noqa: E402
from localchat.kernels.moe_gemv_pairs import moe_down_pairs_kernel, moe_gate_up_pairs_kernel  # noqa: E402
from localchat.kernels.moe_mx_mma import moe_down_mma_kernel, moe_gate_up_mma_kernel  # noqa: E402

CASES = [  # name, kernel, types, constexprs, warps, stages, weight values per program per trip
    ("gate/up words n8 k256 w1 (1 token)", moe_gate_up_words_kernel, WORDS,
     dict(SORTED=False, ACT=1, HAS_BIAS=True, X_BF16=True, PREFETCH=False, BLOCK_M=1, BLOCK_N=8,
          BLOCK_K=256), 1, 3, 2 * 8 * 256),
    ("gate/up words n16 k256 w2 (32 tokens)", moe_gate_up_words_kernel, WORDS,
     dict(SORTED=False, ACT=1, HAS_BIAS=True, X_BF16=True, PREFETCH=False, BLOCK_M=1, BLOCK_N=16,
          BLOCK_K=256), 2, 3, 2 * 16 * 256),
    ("down words n16 k256 w2 (32 tokens)", moe_down_words_kernel, WORDS_DOWN,
     dict(SORTED=False, HAS_BIAS=True, X_BF16=True, PREFETCH=False, BLOCK_M=1, BLOCK_N=16,
          BLOCK_K=256), 2, 3, 16 * 256),
] + [(f"{kind} half2 n{bn} k{bk} w{w}", fn, types,
       dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=bn, BLOCK_K=bk, STAGES=3, TAIL_K=64, **extra), w, 3,
       mats * bn * bk)
      for kind, fn, types, mats, extra in (("gate/up", moe_gate_up_half2_kernel, HALF2, 2, {}),
                                           ("down", moe_down_half2_kernel, HALF2_DOWN, 1, {}))
      for bn, bk, w in ((8, 256, 1), (16, 256, 1))] + [
    # tensor-core tiles (moe_mx_mma.py): per program and trip, one code decode for all BLOCK_M pairs
    (f"{kind} mma {bm}x{bn}x{bk} w{w}", fn, MMA,
     dict(HAS_BIAS=True, INTERPRET=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=3, ONE_DOT=bm >= 64, **extra), w, 3,
     mats * bn * bk)
    for kind, fn, mats, extra in (("gate/up", moe_gate_up_mma_kernel, 2, dict(ACT=1, OUT_CHUNK=128)),
                                  ("down", moe_down_mma_kernel, 1, {}))
    for bm, bn, bk, w in ((8, 16, 128, 1), (8, 32, 128, 1), (8, 64, 128, 4), (16, 128, 128, 4), (64, 64, 128, 4),
                          (128, 64, 128, 4))] + [
    # TMA-fed packed-f16 kernels, one pair per program and two of one expert (moe_gemv_pairs.py;
    # its two-pair loop, values counted once per pair: per value and pair)
    (f"{kind} TMA n{bn} k512 w1, {pairs} pair{'s' if pairs > 1 else ''} a program", fn,
     _tma_types(types, bn), dict(HAS_BIAS=True, INTERPRET=False, BLOCK_N=bn, BLOCK_K=512, STAGES=3, **extra), 1, 3,
     mats * bn * 512 * pairs)
    for kind, mats, bn, pairs, fn, types, extra in (
        ("gate/up", 2, 16, 1, moe_gate_up_half2_kernel, HALF2, dict(TAIL_K=0, WIDE_X=True, TMA=True)),
        ("gate/up", 2, 16, 2, moe_gate_up_pairs_kernel, PAIRS, dict(WIDE_X=True)),
        ("down", 1, 16, 1, moe_down_half2_kernel, HALF2_DOWN, dict(TAIL_K=0, TMA=True)),
        ("down", 1, 16, 2, moe_down_pairs_kernel, PAIRS_DOWN, {}))]

if __name__ == "__main__":
    for name, fn, types, constexprs, warps, stages, values in CASES:
        loop = main_loop(sass(fn, types, constexprs, warps, stages))
        per_thread = values / (32 * warps)
        ops = Counter(opcode(i) for i in loop).most_common(8)
        sync_loads = sum(1 for i in loop if opcode(i) == "LDG")
        # a load read in the trip that issues it makes the warp wait for it there
        waited = loads_waited_in_trip(loop)
        print(f"{name}: {len(loop)} instructions per trip / {per_thread:.0f} values per thread = "
              f"{len(loop) / per_thread:.2f} per value, {sync_loads} synchronous global loads ({waited} read in "
              f"the trip that issues them); "
              f"{', '.join(f'{o} {n}' for o, n in ops)}")
