"""Images -> the vision tower's inputs, each image resized once.

A chat's prompt is built again every turn with all of its images. Each image is resized as the
checkpoint's processor does (image_patches.py: Pillow's bicubic, 12 ms for a 1024x768 photo on a
2-core machine) and kept, by the sha256 of its bytes, as its resized pixels ([3, H, W] uint8, 2.3 MB
for that photo) up to a byte budget (least recently used first out); images not yet seen are
resized side by side on threads (Pillow releases the GIL). The patches themselves are made where
the vision tower runs, from the images it still has to encode (step_runner.py). Each image is
handed on as the cache's own tensor: a turn's prompt copies none of them.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .bounded_cache import BoundedCache
from .image_patches import PatchRecipe
from .request import ImagePart

CACHE_BYTES = 256 << 20  # ~100 photos of 1024x768 (2.3 MB of resized pixels each)
MAX_THREADS = 8


class ImageInputs:
    def __init__(self, recipe: PatchRecipe, cache_bytes: int = CACHE_BYTES):
        self.recipe = recipe
        self.cache = BoundedCache(cache_bytes, lambda pixels: pixels.numel())

    def __call__(self, images: list[ImagePart]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """-> (each image resized, [3, H_i, W_i] uint8; image_grid_thw [len(images), 3]): the
        recipe's patches of the images are the pixel_values the processor returns for them."""
        found = {p.sha256: self.cache.get(p.sha256) for p in images}
        todo = list({p.sha256: p for p in images if found[p.sha256] is None}.values())
        if len(todo) == 1:
            found[todo[0].sha256] = self._resize(todo[0])
        elif todo:
            with ThreadPoolExecutor(min(len(todo), MAX_THREADS)) as pool:
                for p, out in zip(todo, pool.map(self._resize, todo)):
                    found[p.sha256] = out
        for p in todo:
            self.cache.put(p.sha256, found[p.sha256])
        pixels = tuple(found[p.sha256] for p in images)
        return pixels, torch.cat([self.recipe.grid(image) for image in pixels])

    def _resize(self, image: ImagePart) -> torch.Tensor:
        return self.recipe.resize(image.image)
