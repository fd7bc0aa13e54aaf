"""GLM-4.5V's image preprocessing, split so that only the resize runs on the CPU.

The checkpoint's image processor (transformers' Glm4vImageProcessor, PIL backend) resizes an image
to a multiple of 28 pixels a side within its pixel limits (bicubic, Pillow), then rescales,
normalises and lays it out as patches in numpy: ~29 ms for a 1024x768 photo and ~85 ms for a
1960x1400 one on a 2-core machine, of which Pillow's resize is 12 ms and 3 ms (BENCHMARKS.md, "the
image processor's arithmetic where the tower runs"). Its output is float32 with each patch written
twice (a still image is two identical frames): 17.9 MB for the 1024x768 photo, 8x its resized pixels.

Here the resize is the processor's own (Pillow, the same size rule), and what is kept and handed to
the engine is the resized image as bytes ([3, H, W] uint8). The rest runs where the vision tower
runs, in `PatchRecipe.patches`: the patch layout moved on the bytes, then each byte value of each
channel looked up in a table of the 256 values the processor computes for it (float64 rescale, then
float32 normalise, as its numpy arithmetic does) and written to both frames. The result equals the
processor's pixel_values bit for bit (tests/runtime/test_image_patches.py).

Layout (reference notes A.7): the image [C, H, W] viewed as (C, H/28, 2, 14, W/28, 2, 14), ordered
(H/28, W/28, 2, 2, C, 14, 14), each patch's pixels repeated over a new temporal axis of 2 after C:
a row of C * 2 * 14 * 14 = 1176 values per 14x14 patch, rows grouped by 2x2 merge window;
image_grid_thw is [1, H/14, W/14].
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from PIL import Image

BICUBIC = 3  # PIL's resample code, as preprocessor_config.json writes it


class UnsupportedImageProcessor(ValueError):
    pass


@dataclass(frozen=True)
class PatchRecipe:
    """The settings of the checkpoint's preprocessor_config.json that turn an image into patches."""

    patch: int  # patch_size: pixels a patch side
    temporal: int  # temporal_patch_size: frames a patch (a still image fills them with copies)
    merge: int  # merge_size: patches a side merged into one LLM token
    min_pixels: int  # size.shortest_edge: least pixels of a resized image (counted over `temporal` frames)
    max_pixels: int  # size.longest_edge: most
    rescale: float  # rescale_factor
    mean: tuple[float, ...]  # image_mean, per channel
    std: tuple[float, ...]  # image_std
    _tables: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_processor(cls, processor) -> "PatchRecipe":
        """From a loaded image processor's settings (transformers' reading of preprocessor_config.json)."""
        return cls.from_config(processor.to_dict())

    @classmethod
    def from_config(cls, cfg: dict) -> "PatchRecipe":
        """From preprocessor_config.json's entries."""
        size = cfg.get("size") or {}
        wanted = {"do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                  "resample": BICUBIC}
        odd = [f"{k}={cfg.get(k)!r}" for k, v in wanted.items() if cfg.get(k, v) != v]
        if odd or "shortest_edge" not in size or "longest_edge" not in size:
            raise UnsupportedImageProcessor(
                f"the checkpoint's preprocessor_config.json sets {', '.join(odd) or 'no size limits'}; localchat "
                "reads images as GLM-4.5V's processor does (resized, bicubic, with shortest_edge and longest_edge "
                "pixel limits, rescaled and normalised): download the checkpoint's preprocessor_config.json again")
        return cls(patch=int(cfg["patch_size"]), temporal=int(cfg["temporal_patch_size"]),
                   merge=int(cfg["merge_size"]), min_pixels=int(size["shortest_edge"]),
                   max_pixels=int(size["longest_edge"]), rescale=float(cfg.get("rescale_factor", 1 / 255)),
                   mean=tuple(float(v) for v in cfg["image_mean"]), std=tuple(float(v) for v in cfg["image_std"]))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the processor resizes an image to: each side a multiple of patch * merge
        closest to the image's, then scaled as a whole into [min_pixels, max_pixels] (reference notes
        A.7, "smart_resize"; the pixels counted over `temporal` frames)."""
        factor, frames = self.patch * self.merge, self.temporal
        if height < factor or width < factor:
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"an image of {width}×{height} pixels is too narrow: GLM-4.5V reads images up to "
                             "200 times as long as they are wide; crop it")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if frames * h * w > self.max_pixels:
            beta = math.sqrt(frames * height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif frames * h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (frames * height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h, w

    def resize(self, image: Image.Image) -> torch.Tensor:
        """An RGB image -> the processor's resized image, [3, H, W] uint8 (Pillow's bicubic)."""
        h, w = self.resized_size(image.height, image.width)
        resized = np.array(image.convert("RGB").resize((w, h), resample=BICUBIC))  # [H, W, 3]
        return torch.from_numpy(resized).permute(2, 0, 1)

    def grid(self, pixels: torch.Tensor) -> torch.Tensor:
        """image_grid_thw [1, 3] (int64) of a resized image [3, H, W]: one frame of H/P x W/P patches."""
        return torch.tensor([[1, pixels.shape[1] // self.patch, pixels.shape[2] // self.patch]])

    def value_table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[C, 256] float32: the processor's value for byte v of channel c, ((v * rescale in float64,
        rounded to float32) - mean_c) / std_c in float32, as its numpy arithmetic computes it."""
        device = torch.device(device)
        table = self._tables.get(device)
        if table is None:
            scaled = (np.arange(256, dtype=np.float64) * self.rescale).astype(np.float32)
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            table = torch.from_numpy((scaled[None, :] - mean[:, None]) / std[:, None]).to(device)
            self._tables[device] = table
        return table

    def patches(self, images: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
        """Resized images, each [C, H_i, W_i] uint8 -> pixel_values [sum N_i, C * T * P * P] float32
        on `device`, N_i = H_i W_i / P^2: the processor's output for these images in one call."""
        table = self.value_table(device)
        p, m, t = self.patch, self.merge, self.temporal
        counts = [img.shape[1] * img.shape[2] // p**2 for img in images]
        out = torch.empty(sum(counts), table.shape[0], t, p * p, device=device)
        start = 0
        for img, n in zip(images, counts):
            c, h, w = img.shape
            # the layout moved on the bytes, before they become four times as many: [N, C, 1, P*P]
            x = img.to(device, non_blocking=True).reshape(c, h // (p * m), m, p, w // (p * m), m, p)
            x = x.permute(1, 4, 2, 5, 0, 3, 6).reshape(n, c, 1, p * p)
            for ch in range(c):
                out[start:start + n, ch] = table[ch][x[:, ch].long()]  # the same values in every frame
            start += n
        return out.view(len(out), table.shape[0] * t * p * p)
