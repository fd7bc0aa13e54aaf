"""Random weights for a spec, built directly on the device in the checkpoint's native formats.

Used to benchmark and check the full-size architectures without a download: the same loader
output (names and records, see schema.py) that a real checkpoint gives, with values of a
realistic scale so activations stay in range through many layers.
"""
from __future__ import annotations

import torch

from ..spec import ModelSpec
from .formats import FP8_MAX, MXFP4_BLOCK, DenseWeight, Fp8Weight, Mxfp4Weight, aligned_scale_rows
from .schema import LinearModule, Mxfp4Experts, PlainTensor, TransposedExperts, expected_entries



def _normal(shape, std: float, device, dtype, gen) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)


def _fp8(shape, std: float, block, device, gen) -> Fp8Weight:
    """e4m3 codes of N(0, std^2) values with a scale per row (channel) or per block."""
    w = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
    n, k = shape[-2:]
    if block is None:
        scale = torch.full((*shape[:-2], n, 1), std * 4.0 / FP8_MAX, device=device)
        codes = (w * (FP8_MAX / 4.0)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Fp8Weight(codes, scale)
    bn, bk = block
    scale = torch.full((*shape[:-2], -(-n // bn), -(-k // bk)), std * 4.0 / FP8_MAX, device=device)
    codes = (w * (FP8_MAX / 4.0)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(codes, scale, block)


def _mxfp4(shape, std: float, device, gen) -> Mxfp4Weight:
    """Uniform E2M1 codes (mean |value| ~2.2) with one shared exponent giving about std."""
    *lead, n, k = shape
    blocks = torch.randint(0, 256, (*lead, n, k // MXFP4_BLOCK, 16), generator=gen, device=device, dtype=torch.uint8)
    exponent = round(torch.log2(torch.tensor(std / 2.8)).item())
    scales = torch.full((*lead, n, k // MXFP4_BLOCK), 127 + exponent, device=device, dtype=torch.uint8)
    return aligned_scale_rows(Mxfp4Weight(blocks, scales))  # as the loader stores them


def dummy_weights(spec: ModelSpec, *, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0) -> dict:
    """The loader's output for `spec` with random values; quantized where the spec says so."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    q = spec.quant
    out: dict = {}
    for entry in expected_entries(spec):
        if getattr(entry, "optional", False):  # what only some checkpoints carry (GLM-4.5V's has no vision qkv bias)
            continue
        if isinstance(entry, PlainTensor):
            name, shape = entry.out, entry.shape
            if name.endswith(("norm.weight", "layernorm.weight", "norm1.weight", "norm2.weight")):
                out[name] = torch.ones(shape, device=device, dtype=dtype)
            elif name.endswith((".bias", "e_score_correction_bias", "sinks")):
                out[name] = _normal(shape, 0.01, device, torch.float32 if entry.keep_fp32 else dtype, gen)
            else:
                out[name] = _normal(shape, 0.02, device, dtype, gen)
            continue
        if isinstance(entry, LinearModule):
            shape = ((len(entry.sources),) if entry.stacked else ()) + entry.shape
            std = entry.shape[1] ** -0.5
            quantized = q.method == "fp8" and not q.is_exempt(entry.sources[0])
            out[entry.out] = (_fp8(shape, std, q.block_size if q.fp8_strategy == "block" else None, device, gen)
                              if quantized else DenseWeight(_normal(shape, std, device, dtype, gen)))
        elif isinstance(entry, Mxfp4Experts):
            out[entry.out] = _mxfp4(entry.shape, entry.shape[2] ** -0.5, device, gen)
        elif isinstance(entry, TransposedExperts):
            out[entry.out] = DenseWeight(_normal(entry.shape, entry.shape[2] ** -0.5, device, dtype, gen))
    return out


def to_device(weights: dict, device: torch.device | str, dtype: torch.dtype | None = None) -> dict:
    """A copy of a weight store on another device; dense floating tensors cast to `dtype`."""
    def move(t: torch.Tensor) -> torch.Tensor:
        t = t.to(device)
        return t.to(dtype) if dtype is not None and t.is_floating_point() and t.element_size() > 1 else t

    out = {}
    for name, w in weights.items():
        if isinstance(w, torch.Tensor):
            out[name] = move(w) if not name.endswith("e_score_correction_bias") else w.to(device)
        elif isinstance(w, DenseWeight):
            out[name] = DenseWeight(move(w.weight))
        elif isinstance(w, Fp8Weight):
            out[name] = Fp8Weight(w.weight.to(device), w.scale.to(device), w.block)
        else:
            out[name] = aligned_scale_rows(Mxfp4Weight(w.blocks.to(device), w.scales.to(device)))
    return out
