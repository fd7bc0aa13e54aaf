"""A new image's way to the vision tower's input, on the host and (with a GPU) the device: the
checkpoint's image processor (transformers, PIL backend) against image_patches.py (Pillow's resize
on the host, the patches made on the device). Random photo-like images, GLM-4.5V's processor
settings; median wall time of --reps calls after one warm-up; also checks the two agree bit for bit.
--uploads times what comes before that instead: an uploaded JPEG checked, decoded, turned upright,
downscaled to the app's ~2 MP and encoded again (app/ui_images.py, its cache bypassed).

    python bench/bench_image_inputs.py [--sizes 1024x768,1960x1400,448x336] [--reps 9]
    python bench/bench_image_inputs.py --uploads [--sizes 4000x3000,3024x4032,1920x1080]
"""
import argparse
import io
import os
import statistics
import time

import numpy as np
import torch
from PIL import Image

from localchat.app.bench_prompts import GLM_IMAGE_PROCESSOR
from localchat.engine.runtime.image_patches import PatchRecipe


def timed(fn, reps: int) -> tuple[float, object]:
    out = fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times), out


def jpeg(width: int, height: int, orientation: int | None = None) -> bytes:
    """Gradients and noise as a JPEG, optionally with an EXIF orientation tag."""
    rng = np.random.default_rng(width * height)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) % 256], -1) + rng.normal(0, 30, (height, width, 3))
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90, exif=exif)
    return buf.getvalue()


def photo(width: int, height: int) -> Image.Image:
    """A JPEG read back, as an upload arrives."""
    return Image.open(io.BytesIO(jpeg(width, height))).convert("RGB")


def uploads(sizes: list[tuple[int, int]], reps: int) -> None:
    from localchat.app import ui_images
    from localchat.app.ui_images import ImageLimits, _prepare
    from localchat.engine.runtime.bounded_cache import BoundedCache

    print("| upload | bytes | prepared | kept as |")
    print("|---|---|---|---|")
    for w, h in sizes:
        for orientation in (None, 6) if w * h > 4e6 else (None,):
            data = jpeg(w, h, orientation)
            ms, (out, part, _) = timed(lambda: _prepare(data, "photo.jpg", ImageLimits()), reps)
            turned = ", EXIF turned" if orientation else ""
            print(f"| {w}x{h} JPEG{turned} | {len(data) / 2**20:.1f} MB | {ms:.0f} ms | "
                  f"{part.image.width}x{part.image.height}, {len(out) / 2**20:.2f} MB |")
    # one message of four photos of the first size, each new: one after another, then prepare_images
    w, h = sizes[0]
    photos = [(jpeg(w + i, h), f"{i}.jpg") for i in range(4)]
    serial, _ = timed(lambda: [_prepare(data, name, ImageLimits()) for data, name in photos], reps)
    fresh = lambda: setattr(ui_images, "_prepared", BoundedCache(1 << 30, ui_images._footprint))  # noqa: E731
    together, _ = timed(lambda: fresh() or ui_images.prepare_images(photos), reps)
    print(f"| four {w}x{h} JPEGs in one message | | {serial:.0f} ms one after another, "
          f"{together:.0f} ms side by side ({os.cpu_count()} CPUs) | |")


def main():
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=None)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--uploads", action="store_true")
    args = p.parse_args()
    default = "4000x3000,3024x4032,1920x1080" if args.uploads else "1024x768,1960x1400,448x336"
    sizes = [tuple(map(int, size.split("x"))) for size in (args.sizes or default).split(",")]
    if args.uploads:
        return uploads(sizes, args.reps)
    processor = Glm4vImageProcessorPil(**GLM_IMAGE_PROCESSOR)
    recipe = PatchRecipe.from_config(GLM_IMAGE_PROCESSOR)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, patches on {device}")
    print("| image | processor (host) | resize (host) | patches (on the device) | kept: processor / resized | equal |")
    print("|---|---|---|---|---|---|")
    for w, h in sizes:
        img = photo(w, h)
        t_proc, out = timed(lambda: processor(images=[img], return_tensors="pt"), args.reps)
        t_resize, pixels = timed(lambda: recipe.resize(img), args.reps)
        t_patch, patches = timed(lambda: recipe.patches([pixels], device), args.reps)
        equal = torch.equal(patches.cpu(), out["pixel_values"])
        kept = out["pixel_values"].numel() * 4 / 2**20, pixels.numel() / 2**20
        print(f"| {w}x{h} ({len(patches)} patches) | {t_proc:.1f} ms | {t_resize:.1f} ms | {t_patch:.2f} ms | "
              f"{kept[0]:.1f} / {kept[1]:.1f} MB | {equal} |")


if __name__ == "__main__":
    main()
