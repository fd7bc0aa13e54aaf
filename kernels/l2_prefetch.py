"""Prefetch into L2: ask for lines a program will read later, without registers to hold them.

A program whose loads depend on an index it reads first (a page table, an expert id) can only
keep as many loads in flight as its software pipeline has buffers; requesting every line of its
slice up front lets HBM work on all of it at once, and the pipelined loads that follow then find
their lines in L2 or already on the way. `prefetch.global.L2` moves no data into the SM and has
no result to wait for (PTX ISA, "prefetch, prefetchu").

Under TRITON_INTERPRET there is no assembly: the helper loads the addresses instead (and drops
the values), so the address arithmetic around it still runs in the CPU tests.
"""
from __future__ import annotations

import triton
import triton.language as tl

_PREFETCH = tl.constexpr("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")
_PREFETCH_KEEP = tl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.b32 $0, 0; }")

LINE_BYTES = 128  # an L2 cache line: one prefetch per line


@triton.jit
def prefetch_l2(ptrs, mask, KEEP: tl.constexpr, INTERPRET: tl.constexpr):
    """Prefetch the lines holding ptrs (any shape) where mask is true. KEEP: with the evict_last
    priority, for lines that must outlive other traffic before they are read."""
    if INTERPRET:
        tl.load(ptrs, mask=mask)
    else:
        addr = ptrs.to(tl.uint64, bitcast=True)
        flag = mask.to(tl.int32)
        if KEEP:
            tl.inline_asm_elementwise(_PREFETCH_KEEP, "=r,l,r", [addr, flag], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(_PREFETCH, "=r,l,r", [addr, flag], dtype=tl.int32, is_pure=False, pack=1)
