"""Checking a checkpoint's headers against the schema, before any data is read.

`plan_load` turns the expected entries into a list of parts (which tensor of which file goes
where), or raises CheckpointError for the first problem: a missing tensor, a wrong shape or
dtype, an FP8 weight without its scale, an unexpected tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..spec import ModelSpec
from .errors import CheckpointError, redownload_hint
from .safetensors_files import CheckpointFiles, TensorInfo
from .schema import (FLOAT_DTYPES, FP8_DTYPE, Entry, LinearModule, Mxfp4Experts, PlainTensor, TransposedExperts,
                     expected_entries, is_harmless_extra)


@dataclass(frozen=True)
class Part:
    """One checkpoint tensor's place in an output: role "tensor" | "weight" | "scale" | "blocks" |
    "scales"; `expert` is the slot in a stacked output (None otherwise)."""

    info: TensorInfo
    role: str
    expert: int | None = None


@dataclass(frozen=True)
class PlannedOutput:
    entry: Entry
    parts: tuple[Part, ...]
    fp8: bool = False


@dataclass(frozen=True)
class LoadPlan:
    outputs: tuple[PlannedOutput, ...]
    scale_shape: str | None  # "channel" | "tensor" | "block" for FP8 outputs
    block_size: tuple[int, int] | None  # (bn, bk) of the block scheme

    @property
    def files(self) -> list[Path]:
        return sorted({p.info.file for o in self.outputs for p in o.parts})

    @property
    def total_bytes(self) -> int:
        return sum(p.info.nbytes for o in self.outputs for p in o.parts)


class _Checker:
    def __init__(self, ckpt: CheckpointFiles, spec: ModelSpec, model_id: str | None):
        self.ckpt, self.spec, self.hint = ckpt, spec, redownload_hint(model_id)
        self.used: set[str] = set()

    def where(self) -> str:
        if self.ckpt.index_file is not None:
            return f"the checkpoint in {self.ckpt.root} (not listed in {self.ckpt.index_file.name})"
        return f"the checkpoint in {self.ckpt.root} (searched {', '.join(f.name for f in self.ckpt.files)})"

    def get(self, name: str, shape, dtypes, optional: bool = False) -> TensorInfo | None:
        info = self.ckpt.tensors.get(name)
        if info is None:
            if optional:
                return None
            raise CheckpointError(
                f"tensor {name} is missing from {self.where()}. The download is incomplete or the weights do "
                f"not belong to this config.json ({self.spec.family}). {self.hint}", file=self.ckpt.root, tensor=name)
        self.used.add(name)
        if shape is not None and info.shape != tuple(shape):
            raise CheckpointError(
                f"{info.file}: tensor {name} has shape {list(info.shape)} but config.json implies {list(shape)}. "
                f"The weights do not match config.json (another model size or a damaged file). {self.hint}",
                file=info.file, tensor=name)
        if info.dtype not in dtypes:
            raise CheckpointError(
                f"{info.file}: tensor {name} is stored as {info.dtype}; expected one of {', '.join(sorted(dtypes))}. "
                f"The file is damaged or from an unsupported export. {self.hint}", file=info.file, tensor=name)
        return info

    def plain(self, e: PlainTensor) -> PlannedOutput | None:
        info = self.get(e.source, e.shape, FLOAT_DTYPES, e.optional)
        return None if info is None else PlannedOutput(e, (Part(info, "tensor"),))

    def linear(self, e: LinearModule) -> PlannedOutput | None:
        if e.optional and f"{e.sources[0]}.weight" not in self.ckpt.tensors:
            return None
        parts, kinds = [], set()
        for j, module in enumerate(e.sources):
            slot = j if e.stacked else None
            w = self.get(f"{module}.weight", e.shape, FLOAT_DTYPES | {FP8_DTYPE})
            kinds.add(w.dtype == FP8_DTYPE)
            parts.append(Part(w, "weight", slot))
            if w.dtype == FP8_DTYPE:
                parts.append(Part(self.fp8_scale(module, w, e.shape), "scale", slot))
        if len(kinds) > 1:
            raise CheckpointError(
                f"{parts[0].info.file}: the experts behind {e.out} mix FP8 and unquantized weights; a checkpoint "
                f"quantizes all experts of a layer or none. {self.hint}", file=parts[0].info.file, tensor=e.out)
        return PlannedOutput(e, tuple(parts), fp8=kinds == {True})

    def fp8_scale(self, module: str, w: TensorInfo, shape: tuple[int, int]) -> TensorInfo:
        q = self.spec.quant
        if q.method != "fp8":
            raise CheckpointError(
                f"{w.file}: tensor {w.name} is stored as float8 but config.json has no FP8 quantization_config, so "
                f"its scale layout is unknown. Restore the checkpoint's original config.json. {self.hint}",
                file=w.file, tensor=w.name)
        name = f"{module}.{q.scale_suffix}"
        if name not in self.ckpt.tensors:
            raise CheckpointError(
                f"{w.file}: FP8 weight {w.name} has no scale: {name} is missing from {self.where()}. Without it "
                f"the weight cannot be dequantized. {self.hint}", file=w.file, tensor=name)
        n, k = shape
        allowed = {"channel": [(n, 1), (n,)], "tensor": [(), (1,), (1, 1)]}.get(q.fp8_strategy)
        if q.fp8_strategy == "block":
            bn, bk = q.block_size
            allowed = [(math.ceil(n / bn), math.ceil(k / bk))]
        info = self.get(name, None, FLOAT_DTYPES)
        if info.shape not in allowed:
            raise CheckpointError(
                f"{info.file}: FP8 scale {name} has shape {list(info.shape)}; the {q.fp8_strategy} scheme in "
                f"config.json needs {' or '.join(str(list(a)) for a in allowed)}. {self.hint}", file=info.file, tensor=name)
        return info

    def mxfp4(self, e: Mxfp4Experts) -> PlannedOutput:
        ex, n, k = e.shape
        blocks = self.get(f"{e.source}_blocks", (ex, n, k // 32, 16), {"U8"})
        scales = self.get(f"{e.source}_scales", (ex, n, k // 32), {"U8"})
        return PlannedOutput(e, (Part(blocks, "blocks"), Part(scales, "scales")))

    def transposed(self, e: TransposedExperts) -> PlannedOutput:
        return PlannedOutput(e, (Part(self.get(e.source, e.stored_shape, FLOAT_DTYPES), "tensor"),))

    def check_extras(self, strict: bool) -> list[str]:
        extra = sorted(n for n in self.ckpt.tensors if n not in self.used and not is_harmless_extra(n, self.spec))
        if extra and strict:
            first = self.ckpt.tensors[extra[0]]
            shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            raise CheckpointError(
                f"{first.file}: {len(extra)} unexpected tensor(s) that config.json ({self.spec.family}) does not "
                f"account for: {shown}. The weights belong to a different model or config.json was edited. {self.hint}",
                file=first.file, tensor=extra[0])
        return extra


def plan_load(ckpt: CheckpointFiles, spec: ModelSpec, *, model_id: str | None = None, strict: bool = True) -> LoadPlan:
    """Validate every header against the spec; with strict=False unexpected tensors are skipped."""
    c = _Checker(ckpt, spec, model_id)
    handlers = {PlainTensor: c.plain, LinearModule: c.linear, Mxfp4Experts: c.mxfp4, TransposedExperts: c.transposed}
    try:
        entries = expected_entries(spec)
    except ValueError as e:
        raise CheckpointError(f"{ckpt.root / 'config.json'}: {e}", file=ckpt.root / "config.json") from None
    outputs = [o for o in (handlers[type(e)](e) for e in entries) if o is not None]
    c.check_extras(strict)
    fp8 = spec.quant.method == "fp8"
    return LoadPlan(tuple(outputs), spec.quant.fp8_strategy if fp8 else None,
                    spec.quant.block_size if fp8 and spec.quant.fp8_strategy == "block" else None)
