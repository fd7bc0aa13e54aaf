"""Streaming a checkpoint into the engine's weight dict, one shard at a time.

All headers are validated first (plan.py); then each file is opened once, its tensors read in
file order and moved to `device` as they arrive, so host memory holds about one tensor beyond
what the output itself keeps. GLM experts are copied into a preallocated [E, ...] stack, never
concatenated on the host.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from ..spec import ModelSpec, UnsupportedModel
from .errors import CheckpointError, redownload_hint
from .formats import DenseWeight, Fp8Weight, LinearWeight, Mxfp4Weight, aligned_scale_rows, fp8_rows, stored_bytes
from .plan import LoadPlan, PlannedOutput, plan_load
from .quant_config import UnsupportedQuantization, fp8_candidate
from .safetensors_files import scan_checkpoint
from .schema import LinearModule, Mxfp4Experts, PlainTensor, TransposedExperts

Weights = dict[str, "torch.Tensor | LinearWeight"]
ProgressFn = Callable[[int, int, Path], None]


def read_spec(path: str | Path, model_id: str | None = None) -> ModelSpec:
    """ModelSpec.from_dir, with config problems raised as CheckpointError naming config.json."""
    cfg = Path(path) / "config.json"
    try:
        return ModelSpec.from_dir(path)
    except UnsupportedQuantization as e:
        raise CheckpointError(f"{cfg}: {e}. This quantization cannot be loaded; pick a bf16, FP8 or MXFP4 "
                              "version of the model.", file=cfg) from e
    except UnsupportedModel as e:
        raise CheckpointError(f"{cfg}: {e}", file=cfg) from e
    except FileNotFoundError as e:
        raise CheckpointError(f"{e}. {redownload_hint(model_id)}", file=cfg) from e
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg} is damaged or incomplete ({type(e).__name__}: {e}). "
                              f"{redownload_hint(model_id)}", file=cfg) from e


def check_checkpoint(path: str | Path, spec: ModelSpec, *, model_id: str | None = None, strict: bool = True) -> LoadPlan:
    """Validate a checkpoint from its headers alone (no tensor data read)."""
    return plan_load(scan_checkpoint(path, model_id), spec, model_id=model_id, strict=strict)


def load_weights(path: str | Path, spec: ModelSpec, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, on_progress: ProgressFn | None = None,
                 model_id: str | None = None, strict: bool = True, quantize: str | None = None) -> Weights:
    """Read every weight of the checkpoint at `path`, converted to the engine's naming (schema.py).

    dtype: floating tensors and DenseWeight records are cast to it (None keeps the file dtype);
    FP8 and MXFP4 payloads keep theirs, FP8 scales and GLM's e_score_correction_bias are float32.
    on_progress(done_bytes, total_bytes, file) is called after each tensor read.
    model_id names the repo in error messages (`localchat pull <model_id>`).
    quantize "fp8": a bf16 checkpoint's decoder projections are stored as FP8 with a scale per row
    as they are read (quant_config.fp8_candidate; the FP8 checkpoints' channel layout).
    Raises CheckpointError, before reading data, for any missing/corrupt/mismatched file or tensor.
    """
    plan = check_checkpoint(path, spec, model_id=model_id, strict=strict)
    _check_quantize(quantize, spec, plan)
    device = torch.device(device)
    builders = [_builder(o, plan, device, dtype, quantize) for o in plan.outputs]
    route = {p.info.name: (b, p) for b, o in zip(builders, plan.outputs) for p in o.parts}
    by_file: dict[Path, list] = {}
    for _, part in route.values():
        by_file.setdefault(part.info.file, []).append(part)
    total, done = plan.total_bytes, 0
    for file in plan.files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for part in sorted(by_file[file], key=lambda p: p.info.begin):
                    builder, _ = route[part.info.name]
                    builder.put(part, f.get_tensor(part.info.name))
                    done += part.info.nbytes
                    if on_progress is not None:
                        on_progress(done, total, file)
        except SafetensorError as e:
            raise CheckpointError(f"{file} cannot be read ({e}). {redownload_hint(model_id)}", file=file) from e
    out: Weights = {}
    for b in builders:
        out.update(b.finish())
    return out


def weight_bytes(weights: Weights) -> int:
    """Bytes the loaded weights occupy (payloads and scales)."""
    return sum(stored_bytes(v) for v in weights.values())


def _cast(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is not None and t.is_floating_point() and t.dtype.itemsize > 1:
        return t.to(device=device, dtype=dtype)
    return t.to(device=device)


def _normalise_scale(s: torch.Tensor, strategy: str | None) -> torch.Tensor:
    """channel [N] -> [N, 1]; tensor [] / [1] -> [1, 1]; block stays [N/bn, K/bk]."""
    s = s.to(torch.float32)
    if strategy == "tensor":
        return s.reshape(1, 1)
    if strategy == "channel":
        return s.reshape(-1, 1)
    return s


class _Builder(ABC):
    """Collects the parts of one output as they are read and makes the output record."""

    def __init__(self, planned: PlannedOutput, plan: LoadPlan, device: torch.device, dtype: torch.dtype | None):
        self.entry, self.fp8, self.device, self.dtype = planned.entry, planned.fp8, device, dtype
        self.strategy, self.block = plan.scale_shape, plan.block_size
        self.parts: dict[str, torch.Tensor] = {}

    def put(self, part, t: torch.Tensor) -> None:
        self.parts[part.role] = _cast(t, self.device, self.dtype)

    @abstractmethod
    def finish(self) -> dict:
        """{output name: tensor or LinearWeight}, once every part has been put."""


class _Plain(_Builder):
    def put(self, part, t):
        if self.entry.keep_fp32:
            self.parts["tensor"] = t.to(device=self.device, dtype=torch.float32)
        else:
            super().put(part, t)

    def finish(self):
        return {self.entry.out: self.parts["tensor"]}


class _Linear(_Builder):
    """A plain linear or (stacked) GLM experts; experts are copied into their [E] slot on arrival."""

    def put(self, part, t):
        if part.role == "scale":
            t = _normalise_scale(t, self.strategy).to(self.device)
        else:
            t = _cast(t, self.device, self.dtype)
        self._keep(part.role, part.expert, t)

    def _keep(self, role: str, expert: int | None, t: torch.Tensor) -> None:
        if not self.entry.stacked:
            self.parts[role] = t
            return
        buf = self.parts.get(role)
        if buf is None:
            buf = self.parts[role] = torch.empty((len(self.entry.sources), *t.shape), dtype=t.dtype, device=self.device)
        buf[expert].copy_(t)

    def finish(self):
        w = self.parts["weight"]
        if not self.fp8:
            return {self.entry.out: DenseWeight(w)}
        return {self.entry.out: Fp8Weight(w, self.parts["scale"], self.block)}


class _Fp8AtLoad(_Linear):
    """A bf16 linear (or GLM expert stack) stored as FP8 with a scale per row as each weight
    arrives (`--quantize fp8`; formats.fp8_rows), so its bf16 copy never accumulates."""

    def put(self, part, t):
        if part.role != "weight":
            return super().put(part, t)
        w = fp8_rows(t.to(self.device))
        self._keep("weight", part.expert, w.weight)
        self._keep("scale", part.expert, w.scale)

    def finish(self):
        return {self.entry.out: Fp8Weight(self.parts["weight"], self.parts["scale"])}


class _Mxfp4(_Builder):
    def finish(self):
        # scale rows on 16-byte boundaries, as the TMA-fed MoE kernels read them (+6 bytes a
        # 90-byte row for gpt-oss)
        return {self.entry.out: aligned_scale_rows(Mxfp4Weight(self.parts["blocks"], self.parts["scales"]))}


class _Transposed(_Builder):
    def put(self, part, t):
        super().put(part, t.transpose(-1, -2).contiguous())

    def finish(self):
        return {self.entry.out: DenseWeight(self.parts["tensor"])}


def _builder(o: PlannedOutput, plan: LoadPlan, device, dtype, quantize: str | None = None) -> _Builder:
    kind = {PlainTensor: _Plain, LinearModule: _Linear, Mxfp4Experts: _Mxfp4, TransposedExperts: _Transposed}
    if quantize == "fp8" and _quantized_at_load(o):
        return _Fp8AtLoad(o, plan, device, dtype)
    return kind[type(o.entry)](o, plan, device, dtype)


def _quantized_at_load(o: PlannedOutput) -> bool:
    """Whether `--quantize fp8` stores this output as FP8 (quant_config.fp8_candidate)."""
    weights = [p.info for p in o.parts if p.role == "weight"]
    return (isinstance(o.entry, LinearModule) and not o.fp8 and bool(weights)
            and all(w.dtype in _FLOAT_TORCH and fp8_candidate(w.name, w.shape) for w in weights))


def _check_quantize(quantize: str | None, spec: ModelSpec, plan: LoadPlan) -> None:
    if quantize not in (None, "fp8"):
        raise ValueError(f"unknown quantization {quantize!r}: only 'fp8' is supported")
    if quantize and spec.quant.method is not None:
        raise ValueError(f"--quantize fp8 converts bf16 checkpoints; this one is already quantized "
                         f"({spec.quant.method}): load it without --quantize")
    if quantize and not any(_quantized_at_load(o) for o in plan.outputs):
        raise ValueError("--quantize fp8 converts a bf16 checkpoint's decoder projections; this one has none")


_FLOAT_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def load_weights_slice(path: str | Path, spec: ModelSpec, shard: dict, *, device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None, on_progress: ProgressFn | None = None,
                       model_id: str | None = None, strict: bool = True, quantize: str | None = None) -> Weights:
    """load_weights for one tensor-parallel rank: only the index ranges that `shard` (from
    engine.parallel.slicing.shard_plan) gives this rank are read, through safetensors get_slice,
    so a rank reads about 1/tp of the expert and attention bytes. The result equals
    slice_weights(load_weights(path, spec, ...), shard), except that with quantize "fp8" each
    row's scale comes from the part of the row this rank holds. on_progress(done, total, file)
    counts the bytes actually read; `total` is the whole checkpoint's.
    """
    import dataclasses

    from ..parallel.slicing import held_experts, stored_index

    plan = check_checkpoint(path, spec, model_id=model_id, strict=strict)
    _check_quantize(quantize, spec, plan)
    device = torch.device(device)
    outputs = []
    for o in plan.outputs:
        s = shard[o.entry.out]
        experts = held_experts(o, s)
        if experts is not None:  # whole experts: keep theirs only, renumbered from 0
            entry = dataclasses.replace(o.entry, sources=o.entry.sources[experts.start:experts.stop])
            parts = tuple(dataclasses.replace(p, expert=p.expert - experts.start)
                          for p in o.parts if p.expert in experts)
            o = dataclasses.replace(o, entry=entry, parts=parts)
        outputs.append((o, s))
    builders = [_builder(o, plan, device, dtype, quantize) for o, _ in outputs]
    by_file: dict[Path, list] = {}
    for b, (o, s) in zip(builders, outputs):
        for p in o.parts:
            by_file.setdefault(p.info.file, []).append((p, b, o, s))
    done = 0
    for file in sorted(by_file):
        try:
            with safe_open(str(file), framework="pt") as f:
                for part, builder, o, s in sorted(by_file[file], key=lambda x: x[0].info.begin):
                    if s.zeros:  # a bias that only rank 0 adds
                        t = torch.zeros(part.info.shape, dtype=_FLOAT_TORCH[part.info.dtype])
                    else:
                        index = stored_index(o, part, s, plan.block_size)
                        t = f.get_tensor(part.info.name) if index is None else f.get_slice(part.info.name)[index]
                        done += t.numel() * t.element_size()
                    builder.put(part, t)
                    if on_progress is not None:
                        on_progress(done, plan.total_bytes, file)
        except SafetensorError as e:
            raise CheckpointError(f"{file} cannot be read ({e}). {redownload_hint(model_id)}", file=file) from e
    out: Weights = {}
    for b in builders:
        out.update(b.finish())
    return out
