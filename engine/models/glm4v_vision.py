"""GLM-4.5V vision tower: patch embedding, learned position table resampled to each image's
grid, 2-D rotary, non-causal attention per image, spatial 2x2 merge and the merger MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layers.linear import linear
from ..layers.mlp import GatedMLP
from ..layers.norm import layer_norm, rms_norm
from ..spec import VisionSpec


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

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_weight.dtype

    def _position_embedding(self, coords: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Bicubic resampling of the square position table at each patch centre -> [N, D]."""
        table = self.position_table
        side = int(table.shape[0] ** 0.5)
        grid_img = table.view(side, side, -1).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
        sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid_thw.tolist()])
        sizes = sizes.to(torch.float32).to(coords.device)
        # grid_sample coordinates: x (width) first, centres of the target grid mapped to [-1, 1].
        norm = (coords.to(torch.float32) + 0.5) / sizes * 2 - 1
        grid = torch.stack((norm[:, 1], norm[:, 0]), dim=-1).view(1, -1, 1, 2)
        sampled = F.grid_sample(grid_img, grid, mode="bicubic", align_corners=False, padding_mode="border")
        return sampled.view(table.shape[1], -1).t().to(table.dtype)

    def _rotary(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        x = rms_norm(x, self.post_conv_norm, s.rms_norm_eps)
        coords = patch_coordinates(grid_thw, s.spatial_merge_size).to(x.device)
        x = x + self._position_embedding(coords, grid_thw).to(dtype)
        cos, sin = self._rotary(coords)
        seg = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        for norm1, qkv_w, qkv_b, proj_w, norm2, mlp in self.blocks:
            x = x + linear(self._attention(rms_norm(x, norm1, s.rms_norm_eps), qkv_w, qkv_b, cos, sin, seg), proj_w)
            x = x + mlp(rms_norm(x, norm2, s.rms_norm_eps))
        x = rms_norm(x, self.post_norm, s.rms_norm_eps)
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
        c, sn = cos[:, None, :], sin[:, None, :]

        def rot(t):
            tf = t.float()
            t1, t2 = tf[..., : hd // 2], tf[..., hd // 2:]
            return (tf * c + torch.cat((-t2, t1), dim=-1) * sn).to(t.dtype)

        q, k = rot(q), rot(k)
        outs = []
        for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments)):
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            outs.append(o.transpose(0, 1))
        return torch.cat(outs).reshape(n, -1)
