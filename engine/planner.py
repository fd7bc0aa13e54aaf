"""Will it fit: weight bytes + KV-cache bytes per token against the free memory of the local GPUs.

Inputs are a `KvLayout` (from a ModelSpec, or from the registry before anything is downloaded) and
a `WeightBytes` (from the safetensors headers of a local checkpoint, or from the registry). Tensor
parallelism splits everything except the `replicated` part (vision tower, norms, routers) evenly over
the GPUs; KV heads are split too (replicated when there are more GPUs than KV heads). The answer is a
`Plan`: per GPU count the bytes and the longest context that fits, a verdict and advice a person can
act on ("use 2 GPUs", "--max-context 32768", "--quantize fp8").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from .weights.quant_config import fp8_candidate
from .weights.safetensors_files import scan_checkpoint

GiB = 1 << 30
TP_SIZES = (1, 2, 4, 8)
# Room left on every GPU for activations, CUDA graphs, NCCL buffers and the allocator's slack.
HEADROOM_FIXED = 4 * GiB
HEADROOM_FRACTION = 0.05
MIN_CONTEXT = 4096
CONTEXT_STEP = 1024
_FLOAT_DTYPES = {"BF16": 2, "F16": 2, "F32": 4}
_PLAIN_DTYPES = {"BF16", "F16", "F32", "F64", "I64", "I32", "I16", "BOOL"}


# compute capabilities from which the kernels run (bf16 tensor cores: Ampere) and the FP8 ones
# (Ada): kernels/gpu_facts.py, repeated here so that planning imports no torch
MIN_CAPABILITY = (8, 0)
FP8_CAPABILITY = (8, 9)


def _cc(capability: tuple[int, int]) -> str:
    return ".".join(map(str, capability))


@dataclass(frozen=True)
class GpuInfo:
    """capability: (major, minor), None where unknown (a GPU assumed for planning)."""

    name: str
    total_bytes: int
    free_bytes: int
    index: int = 0
    capability: tuple[int, int] | None = None

    @property
    def runs_fp8(self) -> bool:
        return self.capability is None or self.capability >= FP8_CAPABILITY

    def cannot_run(self, fp8: bool) -> str | None:
        """Why this GPU cannot run a model (fp8: with FP8 weights), or None."""
        if self.capability is None:
            return None
        cc = f"{self.name} is {self.capability[0]}.{self.capability[1]}"
        if self.capability < MIN_CAPABILITY:
            return (f"the kernels need a GPU of compute capability {_cc(MIN_CAPABILITY)} or newer (Ampere, Ada, "
                    f"Hopper, Blackwell); {cc}")
        if fp8 and not self.runs_fp8:
            return (f"FP8 weights need a GPU of compute capability {_cc(FP8_CAPABILITY)} or newer (Ada, Hopper, "
                    f"Blackwell); {cc}: use a bf16 or MXFP4 model")
        return None

    @property
    def headroom_bytes(self) -> int:
        return HEADROOM_FIXED + int(HEADROOM_FRACTION * self.total_bytes)

    @property
    def usable_bytes(self) -> int:
        return max(0, self.free_bytes - self.headroom_bytes)


@dataclass(frozen=True)
class KvLayout:
    """What the KV cache holds: bf16 K and V for `full_layers` at every position, and for
    `sliding_layers` only the last `sliding_window` positions (gpt-oss even layers)."""

    full_layers: int
    sliding_layers: int
    kv_heads: int
    head_dim: int
    max_context: int
    sliding_window: int = 0
    dtype_bytes: int = 2

    @classmethod
    def from_spec(cls, spec) -> "KvLayout":
        sliding = sum(1 for t in spec.layer_types if t == "sliding")
        return cls(full_layers=len(spec.layer_types) - sliding, sliding_layers=sliding,
                   kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                   max_context=spec.max_position_embeddings, sliding_window=spec.sliding_window or 0)

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        return math.ceil(self.kv_heads / tp)

    def bytes_per_token(self, tp: int = 1) -> int:
        """K+V bytes one more token of context costs on each of `tp` GPUs."""
        return self.full_layers * 2 * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes

    def sliding_bytes(self, tp: int = 1) -> int:
        """Fixed K+V bytes per sequence of the sliding-window layers on each GPU."""
        return (self.sliding_layers * 2 * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes
                * self.sliding_window)


@dataclass(frozen=True)
class TensorInfo:
    """What the planner needs of a tensor (weights.safetensors_files.TensorInfo has the same fields)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class WeightBytes:
    """total: checkpoint data bytes. replicated: bytes every GPU holds whole.
    fp8_numel / fp8_rows: elements and output rows of the bf16 decoder linears that `--quantize fp8`
    turns into 1-byte weights plus one float32 scale per row (the FP8 repo's channel layout)."""

    total: int
    replicated: int = 0
    fp8_numel: int = 0
    fp8_rows: int = 0
    fp8_source_bytes: int = 0

    def per_gpu(self, tp: int = 1) -> int:
        return self.replicated + math.ceil((self.total - self.replicated) / tp)

    def quantized_fp8(self) -> "WeightBytes":
        if not self.fp8_numel:
            raise ValueError("--quantize fp8 needs a bf16 checkpoint: this one has no bf16 linear weights to convert")
        total = self.total - self.fp8_source_bytes + self.fp8_numel + 4 * self.fp8_rows
        return WeightBytes(total=total, replicated=self.replicated)

    @classmethod
    def from_tensors(cls, tensors) -> "WeightBytes":
        total = replicated = numel = rows = source = 0
        prequantized = False
        for t in tensors:
            total += t.nbytes
            prequantized = prequantized or t.dtype not in _PLAIN_DTYPES
            if _is_replicated(t.name):
                replicated += t.nbytes
            elif _is_fp8_candidate(t):
                numel += math.prod(t.shape)
                rows += t.shape[0]
                source += t.nbytes
        if prequantized:  # FP8 / MXFP4 checkpoints load as they are; --quantize only converts bf16 ones
            numel = rows = source = 0
        return cls(total, replicated, numel, rows, source)


