"""Which part of every loader output one tensor-parallel rank holds, and cutting a loaded store to it.

Rules (reference notes D.1/D.2, how vLLM and SGLang shard these two models):
* attention: q/k/v rows split by heads (kv heads replicated in groups when tp > kv heads), their
  biases and gpt-oss `sinks` with them; o_proj row-parallel (split on its input dim, K), its bias
  kept on rank 0 only because the ranks' partial outputs are summed.
* MLPs (GLM dense layer, shared experts, routed experts): gate/up split on rows (N), down on K.
* gpt-oss experts: the intermediate size is cut in units of 32 values (one MXFP4 scale group),
  per_rank_I = cdiv(I / 32, tp) * 32 with the last rank shorter; gate_up keeps its gate/up row
  interleave by taking rows 2*start:2*end; down bias on rank 0 only. bf16 gpt-oss uses the same
  ranges so both formats give the model identical per-rank shapes.
* expert parallel (ep=True): whole experts, a contiguous range per rank, for every expert tensor
  (down bias whole on its expert's rank); attention and shared experts stay tensor-parallel.
* embeddings and lm_head: vocab split on rows, cdiv(V, tp) per rank, the last rank shorter.
* norms, routers, GLM's correction bias and the vision tower are replicated (the ViT is not split:
  its 12 heads do not divide 8; only rank 0 runs it, see models/glm4v_moe.py).

Slices are given on each output's logical shape: a tensor's own shape, a LinearWeight record's
[..., N, K] (`record.shape`). `slice_weights` maps that onto the record's payload and scales.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..spec import ModelSpec
from ..weights.formats import MXFP4_BLOCK, DenseWeight, Fp8Weight, Mxfp4Weight, padded_scale_copy
from ..weights.schema import LinearModule, Mxfp4Experts, TransposedExperts, expected_entries


class ShardingError(ValueError):
    """The model cannot be split this way (the message names the tensor or config field)."""


@dataclass(frozen=True)
class Slice:
    """What one rank holds of one output.

    dim None: the whole tensor (replicated), or, with `zeros`, a zero tensor of the full shape (the
    bias of a row-parallel layer, added once across the summed ranks). Otherwise the index range
    [start, end) of logical dim `dim`.
    """

    dim: int | None = None
    start: int = 0
    end: int = 0
    zeros: bool = False

    def shape_of(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full)
        return tuple(self.end - self.start if d == self.dim else n for d, n in enumerate(full))


REPLICATED = Slice()
ZEROS = Slice(zeros=True)
ShardPlan = dict[str, Slice]


def logical_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every output name the loader can produce for `spec`, with its logical shape."""
    out: dict[str, tuple[int, ...]] = {}
    for e in expected_entries(spec):
        if isinstance(e, LinearModule):
            out[e.out] = ((len(e.sources),) if e.stacked else ()) + tuple(e.shape)
        else:
            out[e.out] = tuple(e.shape)
    return out


