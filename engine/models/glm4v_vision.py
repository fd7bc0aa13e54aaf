"""GLM-4.5V vision tower: patch embedding, learned position table resampled to each image's
grid, 2-D rotary, non-causal attention per image, spatial 2x2 merge and the merger MLP.

On CUDA the residual add and each block's RMSNorm run as one kernel, and q and k are rotated by
the decoder's rotary kernel (the 2-D angles laid out as its cos / sin rows); elsewhere their torch
references. A 1024x768 photo (3996 patches) encodes in 17 ms on an H100 (BENCHMARKS.md)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.rotary import apply_rotary, apply_rotary_ref
from ..layers.linear import linear
from ..layers.mlp import GatedMLP
from ..layers.norm import add_rms_norm, layer_norm, rms_norm
from ..runtime.bounded_cache import BoundedCache
from ..spec import VisionSpec

POSITION_CACHE = 4  # image grids whose resampled position table is kept (photos often share a size)


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """[N, 2] (row, col) of every patch in the processor's order: 2x2 merge windows row-major,
    then the patches inside each window row-major, repeated per temporal frame."""
    coords = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rc = torch.stack((rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()), dim=-1)
        coords.append(rc.repeat(t, 1))
    return torch.cat(coords)


class Glm4vVisionTower:
    def __init__(self, spec: VisionSpec, weights: dict, prefix: str):
        self.spec = spec
        self.patch_weight = weights[f"{prefix}.patch_embed.proj.weight"]  # [D, C, T, P, P]
        self.patch_bias = weights[f"{prefix}.patch_embed.proj.bias"]
        self.post_conv_norm = weights[f"{prefix}.post_conv_layernorm.weight"]
        self.position_table = weights[f"{prefix}.embeddings.position_embedding.weight"]  # [S*S, D]
        self.blocks = []
        for i in range(spec.depth):
            p = f"{prefix}.blocks.{i}"
            self.blocks.append((weights[f"{p}.norm1.weight"], weights[f"{p}.attn.qkv.weight"],
                                weights.get(f"{p}.attn.qkv.bias"), weights[f"{p}.attn.proj.weight"],
                                weights[f"{p}.norm2.weight"], GatedMLP(weights, f"{p}.mlp")))
        self.post_norm = weights[f"{prefix}.post_layernorm.weight"]
        self.downsample_weight = weights[f"{prefix}.downsample.weight"]  # [out, D, m, m]
        self.downsample_bias = weights[f"{prefix}.downsample.bias"]
        self.merger_proj = weights[f"{prefix}.merger.proj.weight"]
        self.merger_norm = (weights[f"{prefix}.merger.post_projection_norm.weight"],
                            weights[f"{prefix}.merger.post_projection_norm.bias"])
        self.merger_mlp = GatedMLP(weights, f"{prefix}.merger")
        half = spec.head_dim // 2
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
        self._positions = BoundedCache(POSITION_CACHE)  # by (h, w, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_weight.dtype

    def _grid_positions(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        """The position table resampled (bicubic) at the centre of each patch of an h x w grid,
        in the processor's patch order -> [h * w, D]; the last few grids' are kept."""
        key = (h, w, device)
        kept = self._positions.get(key)
        if kept is not None:
            return kept
        table = self.position_table
        side = int(table.shape[0] ** 0.5)
        grid_img = table.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
        coords = patch_coordinates(torch.tensor([[1, h, w]]), self.spec.spatial_merge_size).to(device)
        size = torch.tensor([h, w], dtype=torch.float32, device=device)
        # grid_sample coordinates: x (width) first, centres of the target grid mapped to [-1, 1].
        norm = (coords.to(torch.float32) + 0.5) / size * 2 - 1
        grid = torch.stack((norm[:, 1], norm[:, 0]), dim=-1).view(1, -1, 1, 2)
        sampled = F.grid_sample(grid_img, grid, mode="bicubic", align_corners=False, padding_mode="border")
        out = sampled.view(table.shape[1], -1).t().to(table.dtype)
        self._positions.put(key, out)
        return out

    def _position_embedding(self, grid_thw: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[N, D] for every patch of every image (each frame of an image repeats its grid's)."""
        return torch.cat([self._grid_positions(h, w, device).repeat(t, 1) for t, h, w in grid_thw.tolist()])

    def _rotary(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32: the row angles, then the column angles, twice (the
        halves the rotation pairs)."""
        inv = self.inv_freq.to(coords.device)
        freqs = torch.cat((coords[:, :1].float() * inv, coords[:, 1:].float() * inv), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*T*P*P] (processor layout), grid_thw [n, 3] -> [N / m^2, out_hidden]."""
        s = self.spec
        dtype = self.dtype if self.dtype.is_floating_point else torch.float32
        x = pixel_values.to(dtype)
        # The Conv3d with kernel == stride is one matmul over each flattened patch.
        x = F.linear(x, self.patch_weight.reshape(self.patch_weight.shape[0], -1).to(dtype), self.patch_bias.to(dtype))
        coords = patch_coordinates(grid_thw, s.spatial_merge_size).to(x.device)
        cos, sin = self._rotary(coords)
        seg = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        # The residual stream beside the blocks; each norm also adds the output before it, the
        # first one the position embedding.
        out = rms_norm(x, self.post_conv_norm, s.rms_norm_eps)
        residual = self._position_embedding(grid_thw, x.device).to(dtype)
        for norm1, qkv_w, qkv_b, proj_w, norm2, mlp in self.blocks:
            h, residual = add_rms_norm(out, residual, norm1, s.rms_norm_eps)
            h, residual = add_rms_norm(linear(self._attention(h, qkv_w, qkv_b, cos, sin, seg), proj_w), residual,
                                       norm2, s.rms_norm_eps)
            out = mlp(h)
        x = add_rms_norm(out, residual, self.post_norm, s.rms_norm_eps)[0]
        m = s.spatial_merge_size
        # [N, D] -> [N/m^2, D, m, m]: the Conv2d with kernel == stride == m is again one matmul.
        x = x.view(-1, m, m, s.hidden_size).permute(0, 3, 1, 2).reshape(-1, s.hidden_size * m * m)
        x = F.linear(x, self.downsample_weight.reshape(self.downsample_weight.shape[0], -1).to(dtype),
                     self.downsample_bias.to(dtype))
        x = linear(x, self.merger_proj)
        x = F.gelu(layer_norm(x, *self.merger_norm))
        return self.merger_mlp(x)

    def _attention(self, x, qkv_w, qkv_b, cos, sin, segments):
        n = x.shape[0]
        heads, hd = self.spec.num_heads, self.spec.head_dim
        q, k, v = linear(x, qkv_w, qkv_b).view(n, 3, heads, hd).unbind(1)
        q, k = (apply_rotary if x.is_cuda else apply_rotary_ref)(q, k, cos, sin)
        outs = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments)):
            # [1, heads, n, hd]: SDPA's fused kernels (flash, memory-efficient) take 4-D inputs
            # only; a 3-D call runs its math path, which writes every [heads, n, n] score matrix
            o = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                               vs.transpose(0, 1)[None])[0]
            outs.append(o.transpose(0, 1))
        return torch.cat(outs).reshape(n, -1)
