"""Images -> the vision tower's inputs through the checkpoint's image processor, each image once.

A chat's prompt is built again every turn with all of its images, and the processor (transformers'
PIL backend: a bicubic resize, rescale, normalise and patch layout in numpy) takes ~40 ms for a
1024x768 photo and ~115 ms for 2.7 MP on a 2-core machine (BENCHMARKS.md, "Image encoding"). So
each image's patches are kept, by the sha256 of its bytes, up to a byte budget (least recently used
first out), and images not yet seen are processed side by side on threads (the resize and the
numpy passes release the GIL). The processor works on each image alone, so one image's patches do
not depend on the others in the call and can be concatenated in the prompt's order.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch

from .request import ImagePart

CACHE_BYTES = 256 << 20  # ~13 photos of 1024x768 (18.8 MB of float32 patches each)
MAX_THREADS = 8


class ImageInputs:
    def __init__(self, processor, cache_bytes: int = CACHE_BYTES):
        self.processor = processor
        self.cache_bytes = cache_bytes
        self._kept: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __call__(self, images: list[ImagePart]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pixel_values [N_patches, C*T*P*P], image_grid_thw [len(images), 3]), as the processor
        returns them for these images in one call."""
        found = {}
        with self._lock:
            for p in images:
                if p.sha256 in self._kept:
                    self._kept.move_to_end(p.sha256)
                    found[p.sha256] = self._kept[p.sha256]
        todo = list({p.sha256: p for p in images if p.sha256 not in found}.values())
        if len(todo) == 1:
            found[todo[0].sha256] = self._process(todo[0])
        elif todo:
            with ThreadPoolExecutor(min(len(todo), MAX_THREADS)) as pool:
                for p, out in zip(todo, pool.map(self._process, todo)):
                    found[p.sha256] = out
        with self._lock:
            for p in todo:
                self._keep(p.sha256, found[p.sha256])
        parts = [found[p.sha256] for p in images]
        return torch.cat([pixels for pixels, _ in parts]), torch.cat([grid for _, grid in parts])

    def _process(self, image: ImagePart) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.processor(images=[image.image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def _keep(self, key: str, value: tuple[torch.Tensor, torch.Tensor]) -> None:
        size = value[0].numel() * value[0].element_size()
        if key in self._kept or size > self.cache_bytes:
            return
        self._kept[key] = value
        self._bytes += size
        while self._bytes > self.cache_bytes:
            _, (old, _) = self._kept.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
