"""Weights in their checkpoint formats, and the dequantize references for each.

A linear weight is one of three frozen records. They keep the bytes exactly as the checkpoint
stores them; the kernels read them directly on CUDA, and `dequantize` (a slow, exact reference)
serves the CPU path and the tests. Leading dims `...` are empty for a plain linear and [E] for
a stack of experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# E2M1 code -> value; bit 3 is the sign (OCP Microscaling Formats v1.0, section 5.3.3).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class DenseWeight:
    """weight: [..., N, K] bf16/fp16/fp32."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def __getitem__(self, index) -> "DenseWeight":
        """Index the leading (expert) dims: w[e] is expert e's [N, K] weight."""
        return DenseWeight(self.weight[index])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)


@dataclass(frozen=True)
class Fp8Weight:
    """weight: [..., N, K] float8_e4m3fn; W = weight * scale, with scale (float32) of shape
      channel: [..., N, 1];  tensor: [..., 1, 1];
      block:   [..., ceil(N / bn), ceil(K / bk)] for block=(bn, bk); edge blocks are partial.
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def __getitem__(self, index) -> "Fp8Weight":
        return Fp8Weight(self.weight[index], self.scale[index], self.block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight.to(torch.float32)
        s = self.scale.to(torch.float32)
        if self.block is not None:
            bn, bk = self.block
            n, k = w.shape[-2:]
            s = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
        return (w * s).to(dtype)


def fp8_rows(w: torch.Tensor) -> Fp8Weight:
    """w [..., N, K] (bf16/fp16/fp32) -> the FP8 channel layout of the FP8 checkpoints: e4m3 codes
    and a float32 scale per row, each row's largest magnitude at e4m3's largest finite value (the
    codes rounded to nearest). An all-zero row gets a tiny finite scale and zero codes; the FP8
    kernels encode activations per token the same way (kernels/fp8_linear.py quant_rows)."""
    wf = w.to(torch.float32)
    # divided by a tensor, not a Python number: CUDA divides by a number as a product with its
    # reciprocal, one rounding off the CPU's quotient, which moves codes at rounding boundaries,
    # and the same weights must give the same codes on either device
    largest = torch.full((), FP8_MAX, dtype=torch.float32, device=wf.device)
    scale = wf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / largest
    return Fp8Weight((wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale)


@dataclass(frozen=True)
class Mxfp4Weight:
    """blocks: [..., N, K/32, 16] uint8, two E2M1 codes a byte, low nibble first (element 2j in
    the low 4 bits); scales: [..., N, K/32] uint8 E8M0, one power of two 2^(s - 127) per 32 values."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, kb, _ = self.blocks.shape
        return (*lead, n, kb * MXFP4_BLOCK)

    def __getitem__(self, index) -> "Mxfp4Weight":
        return Mxfp4Weight(self.blocks[index], self.scales[index])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=self.blocks.device)
        b = self.blocks.to(torch.int64)
        values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., N, K/32, 32]
        exponent = self.scales.to(torch.int32) - 127
        w = torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32))
        return w.flatten(-2).to(dtype)


def padded_scale_copy(scales: torch.Tensor, align: int = 16) -> torch.Tensor:
    """A copy of MXFP4 scales [..., G] whose rows start every multiple of `align` bytes: a narrow
    view of a zero-padded buffer, as the tensor-copy engine reads rows (kernels/moe_gemv_half2.py)."""
    groups = scales.shape[-1]
    padded = torch.zeros((*scales.shape[:-1], -(-groups // align) * align), dtype=scales.dtype, device=scales.device)
    padded[..., :groups] = scales
    return padded[..., :groups]


def rows_aligned(t: torch.Tensor, align: int) -> bool:
    """Whether every row of t (its last dimension, contiguous) starts on an `align`-byte boundary:
    the start address and every outer stride, in bytes, multiples of align."""
    return (t.data_ptr() % align == 0 and t.stride(-1) == 1
            and all(st * t.element_size() % align == 0 for st in t.stride()[:-1]))


def aligned_scale_rows(w: Mxfp4Weight, align: int = 16) -> Mxfp4Weight:
    """The same weight with its scales in padded_scale_copy's layout; the values and every reader
    through strides are unchanged. A weight already aligned comes back as it is."""
    if rows_aligned(w.scales, align):
        return w
    return Mxfp4Weight(w.blocks, padded_scale_copy(w.scales, align))


LinearWeight = DenseWeight | Fp8Weight | Mxfp4Weight


def stored_bytes(w: "torch.Tensor | LinearWeight") -> int:
    """Bytes a plain tensor or a weight record (payload and scales) occupies."""
    tensors = [w] if isinstance(w, torch.Tensor) else [t for t in vars(w).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)
