"""Partial NeoX rotary on q and k, optionally writing k (rotated) and v into the paged cache.

cos, sin [T, R] are precomputed per token (R <= head_dim, both halves carrying the same
angles as `cat(freqs, freqs)`; M-RoPE and YaRN are folded in by whoever builds them). NeoX
style: the first R dims split into halves x1, x2; o1 = x1 c - x2 s, o2 = x2 c + x1 s; the
remaining head_dim - R dims pass through (GLM rotates 64 of 128, gpt-oss all 64).

Grid: (tokens, head blocks of BLOCK_H): one program per token held all of its heads (GLM-4.5V: 96
q heads of 128) and ran 5 us at one token.

Cache write: slot_mapping [T] holds block * block_size + offset of each token in
k_cache/v_cache [num_blocks, block_size, Hkv, D]; a negative slot skips the token (padding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


BLOCK_H = 8  # heads per program: one token's q and k heads spread over ~10-14 programs


@triton.jit
def rotate_loaded(x, row_ptr, d, mask, cos_row, sin_row, R: tl.constexpr):
    """x: elements d of the rows at row_ptr (loaded under mask) -> rotated, float32; the rotation's
    partner elements are read from row_ptr again, the angles from cos_row / sin_row [R]."""
    # partner element of the rotation: d + R/2 for the first half, d - R/2 for the second
    partner = tl.where(d < R // 2, d + R // 2, d - R // 2)
    xp = tl.load(row_ptr + partner, mask=mask & (d < R), other=0.0).to(tl.float32)
    c = tl.load(cos_row + d, mask=d < R, other=1.0).to(tl.float32)
    s = tl.load(sin_row + d, mask=d < R, other=0.0).to(tl.float32)
    sign = tl.where(d < R // 2, -1.0, 1.0)
    x = x.to(tl.float32)
    return tl.where(d < R, x * c + sign * xp * s, x)


@triton.jit
def _rotated_heads(src_ptr, t, h0, stride_st, stride_sh, cos_ptr, sin_ptr, stride_c, H, R: tl.constexpr,
                   D: tl.constexpr, BLOCK_H: tl.constexpr, D_PAD: tl.constexpr):
    """Heads h0 .. h0 + BLOCK_H (below H) of token t of src, rotated -> (values float32
    [BLOCK_H, D_PAD], their head and dim indices, the mask of real elements)."""
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < H) & (d < D)
    rows = src_ptr + t * stride_st + h * stride_sh
    x = tl.load(rows + d, mask=mask, other=0.0)
    return rotate_loaded(x, rows, d, mask, cos_ptr + t * stride_c, sin_ptr + t * stride_c, R), h, d, mask


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, stride_c,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   v_ptr, stride_vt, stride_vh, slots_ptr, kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch,
                   block_size, HQ, HKV, R: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
                   D_PAD: tl.constexpr, WRITE_CACHE: tl.constexpr):
    """Program (token, head block): blocks below cdiv(HQ, BLOCK_H) rotate q heads, the rest k
    heads (and write k and v into the cache)."""
    t = tl.program_id(0).to(tl.int64)
    q_blocks = tl.cdiv(HQ, BLOCK_H)
    blk = tl.program_id(1)
    if blk < q_blocks:
        out, h, d, mask = _rotated_heads(q_ptr, t, blk * BLOCK_H, stride_qt, stride_qh, cos_ptr, sin_ptr, stride_c,
                                         HQ, R, D, BLOCK_H, D_PAD)
        tl.store(q_out_ptr + t * stride_qot + h * stride_qoh + d, out.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        out, h, d, mask = _rotated_heads(k_ptr, t, (blk - q_blocks) * BLOCK_H, stride_kt, stride_kh, cos_ptr,
                                         sin_ptr, stride_c, HKV, R, D, BLOCK_H, D_PAD)
        tl.store(k_out_ptr + t * stride_kot + h * stride_koh + d, out.to(k_out_ptr.dtype.element_ty), mask=mask)
        if WRITE_CACHE:
            slot = tl.load(slots_ptr + t).to(tl.int64)
            if slot >= 0:
                base = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
                tl.store(kc_ptr + base + h * stride_ch + d, out.to(kc_ptr.dtype.element_ty), mask=mask)
                v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
                tl.store(vc_ptr + base + h * stride_ch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 v: torch.Tensor | None = None, k_cache: torch.Tensor | None = None,
                 v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos/sin [T, R] -> rotated (q, k), new tensors.
    With v [T, Hkv, D], caches and slot_mapping [T], also stores rotated k and v in the cache."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    r = cos.shape[-1]
    if r > d or r % 2 or cos.shape != sin.shape or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be [T, R] contiguous with even R <= head_dim {d}, got {tuple(cos.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must be contiguous along head_dim")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    write = slot_mapping is not None
    if write and (v is None or k_cache is None or v_cache is None or k_cache.stride() != v_cache.stride()):
        raise ValueError("a cache write needs v, k_cache and v_cache (same layout) with slot_mapping")
    if t == 0:
        return q_out, k_out
    kc = k_cache if write else q
    _rotary_kernel[(t, triton.cdiv(hq, BLOCK_H) + triton.cdiv(hkv, BLOCK_H))](
        q, k, q_out, k_out, cos, sin, cos.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1),
        v if write else q, v.stride(0) if write else 0, v.stride(1) if write else 0,
        slot_mapping if write else q, kc, v_cache if write else q,
        kc.stride(0) if write else 0, kc.stride(1) if write else 0, kc.stride(2) if write else 0,
        k_cache.shape[1] if write else 1, hq, hkv, R=r, D=d, BLOCK_H=BLOCK_H, D_PAD=triton.next_power_of_2(d),
        WRITE_CACHE=write, num_warps=2)
    return q_out, k_out


def apply_rotary_ref(q, k, cos, sin, v=None, k_cache=None, v_cache=None, slot_mapping=None):
    def rot(x):
        r = cos.shape[-1]
        xf = x.float()
        x1, x2 = xf[..., : r // 2], xf[..., r // 2: r]
        c, s = cos.float()[:, None], sin.float()[:, None]
        rotated = torch.cat((x1 * c[..., : r // 2] - x2 * s[..., : r // 2], x2 * c[..., r // 2:] + x1 * s[..., r // 2:]), -1)
        return torch.cat((rotated, xf[..., r:]), -1).to(x.dtype)

    q_out, k_out = rot(q), rot(k)
    if slot_mapping is not None:
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        for cache, new in ((k_cache, k_out), (v_cache, v)):
            flat = cache.view(-1, *cache.shape[2:])  # [blocks * block_size, Hkv, D]
            flat.index_copy_(0, slots, new[keep].to(cache.dtype))
    return q_out, k_out
