"""Finding a checkpoint's safetensors files and reading their headers without touching the data.

File layout (safetensors format, huggingface/safetensors README "Format"): 8 bytes little-endian
u64 N, then N bytes of JSON mapping each tensor name to {dtype, shape, data_offsets [begin, end)}
(offsets relative to the first byte after the header), plus an optional "__metadata__" entry.

Every header is checked against the file size before any tensor is read, so a truncated
download is caught up front instead of half-way through a load.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, redownload_hint

INDEX_NAME = "model.safetensors.index.json"
# The reference implementation refuses headers above 100 MB; a bigger length field means garbage.
MAX_HEADER_BYTES = 100_000_000

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a header describes it; `begin`/`end` are absolute byte offsets in `file`."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class CheckpointFiles:
    """All tensors of a checkpoint directory, by name, from the headers alone."""

    root: Path
    files: tuple[Path, ...]
    index_file: Path | None
    tensors: dict[str, TensorInfo]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_header(file: Path, model_id: str | None = None) -> dict[str, TensorInfo]:
    """Parse and check one file's header: well-formed JSON, offsets inside the file, sizes that
    match dtype x shape. Raises CheckpointError naming the file (and tensor) otherwise."""
    hint = redownload_hint(model_id)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file} is truncated: {size} bytes, shorter than a safetensors header. {hint}", file=file)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(
                f"{file} has a corrupt or truncated safetensors header: it claims {n} header bytes but the "
                f"file has {size} bytes. {hint}", file=file)
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file} has a corrupt safetensors header ({e}). {hint}", file=file) from None
    data_start = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        info = _tensor_info(file, name, entry, data_start, hint)
        if info.end > size:
            raise CheckpointError(
                f"{file} is truncated: tensor {name} ends at byte {info.end} but the file has only {size} bytes. "
                f"{hint}", file=file, tensor=name)
        out[name] = info
    return out


def _tensor_info(file: Path, name: str, entry, data_start: int, hint: str) -> TensorInfo:
    try:
        dtype = str(entry["dtype"])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{file} has a corrupt safetensors header: the entry of tensor {name} is malformed. {hint}",
                              file=file, tensor=name) from None
    itemsize = DTYPE_BYTES.get(dtype)
    if begin < 0 or end < begin or (itemsize is not None and end - begin != math.prod(shape) * itemsize):
        raise CheckpointError(
            f"{file} has a corrupt safetensors header: tensor {name} ({dtype} {list(shape)}) has data offsets "
            f"[{begin}, {end}) that do not match its size. {hint}", file=file, tensor=name)
    return TensorInfo(name, file, dtype, shape, data_start + begin, data_start + end)


def scan_checkpoint(path: str | Path, model_id: str | None = None) -> CheckpointFiles:
    """Find the weight files (the index's weight_map when there is one, else every top-level
    *.safetensors file) and read all their headers."""
    root = Path(path)
    hint = redownload_hint(model_id)
    index_file = root / INDEX_NAME
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file} is not a valid shard index ({e!r}). {hint}", file=index_file) from None
        files = tuple(root / f for f in sorted(set(weight_map.values())))
        for f in files:
            if not f.is_file():
                listed = [k for k, v in weight_map.items() if root / v == f]
                raise CheckpointError(
                    f"shard {f.name} is missing from {root}: {index_file.name} lists it as holding {len(listed)} "
                    f"tensors (e.g. {listed[0]}). The download is incomplete. {hint}", file=f, tensor=listed[0])
    else:
        weight_map = None
        files = tuple(sorted(root.glob("*.safetensors")))
        if not files:
            raise CheckpointError(f"{root} holds no .safetensors files. {hint}", file=root)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        for name, info in read_header(f, model_id).items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor {name} is stored twice, in {tensors[name].file.name} and {f.name}: the directory mixes "
                    f"files of two downloads. {hint}", file=f, tensor=name)
            tensors[name] = info
    if weight_map is not None:
        for name, fname in weight_map.items():
            info = tensors.get(name)
            if info is None or info.file != root / fname:
                raise CheckpointError(
                    f"{root / fname} does not contain tensor {name}, which {index_file.name} says it holds: the shard "
                    f"is from a different version of the model. {hint}", file=root / fname, tensor=name)
    return CheckpointFiles(root, files, index_file if weight_map is not None else None, tensors)
