"""Which quantization a checkpoint uses, read once from `quantization_config` in config.json.

Three layouts are understood:

* compressed-tensors FP8 (`quant_method: compressed-tensors`, `format: float-quantized`): linear
  weights stored as float8_e4m3fn with a `weight_scale` beside them; the strategy (channel, block or
  tensor) comes from `config_groups.*.weights`; modules named in `ignore` stay unquantized.
* DeepSeek-style FP8 (`quant_method: fp8`): float8_e4m3fn weights with `weight_scale_inv` of shape
  [ceil(N/bn), ceil(K/bk)] for `weight_block_size: [bn, bk]`.
* MXFP4 (`quant_method: mxfp4`, gpt-oss): expert weights as `*_blocks` / `*_scales`.

Which modules are actually quantized is confirmed per tensor by the loader (a scale tensor must sit
beside every FP8 weight); this scheme tells it which layout to expect and which names to exempt.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass


SUPPORTED_QUANT_METHODS = ("compressed-tensors", "fp8", "mxfp4")


class UnsupportedQuantization(ValueError):
    pass


@dataclass(frozen=True)
class QuantScheme:
    """method: None (dense), "fp8" or "mxfp4".

    fp8_strategy: "channel" | "block" | "tensor" (fp8 only).
    block_size: (rows, cols) of one scale block (block strategy only).
    scale_suffix: the tensor name beside each quantized `weight` ("weight_scale" or
        "weight_scale_inv"); both multiply: W = q * scale.
    exempt: module-name patterns left unquantized ("re:" prefix = regex, else glob or exact name).
    """

    method: str | None = None
    fp8_strategy: str | None = None
    block_size: tuple[int, int] | None = None
    scale_suffix: str | None = None
    exempt: tuple[str, ...] = ()
    source: str = "none"

    def is_exempt(self, module: str) -> bool:
        parts = module.split(".")
        prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
        for pattern in self.exempt:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
                return True
        return False


def fp8_candidate(name: str, shape: tuple[int, ...]) -> bool:
    """Whether `--quantize fp8` turns this bf16 checkpoint tensor into FP8 with a scale per row:
    the decoder's projection matrices, as GLM-4.5V-FP8 quantizes them (its ignore list keeps
    lm_head, the vision tower and the router gate in bf16; embeddings are not linear layers)."""
    return (len(shape) == 2 and name.endswith("_proj.weight") and ".layers." in name
            and "visual" not in name)


def parse_quant_config(qc: dict | None) -> QuantScheme:
    if not qc:
        return QuantScheme()
    method = qc.get("quant_method")
    if method == "mxfp4":
        return QuantScheme("mxfp4", exempt=tuple(qc.get("modules_to_not_convert") or ()), source="mxfp4")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            raise UnsupportedQuantization(
                "quant_method 'fp8' without weight_block_size is not supported: only the block-scaled "
                "layout (weight_scale_inv) of this method is known")
        exempt = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
        return QuantScheme("fp8", "block", (int(block[0]), int(block[1])), "weight_scale_inv", exempt, "fp8")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise UnsupportedQuantization(
        f"unknown quant_method {method!r} in config.json; supported: {', '.join(SUPPORTED_QUANT_METHODS)}")


def _parse_compressed_tensors(qc: dict) -> QuantScheme:
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise UnsupportedQuantization(
            f"compressed-tensors format {fmt!r} is not supported; only FP8 'float-quantized' checkpoints load")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise UnsupportedQuantization("compressed-tensors quantization_config has no config_groups")
    strategies = set()
    block = None
    for group in groups:
        w = group.get("weights") or {}
        if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
            raise UnsupportedQuantization(
                f"compressed-tensors weights {w.get('type')!r} with {w.get('num_bits')} bits are not supported; "
                "only FP8 (type float, 8 bits) is")
        strategies.add(w.get("strategy"))
        if w.get("strategy") == "block":
            bs = w.get("block_structure") or [128, 128]
            block = (int(bs[0]), int(bs[1]))
    if len(strategies) != 1 or not strategies <= {"channel", "block", "tensor"}:
        raise UnsupportedQuantization(
            f"compressed-tensors weight strategy {sorted(map(str, strategies))} is not supported; "
            "expected one of channel, block, tensor")
    return QuantScheme("fp8", strategies.pop(), block, "weight_scale", tuple(qc.get("ignore") or ()), "compressed-tensors")