def even_range(n: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    if n % tp:
        raise ShardingError(f"{what} = {n} is not divisible by tensor-parallel size {tp}; pick a tp that divides it")
    per = n // tp
    return rank * per, (rank + 1) * per


def rounded_range(n: int, tp: int, rank: int, unit: int, what: str) -> tuple[int, int]:
    """cdiv(n / unit, tp) * unit per rank, the last rank shorter (notes D.1, gpt-oss loader rules)."""
    if n % unit:
        raise ShardingError(f"{what} = {n} is not a multiple of {unit}")
    per = math.ceil(n // unit / tp) * unit
    start, end = min(rank * per, n), min((rank + 1) * per, n)
    if end <= start:
        raise ShardingError(f"{what} = {n} split in units of {unit} leaves rank {rank} of {tp} empty; use a smaller tp")
    return start, end


def head_ranges(spec: ModelSpec, tp: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(q head range, kv head range) of `rank`. kv heads are split when tp divides them and replicated
    in groups of tp / kv when kv divides tp; each rank's q heads then still use only its kv heads."""
    hq, hkv = spec.num_heads, spec.num_kv_heads
    q = even_range(hq, tp, rank, "num_attention_heads")
    if hkv % tp == 0:
        kv = even_range(hkv, tp, rank, "num_key_value_heads")
    elif tp % hkv == 0:
        first = rank // (tp // hkv)
        kv = (first, first + 1)
    else:
        raise ShardingError(f"num_key_value_heads = {hkv} and tensor-parallel size {tp} do not divide one another; "
                            f"pick a tp that divides {hkv} or a multiple of it")
    return q, kv


class _Planner:
    def __init__(self, spec: ModelSpec, tp: int, rank: int, ep: bool):
        if tp < 1 or not 0 <= rank < tp:
            raise ShardingError(f"rank {rank} is outside tensor-parallel size {tp}")
        self.spec, self.tp, self.rank, self.ep = spec, tp, rank, ep
        (q0, q1), (k0, k1) = head_ranges(spec, tp, rank)
        d = spec.head_dim
        self.q_heads, self.q_rows, self.kv_rows = (q0, q1), (q0 * d, q1 * d), (k0 * d, k1 * d)
        self.vocab = rounded_range(spec.vocab_size, tp, rank, 1, "vocab_size")
        self.experts = even_range(spec.moe.num_experts, tp, rank, "number of experts") if ep else None
        self._inner: dict[int, tuple[int, int]] = {}

    def rank0_only(self) -> Slice:
        """A row-parallel layer's bias: whole on rank 0, zeros elsewhere, so the summed output adds it once."""
        return REPLICATED if self.rank == 0 else ZEROS

    def inner(self, n: int, what: str) -> tuple[int, int]:
        if n not in self._inner:
            if self.spec.family == "gpt_oss":
                self._inner[n] = rounded_range(n, self.tp, self.rank, MXFP4_BLOCK, what)
            else:
                self._inner[n] = even_range(n, self.tp, self.rank, what)
        return self._inner[n]

    def slice(self, name: str, shape: tuple[int, ...]) -> Slice:
        last = name.rsplit(".", 2)
        leaf, module = last[-1], last[-2] if len(last) > 1 else ""
        if name.startswith("model.visual.") or module.endswith("norm"):
            return REPLICATED
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return Slice(0, *self.vocab)
        if module == "q_proj":
            return Slice(0, *self.q_rows)
        if module in ("k_proj", "v_proj"):
            return Slice(0, *self.kv_rows)
        if module == "o_proj":
            return Slice(1, *self.q_rows) if leaf == "weight" else self.rank0_only()
        if leaf == "sinks":
            return Slice(0, *self.q_heads)
        if ".mlp.gate." in name or ".mlp.router." in name:
            return REPLICATED
        if ".mlp.experts." in name:
            return self.expert(name, module, leaf, shape)
        if module in ("gate_proj", "up_proj"):
            return Slice(0, *self.inner(shape[0], f"{name} rows"))
        if module == "down_proj":
            return Slice(1, *self.inner(shape[1], f"{name} columns"))
        raise ShardingError(f"no tensor-parallel rule for loader output {name} {list(shape)}")

    def expert(self, name: str, module: str, leaf: str, shape: tuple[int, ...]) -> Slice:
        if self.ep:
            return Slice(0, *self.experts)
        inner = self.spec.moe.intermediate_size
        if module == "gate_up_proj":  # [E, 2I, H] rows interleaved gate/up; bias [E, 2I]
            start, end = self.inner(inner, "intermediate_size")
            return Slice(1, 2 * start, 2 * end)
        if module in ("gate_proj", "up_proj"):  # GLM [E, I, H]
            return Slice(1, *self.inner(inner, "moe_intermediate_size"))
        if module == "down_proj":
            if leaf == "bias":
                return self.rank0_only()
            return Slice(2, *self.inner(inner, "intermediate_size"))
        raise ShardingError(f"no tensor-parallel rule for expert tensor {name} {list(shape)}")


@dataclass(frozen=True)
class RankLayout:
    """The sizes one rank's layers work with, from the same rules as its shard plan.

    q_heads, kv_heads: [start, end) head ranges of this rank's attention.
    vocab: [start, end) rows of the embedding and lm_head; vocab_per_rank = cdiv(V, tp), the width
        every rank's logits are padded to before they are gathered.
    experts: [start, end) of the routed experts this rank holds whole (expert parallel), or None
        when every rank holds a slice of every expert.
    """

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    vocab: tuple[int, int]
    vocab_per_rank: int
    experts: tuple[int, int] | None

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def rank_layout(spec: ModelSpec, tp: int, rank: int, ep: bool = False) -> RankLayout:
    """RankLayout of `rank` of `tp` (ShardingError for a split the model does not allow)."""
    planner = _Planner(spec, tp, rank, ep)
    q, kv = head_ranges(spec, tp, rank)
    return RankLayout(q, kv, planner.vocab, math.ceil(spec.vocab_size / tp), planner.experts)


def shard_plan(spec: ModelSpec, tp: int, rank: int, ep: bool = False) -> ShardPlan:
    """{loader output name: Slice} for `rank` of `tp`. With ep, experts are split whole across the
    same tp ranks. Raises ShardingError for a split the model does not allow (heads, sizes, or a
    block-FP8 weight cut off its 128-value block grid)."""
    planner = _Planner(spec, tp, rank, ep)
    plan = {name: planner.slice(name, shape) for name, shape in logical_shapes(spec).items()}
    q = spec.quant
    if q.method == "fp8" and q.fp8_strategy == "block":
        for e in expected_entries(spec):
            if isinstance(e, LinearModule) and not q.is_exempt(e.sources[0]):
                full = ((len(e.sources),) if e.stacked else ()) + tuple(e.shape)
                check_block_boundary(e.out, plan[e.out], full, q.block_size)
    return plan


def check_block_boundary(name: str, s: Slice, full: tuple[int, ...], block: tuple[int, int]) -> None:
    """A block-scaled FP8 weight can only be cut where a scale block starts (or at its very end)."""
    if s.dim is None or s.dim < len(full) - 2:
        return
    axis = s.dim - len(full)  # -2: rows, -1: columns
    b = block[axis]
    if s.start % b or (s.end % b and s.end != full[s.dim]):
        side = "rows" if axis == -2 else "columns"
        raise ShardingError(
            f"{name}: {side} [{s.start}, {s.end}) of {full[s.dim]} do not fall on the {b}-wide FP8 scale blocks, so "
            f"this block-quantized weight cannot be split at this tensor-parallel size; use a tp whose per-rank "
            f"size is a multiple of {b}, or a channel-scaled / bf16 checkpoint")


def slice_weights(weights: dict, plan: ShardPlan) -> dict:
    """Apply `plan` to a fully loaded store (loader output): each rank's tensors and records, as
    contiguous copies. Raises ShardingError for an output the plan does not cover."""
    out = {}
    for name, value in weights.items():
        s = plan.get(name)
        if s is None:
            raise ShardingError(f"the shard plan has no entry for loaded tensor {name}; it was made for another model")
        out[name] = slice_value(name, value, s)
    return out


def _narrow(t: torch.Tensor, dim: int, start: int, end: int) -> torch.Tensor:
    return t.narrow(dim, start, end - start).clone(memory_format=torch.contiguous_format)


def slice_value(name: str, value, s: Slice):
    """One output cut to `s` (see Slice); records keep their format, scales follow their values."""
    if s.zeros:
        if not isinstance(value, torch.Tensor):
            raise ShardingError(f"{name}: only plain tensors can be zeroed on ranks other than 0")
        return torch.zeros_like(value)
    if s.dim is None:
        return value
    if isinstance(value, torch.Tensor):
        return _narrow(value, s.dim, s.start, s.end)
    full = value.shape
    nd = len(full)
    if isinstance(value, DenseWeight):
        return DenseWeight(_narrow(value.weight, s.dim, s.start, s.end))
    if isinstance(value, Fp8Weight):
        return Fp8Weight(_narrow(value.weight, s.dim, s.start, s.end), _fp8_scale(name, value, s), value.block)
    if isinstance(value, Mxfp4Weight):
        if s.dim < nd - 1:  # experts or rows: blocks and scales share these leading dims
            return Mxfp4Weight(_narrow(value.blocks, s.dim, s.start, s.end),
                               padded_scale_copy(value.scales.narrow(s.dim, s.start, s.end - s.start)))
        if s.start % MXFP4_BLOCK or s.end % MXFP4_BLOCK:
            raise ShardingError(f"{name}: columns [{s.start}, {s.end}) do not fall on {MXFP4_BLOCK}-value MXFP4 groups")
        g0, g1 = s.start // MXFP4_BLOCK, s.end // MXFP4_BLOCK
        return Mxfp4Weight(_narrow(value.blocks, nd - 1, g0, g1),
                           padded_scale_copy(value.scales.narrow(nd - 1, g0, g1 - g0)))
    raise ShardingError(f"{name}: cannot slice a {type(value).__name__}")


def _fp8_scale(name: str, w: Fp8Weight, s: Slice) -> torch.Tensor:
    full = w.shape
    axis = s.dim - len(full)
    if axis < -2:
        return _narrow(w.scale, s.dim, s.start, s.end)
    if w.block is not None:
        check_block_boundary(name, s, full, w.block)
        b = w.block[axis]
        return _narrow(w.scale, s.dim, s.start // b, math.ceil(s.end / b))
    if w.scale.shape[s.dim] == 1:  # tensor scale, or a channel scale cut on K
        return w.scale
    return _narrow(w.scale, s.dim, s.start, s.end)  # channel scale [..., N, 1] follows its rows


def stored_index(output, part, s: Slice, block: tuple[int, int] | None) -> tuple[slice, ...] | None:
    """The index into checkpoint tensor `part` (engine.weights.plan.Part of PlannedOutput `output`)
    that holds slice `s` of the output, for safetensors `get_slice`; None: read it whole. Stacked
    GLM experts cut on the expert dim are chosen whole by `held_experts` instead."""
    entry, role, stored = output.entry, part.role, part.info.shape
    if s.dim is None or s.zeros:
        return None
    dim, start, end = s.dim, s.start, s.end
    if isinstance(entry, LinearModule):
        if entry.stacked:
            if dim == 0:
                return None
            dim -= 1
        if role == "scale":
            if block is not None:
                full = tuple(entry.shape)
                check_block_boundary(entry.out, Slice(dim, start, end), full, block)
                b = block[dim - len(full)]
                start, end = start // b, math.ceil(end / b)
            elif dim >= len(stored) or stored[dim] != entry.shape[dim]:
                return None  # a tensor scale, or a channel scale on a column cut
    elif isinstance(entry, Mxfp4Experts) and dim == 2:
        start, end = start // MXFP4_BLOCK, end // MXFP4_BLOCK  # K groups: blocks and scales dim 2
    elif isinstance(entry, TransposedExperts) and dim > 0:
        dim = 3 - dim  # stored [E, K, N]
    return (slice(None),) * dim + (slice(start, end),)


def held_experts(output, s: Slice) -> range | None:
    """For a stacked GLM expert output cut on its expert dim: the experts this rank reads."""
    if isinstance(output.entry, LinearModule) and output.entry.stacked and s.dim == 0:
        return range(s.start, s.end)
    return None