def _is_replicated(name: str) -> bool:
    return (".visual." in f".{name}" or "norm" in name or ".mlp.gate." in name or ".mlp.router." in name)


def _is_fp8_candidate(t: TensorInfo) -> bool:
    return t.dtype in _FLOAT_DTYPES and fp8_candidate(t.name, t.shape)


def checkpoint_weight_bytes(path: str | Path, model_id: str | None = None) -> WeightBytes:
    """From the safetensors headers of a checkpoint directory (the data is not read). Raises
    CheckpointError (a ValueError naming the file) for a missing shard or a corrupt header."""
    return WeightBytes.from_tensors(scan_checkpoint(path, model_id).tensors.values())


@dataclass(frozen=True)
class TpOption:
    """One way to run: `tp` GPUs, what each holds and the longest context (one sequence)."""

    tp: int
    gpu_indices: tuple[int, ...]
    weight_bytes_per_gpu: int
    kv_bytes_per_token_per_gpu: int
    usable_bytes_per_gpu: int
    kv_tokens: int
    max_context: int


@dataclass
class Plan:
    """verdict: "fits" (the wanted context), "fits_reduced" (a shorter context), "does_not_fit",
    "unsupported" (GPUs too old, or without FP8 for FP8 weights), "no_gpu". `chosen` is the option to use (None
    unless it fits)."""

    weights: WeightBytes
    layout: KvLayout
    want_context: int
    quantize: str | None
    options: list[TpOption]
    chosen: TpOption | None
    verdict: str
    advice: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.verdict in ("fits", "fits_reduced")

    def summary(self) -> str:
        if self.chosen is None:
            if self.verdict in ("no_gpu", "unsupported"):
                return "; ".join(self.advice)
            return "; ".join([f"does not fit ({gib(self.weights.per_gpu(1))} of weights)"] + self.advice)
        c = self.chosen
        gpus = "1 GPU" if c.tp == 1 else f"{c.tp} GPUs"
        text = (f"fits on {gpus}: {gib(c.weight_bytes_per_gpu)} weights per GPU, context {c.max_context}"
                f" ({c.kv_bytes_per_token_per_gpu // 1024} KiB KV per token per GPU)")
        return "; ".join([text] + [a for a in self.advice if a != f"use {c.tp} GPUs"])


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def _option(weights: WeightBytes, layout: KvLayout, gpus: list[GpuInfo], tp: int) -> TpOption:
    chosen = gpus[:tp]
    per_gpu = weights.per_gpu(tp)
    per_token = layout.bytes_per_token(tp)
    usable = min(g.usable_bytes for g in chosen)
    budget = usable - per_gpu - layout.sliding_bytes(tp)
    tokens = budget // max(1, per_token) if budget > 0 else 0
    context = layout.max_context if tokens >= layout.max_context else (tokens // CONTEXT_STEP) * CONTEXT_STEP
    return TpOption(tp, tuple(g.index for g in chosen), per_gpu, per_token, usable, int(tokens), int(context))


def plan(spec, weight_bytes: WeightBytes | int, gpus: list[GpuInfo], *, quantize: str | None = None,
         max_context: int | None = None, min_context: int = MIN_CONTEXT, alternative: str | None = None,
         fp8: bool = False) -> Plan:
    """spec: a ModelSpec or a KvLayout. alternative: a smaller model to suggest when this one does
    not fit. fp8: the checkpoint's weights are FP8 (so is --quantize fp8's output)."""
    layout = spec if isinstance(spec, KvLayout) else KvLayout.from_spec(spec)
    weights = WeightBytes(int(weight_bytes)) if isinstance(weight_bytes, int) else weight_bytes
    if quantize not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantize!r}: only 'fp8' is supported")
    if quantize == "fp8":
        weights = weights.quantized_fp8()
    want = min(max_context or layout.max_context, layout.max_context)
    gpus = sorted(gpus, key=lambda g: g.free_bytes, reverse=True)
    options = [_option(weights, layout, gpus, tp) for tp in TP_SIZES if tp <= len(gpus)]
    result = Plan(weights, layout, want, quantize, options, None, "does_not_fit")
    full = [o for o in options if o.max_context >= want]
    if full:
        result.chosen, result.verdict = full[0], "fits"
    else:
        best = max(options, key=lambda o: o.max_context, default=None)
        if best is not None and best.max_context >= min_context:
            result.chosen, result.verdict = best, "fits_reduced"
    if not gpus:
        result.verdict = "no_gpu"
    reason = next(filter(None, (g.cannot_run(fp8 or quantize == "fp8") for g in gpus)), None)
    if reason is not None:
        result.chosen, result.verdict, result.advice = None, "unsupported", [reason]
        return result
    result.advice = _advice(result, gpus, min_context, alternative)
    return result


