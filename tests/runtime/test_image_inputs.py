"""Images resized as the checkpoint's processor does, each image once."""
import torch
from transformers import AutoImageProcessor

from localchat.app.demo import preprocessor_config
from localchat.engine.runtime.image_inputs import ImageInputs
from localchat.engine.runtime.image_patches import PatchRecipe
from tiny_models import image


def _processor(tmp_path):
    import json
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(preprocessor_config()))
    return AutoImageProcessor.from_pretrained(str(tmp_path))


class Counting:
    """The recipe, counting the images it resizes."""

    def __init__(self, recipe):
        self.recipe, self.images = recipe, 0

    def resize(self, image):
        self.images += 1
        return self.recipe.resize(image)

    def __getattr__(self, name):
        return getattr(self.recipe, name)


def _batched(processor, images):
    out = processor(images=[p.image for p in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def test_patches_as_one_processor_call_gives_them_each_image_once(tmp_path):
    proc = _processor(tmp_path)
    recipe = PatchRecipe.from_processor(proc)
    a, b, c, d = image(0), image(1, 84, 56), image(2, 112, 168), image(3, 28, 200)
    inputs = ImageInputs(Counting(recipe))
    for images, processed in (([a, b, c], 3), ([a, b, a, d], 4), ([c, c, d], 4)):
        pixels, grid = inputs(images)
        want_pixels, want_grid = _batched(proc, images)
        assert torch.equal(grid, want_grid) and torch.equal(recipe.patches(pixels), want_pixels)
        assert [p.shape[1] * p.shape[2] // 14**2 for p in pixels] == grid.prod(-1).tolist()
        assert inputs.recipe.images == processed  # the new images only, a repeated one once


def test_a_later_turn_copies_no_kept_patches(tmp_path):
    # each image's patches are handed on as the cache's own tensor: a chat's prompt, built again
    # every turn with all of its images, puts none of them together
    a, b = image(0), image(1, 84, 56)
    inputs = ImageInputs(PatchRecipe.from_processor(_processor(tmp_path)))
    first, _ = inputs([a])
    later, _ = inputs([a, b])
    assert later[0] is first[0]


def test_patches_kept_within_the_byte_budget(tmp_path):
    recipe = PatchRecipe.from_processor(_processor(tmp_path))
    a, b = image(0, 112, 112), image(1, 112, 112)
    inputs = ImageInputs(Counting(recipe), cache_bytes=recipe.resize(a.image).numel())  # room for one
    inputs([a])
    inputs([b])  # a goes out
    inputs([b])
    assert inputs.recipe.images == 2
    inputs([a])
    assert inputs.recipe.images == 3
    assert inputs.cache.used <= inputs.cache.budget and len(inputs.cache.kept) == 1


def test_images_prepared_before_the_prompt_is_built(glm):
    # The engine resizes the images before taking its tokenizer lock; build then finds them kept.
    from localchat.engine.runtime.request import TextPart
    from tiny_models import chat

    engine = glm.engine(block_size=4)
    inputs = engine.formatter.image_inputs
    counting = Counting(inputs.recipe)
    inputs.recipe = counting
    request = chat(("user", (image(7, 84, 56), image(8), TextPart("Two pictures?"))))
    engine.formatter.prepare_images(request)
    assert counting.images == 2
    prompt = engine.formatter.build(request)
    assert counting.images == 2 and prompt.image_grid_thw.shape == (2, 3)
    engine.shutdown()
