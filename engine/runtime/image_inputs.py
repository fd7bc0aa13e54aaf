"""Images -> the vision tower's inputs through the checkpoint's image processor, each image once.

A chat's prompt is built again every turn with all of its images, and the processor (transformers'
PIL backend: a bicubic resize, rescale, normalise and patch layout in numpy) takes ~40 ms for a
1024x768 photo and ~115 ms for 2.7 MP on a 2-core machine (BENCHMARKS.md, "Image encoding"). So
each image's patches are kept, by the sha256 of its bytes, up to a byte budget (least recently used
first out), and images not yet seen are processed side by side on threads (the resize and the
numpy passes release the GIL). The processor works on each image alone, so one image's patches do
not depend on the others in the call; they are handed on one tensor an image (the cache's own), and
only the images the vision tower still has to encode are ever put together (step_runner.py): a
prompt is built again every turn with all of its images, and concatenating five photos' patches
took ~27 ms of each turn.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from .bounded_cache import BoundedCache
from .request import ImagePart

CACHE_BYTES = 256 << 20  # ~13 photos of 1024x768 (18.8 MB of float32 patches each)
MAX_THREADS = 8


class ImageInputs:
    def __init__(self, processor, cache_bytes: int = CACHE_BYTES):
        self.processor = processor
        self.cache = BoundedCache(cache_bytes, lambda patches: patches[0].numel() * patches[0].element_size())

    def __call__(self, images: list[ImagePart]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """-> (each image's patches [N_i, C*T*P*P], image_grid_thw [len(images), 3]); concatenated,
        the patches are the pixel_values the processor returns for these images in one call."""
        found = {p.sha256: self.cache.get(p.sha256) for p in images}
        todo = list({p.sha256: p for p in images if found[p.sha256] is None}.values())
        if len(todo) == 1:
            found[todo[0].sha256] = self._process(todo[0])
        elif todo:
            with ThreadPoolExecutor(min(len(todo), MAX_THREADS)) as pool:
                for p, out in zip(todo, pool.map(self._process, todo)):
                    found[p.sha256] = out
        for p in todo:
            self.cache.put(p.sha256, found[p.sha256])
        parts = [found[p.sha256] for p in images]
        return tuple(pixels for pixels, _ in parts), torch.cat([grid for _, grid in parts])

    def _process(self, image: ImagePart) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.processor(images=[image.image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]
