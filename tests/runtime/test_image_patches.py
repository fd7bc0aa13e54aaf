"""GLM-4.5V's image preprocessing: the resize on the CPU, the patches where the tower runs, equal bit
for bit to transformers' image processor."""
import json

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from localchat.app.bench_prompts import GLM_IMAGE_PROCESSOR
from localchat.app.demo import preprocessor_config
from localchat.engine.runtime.image_patches import PatchRecipe, UnsupportedImageProcessor

GLM = {**GLM_IMAGE_PROCESSOR, "image_processor_type": "Glm4vImageProcessor"}


def _processor(tmp_path, cfg: dict):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    return AutoImageProcessor.from_pretrained(str(tmp_path))


def _photo(rng, width: int, height: int) -> Image.Image:
    """Smooth gradients with noise, like a photo: bicubic overshoot and every byte value occur."""
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8))


def _smart_resize():
    try:
        from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize
    except ImportError:
        from transformers.models.glm4v.image_processing_glm4v import smart_resize
    return smart_resize


@pytest.mark.parametrize("settings", ["glm-4.5v", "demo"])
def test_patches_equal_the_processors_bit_for_bit(tmp_path, settings):
    cfg = GLM if settings == "glm-4.5v" else preprocessor_config()
    proc = _processor(tmp_path, cfg)
    recipe = PatchRecipe.from_processor(proc)
    rng = np.random.default_rng(0)
    # upscaled (a side under 28), rounded sides, whole multiples of 28, over the pixel limit, narrow
    sizes = [(20, 30), (1023, 767), (448, 336), (84, 56), (300, 5000), (31, 2000)]
    if settings == "demo":
        sizes += [(640, 480)]  # over the demo's 50176 pixels
    images = [_photo(rng, w, h) for w, h in sizes]
    for img in images:
        want = proc(images=[img], return_tensors="pt")
        pixels = recipe.resize(img)
        assert pixels.dtype == torch.uint8 and pixels.shape[0] == 3
        assert torch.equal(recipe.grid(pixels), want["image_grid_thw"])
        got = recipe.patches([pixels])
        assert got.dtype == torch.float32 and torch.equal(got, want["pixel_values"]), img.size
    # several images in one call: the processor's rows image after image
    some = images[:3]
    want = proc(images=some, return_tensors="pt")["pixel_values"]
    assert torch.equal(recipe.patches([recipe.resize(i) for i in some]), want)


def test_resized_sizes_follow_the_processors_rule():
    smart_resize = _smart_resize()
    recipe = PatchRecipe.from_config(GLM)
    rng = np.random.default_rng(1)
    sizes = [(int(h), int(w)) for h, w in rng.integers(1, 6000, (400, 2))]
    sizes += [(1, 150), (27, 27), (28, 28), (14, 2799), (100, 20000), (4000, 3000), (3000, 4000)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 180:
            continue  # the rule's own limit is at 200, checked below
        want = smart_resize(2, h, w, 2, 28, GLM["size"]["shortest_edge"], GLM["size"]["longest_edge"])
        assert recipe.resized_size(h, w) == want, (h, w)


def test_an_image_too_narrow_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="200 times as long.*crop it"):
        PatchRecipe.from_config(GLM).resized_size(10, 3000)


@pytest.mark.parametrize("change", [{"do_normalize": False}, {"resample": 2}, {"size": {"height": 224, "width": 224}}])
def test_settings_it_does_not_reproduce_are_refused(change):
    with pytest.raises(UnsupportedImageProcessor, match="preprocessor_config.json sets"):
        PatchRecipe.from_config({**GLM, **change})


def test_the_value_table_is_the_processors_arithmetic():
    # the processor rescales in float64 then normalises in float32: a float32-only rescale would
    # differ by an ulp for some bytes
    recipe = PatchRecipe.from_config(GLM)
    table = recipe.value_table()
    v = np.arange(256, dtype=np.float64)
    for c in range(3):
        want = ((v * (1 / 255)).astype(np.float32) - np.float32(GLM["image_mean"][c])) / np.float32(GLM["image_std"][c])
        assert np.array_equal(table[c].numpy(), want)
    assert recipe.value_table() is table  # one table a device


@pytest.mark.gpu
def test_patches_on_the_gpu_equal_those_on_the_cpu():
    recipe = PatchRecipe.from_config(GLM)
    rng = np.random.default_rng(2)
    pixels = [recipe.resize(_photo(rng, w, h)) for w, h in ((1024, 768), (1960, 1400), (448, 336))]
    got = recipe.patches(pixels, "cuda")
    assert got.device.type == "cuda" and torch.equal(got.cpu(), recipe.patches(pixels))