def _advice(p: Plan, gpus: list[GpuInfo], min_context: int, alternative: str | None) -> list[str]:
    if not gpus:
        return [f"no CUDA GPU found: the weights alone need {gib(p.weights.per_gpu(1))} of GPU memory"]
    if p.chosen is not None:
        advice = [f"use {p.chosen.tp} GPUs"] if p.chosen.tp > 1 else []
        if p.verdict == "fits_reduced":
            advice.append(f"--max-context {p.chosen.max_context}")
        if p.chosen.tp > 1 and p.weights.fp8_numel and p.quantize is None and all(g.runs_fp8 for g in gpus):
            fp8 = plan(p.layout, p.weights, gpus, quantize="fp8", max_context=p.want_context, min_context=min_context)
            if fp8.chosen is not None and fp8.chosen.tp < p.chosen.tp:
                advice.append(f"or --quantize fp8 on {fp8.chosen.tp} GPU" + ("s" if fp8.chosen.tp > 1 else ""))
        return advice
    if p.weights.fp8_numel and p.quantize is None and all(g.runs_fp8 for g in gpus):
        fp8 = plan(p.layout, p.weights, gpus, quantize="fp8", max_context=p.want_context, min_context=min_context)
        if fp8.fits:
            return ["--quantize fp8" + (f" (or use {alternative})" if alternative else "")] + fp8.advice
    advice = [f"use {alternative}"] if alternative else []
    largest = gpus[0]
    for tp in TP_SIZES:
        if tp > len(gpus):
            like = [replace(largest, index=i) for i in range(tp)]
            if plan(p.layout, p.weights, like, max_context=p.want_context, min_context=min_context).fits:
                return advice + [f"needs {tp} GPUs like {largest.name} ({len(gpus)} found)"]
    need = p.weights.per_gpu(1) + largest.headroom_bytes
    return advice + [f"needs {gib(need)} free on one GPU; the largest has {gib(largest.free_bytes)} free"]


def local_gpus() -> list[GpuInfo]:
    """The visible CUDA GPUs with their free memory now (empty on a machine without CUDA)."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(GpuInfo(torch.cuda.get_device_name(i), int(total), int(free), i,
                           tuple(torch.cuda.get_device_capability(i))))
    return out
