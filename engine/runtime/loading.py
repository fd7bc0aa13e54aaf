"""Putting a checkpoint on its devices for the Engine: where it runs and in which dtype, whether
those GPUs can run it, and the loaded model (one process, or one per GPU under tensor
parallelism), with the facts the model panel shows about its weights."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...kernels.gpu_facts import require_fp8, require_supported
from ..spec import ModelSpec


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible to torch; "
                           "use --device cpu (slow, for small checkpoints) or check the NVIDIA driver")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]


def require_gpus(indices: list[int], fp8: bool) -> None:
    """Refuses, before any weight is read, GPUs the kernels cannot run on, or (fp8) FP8 weights
    on a GPU without FP8."""
    for i in indices:
        device = torch.device("cuda", i)
        require_supported(device)
        if not fp8:
            continue
        try:
            require_fp8(device)
        except ValueError as e:
            raise ValueError(f"{e} (GPU {i}); use a bf16 or MXFP4 model on it") from None


def describe_weights(spec: ModelSpec, dtype: torch.dtype, quantize: str | None = None) -> str:
    """How the loaded weights are held, in words (the model panel and the API's model card)."""
    compute = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "float32"}.get(dtype, str(dtype))
    if quantize == "fp8":
        return f"FP8, a scale per row, made from the bf16 checkpoint while loading; {compute} elsewhere"
    q = spec.quant
    if q.method == "fp8":
        scales = f"{q.block_size[0]}x{q.block_size[1]} block" if q.block_size else q.fp8_strategy
        return f"FP8, {scales} scales; {compute} elsewhere"
    if q.method == "mxfp4":
        return f"MXFP4 experts; {compute} elsewhere"
    return compute


@dataclass
class LoadedModel:
    """model: rank 0's under tensor parallelism; device: its device; weights_bytes: over all
    ranks; workers: the other ranks' processes (engine.parallel.group.WorkerGroup), or None."""

    model: object
    device: torch.device
    dtype: torch.dtype
    weights_bytes: int
    weights_format: str
    workers: object | None = None


def load_model(path: Path, spec: ModelSpec, *, device: str, dtype: str, on_progress=None, tp: int = 1,
               ep: bool = False, gpus: list[int] | None = None, quantize: str | None = None) -> LoadedModel:
    """The checkpoint at `path` loaded and built on its devices (Engine's arguments of the same
    names)."""
    from ..models import build_model
    from ..weights.loader import load_weights, weight_bytes

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if ep and tp < 2:
        raise ValueError("expert parallelism splits the experts over the tensor-parallel ranks: it needs tp >= 2")
    if dev.type == "cuda":
        require_gpus(list(gpus)[:tp] if gpus else list(range(tp)) if tp > 1 else [dev.index or 0],
                     fp8=spec.quant.method == "fp8" or quantize == "fp8")
    held = describe_weights(spec, dt, quantize)
    if tp > 1:
        from ..parallel.group import start_parallel

        workers = start_parallel(path, spec, dev, dt, tp=tp, ep=ep, gpus=gpus, on_progress=on_progress,
                                 quantize=quantize)
        return LoadedModel(workers.model, workers.device, dt, workers.weights_bytes, held, workers)
    if gpus and dev.type == "cuda":
        dev = torch.device("cuda", gpus[0])
    weights = load_weights(path, spec, device=dev, dtype=dt, on_progress=on_progress, quantize=quantize)
    return LoadedModel(build_model(spec, weights, dev), dev, dt, weight_bytes(weights), held)
