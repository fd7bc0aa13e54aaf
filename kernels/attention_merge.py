"""Merging attention computed in parts: each part's output and log-sum-exp, plus the sinks' share.

A query whose keys were attended in two parts (cuDNN's prefill on a cached prefix and on the
chunk's own keys, kernels/attention_cudnn.py) has two softmax-weighted outputs o_a, o_b over
disjoint key sets with log-sum-exps l_a, l_b. Over all keys, and with a sink s (one more logit
without a value, gpt-oss):

    out = (o_a * e^l_a + o_b * e^l_b) / (e^l_a + e^l_b + e^s)

computed with every exponent taken against their maximum. One pass reads both parts once and
writes the result in the output's dtype straight into its rows; as torch ops it was a float32
copy of each part and half a dozen full-size element-wise passes (~0.5 ms a layer for GLM-4.5V's
2048-query chunk, BENCHMARKS.md "Prefill attention").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 32  # query rows a program, of one head


@triton.jit
def _merge_kernel(out_ptr, a_ptr, a_lse_ptr, b_ptr, b_lse_ptr, sinks_ptr, T,
                  s_out_t, s_out_h, s_a_t, s_a_h, s_b_t, s_b_h, s_la_h, s_la_t, s_lb_h, s_lb_t,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                  HAS_B: tl.constexpr, HAS_SINKS: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    rows = t < T
    mask = rows[:, None] & (d[None, :] < D)
    t64 = t.to(tl.int64)
    lse_a = tl.load(a_lse_ptr + h * s_la_h + t64 * s_la_t, mask=rows, other=0.0)
    top = lse_a
    if HAS_B:
        lse_b = tl.load(b_lse_ptr + h * s_lb_h + t64 * s_lb_t, mask=rows, other=0.0)
        top = tl.maximum(top, lse_b)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    w_a = tl.exp(lse_a - top)
    total = w_a
    acc = tl.load(a_ptr + t64[:, None] * s_a_t + h * s_a_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
    acc = acc * w_a[:, None]
    if HAS_B:
        w_b = tl.exp(lse_b - top)
        total += w_b
        part = tl.load(b_ptr + t64[:, None] * s_b_t + h * s_b_h + d[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += part * w_b[:, None]
    if HAS_SINKS:
        total += tl.exp(sink - top)
    tl.store(out_ptr + t64[:, None] * s_out_t + h * s_out_h + d[None, :],
             (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _check(name: str, o: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    if o.shape != out.shape or lse.shape != (out.shape[1], out.shape[0]) or o.stride(-1) != 1:
        raise ValueError(f"merge_attention_parts: {name} is {tuple(o.shape)} (strides {o.stride()}) with a "
                         f"log-sum-exp of {tuple(lse.shape)}; expected {tuple(out.shape)} contiguous along D and "
                         f"[{out.shape[1]}, {out.shape[0]}]")


def merge_attention_parts(out: torch.Tensor, a: torch.Tensor, a_lse: torch.Tensor,
                          b: torch.Tensor | None = None, b_lse: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None) -> torch.Tensor:
    """out [T, H, D] (written in place, any strides with D contiguous); a, b [T, H, D] each part's
    softmax-weighted output (any strides, D contiguous); a_lse, b_lse [H, T] float32, natural log;
    sinks [H] or None. b may be None (one part: only the sinks' share is applied). Returns out."""
    _check("part a", a, a_lse, out)
    if b is not None:
        _check("part b", b, b_lse, out)
    if out.stride(-1) != 1:
        raise ValueError(f"merge_attention_parts writes rows contiguous along D, got strides {out.stride()}")
    t, h, d = out.shape
    if t == 0:
        return out
    b_, b_lse_ = (a, a_lse) if b is None else (b, b_lse)
    _merge_kernel[(triton.cdiv(t, BLOCK_T), h)](
        out, a, a_lse, b_, b_lse_, sinks if sinks is not None else a_lse, t,
        out.stride(0), out.stride(1), a.stride(0), a.stride(1), b_.stride(0), b_.stride(1),
        a_lse.stride(0), a_lse.stride(1), b_lse_.stride(0), b_lse_.stride(1),
        D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_T=BLOCK_T, HAS_B=b is not None, HAS_SINKS=sinks is not None)
    return out


def merge_attention_parts_ref(out, a, a_lse, b=None, b_lse=None, sinks=None):
    lses = [a_lse] + ([b_lse] if b is not None else [])
    total = torch.logsumexp(torch.stack(lses), dim=0)
    acc = sum(torch.exp(lse - total).t()[:, :, None] * o.float() for o, lse in zip([a, b], lses))
    if sinks is not None:  # the sink's logit joins the denominator: a share sigmoid(total - s) stays
        acc = acc * torch.sigmoid(total - sinks.float()[:, None]).t()[:, :, None]
    out.copy_(acc)
    return out
