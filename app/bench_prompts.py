"""Prompts for the benchmark: random token ids of a fixed length, and real images read as GLM-4.5V's
image processor reads them (engine/runtime/image_patches.py), built without a downloaded tokenizer.

It stands in for the engine's ChatFormatter (`build(request) -> Prompt`, `answer_prefix`, `thinks`
and `.tokenizer`): the tokenizer is a word-level one with one word per id of the model's full
vocabulary, so detokenizing what a random model says costs what it costs with the real tokenizer
and never fails.
"""
from __future__ import annotations

import random

import torch

from ..engine.runtime.image_patches import PatchRecipe
from ..engine.runtime.prompt import Prompt
from ..engine.runtime.request import ChatRequest, ImagePart, TextPart
from ..engine.spec import ModelSpec

# GLM-4.5V's image processor settings (reference notes: preprocessor_config.json of GLM-4.1V and
# GLM-4.5V: min 12544 and max 9633792 pixels, 14-pixel patches, 2x2 merge, 2 frames per patch).
GLM_IMAGE_PROCESSOR = {
    "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3,
    "size": {"shortest_edge": 12544, "longest_edge": 9633792},
}
# Random prompt ids stay below every special token of both families (GLM's start at 151329).
ORDINARY_IDS = (1000, 100_000)


def word_tokenizer(vocab_size: int):
    """A fast tokenizer whose id i is the word "w{i}" (the end-of-text markers are specials)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok)


class SyntheticPrompts:
    """A request's text part is replaced by `prompt_len` random ids (fresh ones per request, so
    the prefix cache finds nothing; a part "tokens:N" asks for N), each image part by the model's
    image tokens; a part "history:N:SEED" puts N ids drawn from SEED first, the same in every
    request naming that seed (a conversation's earlier turns, found in the prefix cache)."""

    def __init__(self, spec: ModelSpec, prompt_len: int, seed: int = 0):
        self.spec = spec
        self.prompt_len = prompt_len
        self.tokenizer = word_tokenizer(spec.vocab_size)
        self.random = random.Random(seed)
        self.image_recipe = PatchRecipe.from_config(GLM_IMAGE_PROCESSOR) if spec.vision is not None else None

    def _ids(self, n: int) -> list[int]:
        return [self.random.randrange(*ORDINARY_IDS) for _ in range(n)]

    @staticmethod
    def shared_ids(n: int, seed: int) -> list[int]:
        """n ids that are the same for every request naming `seed`: a conversation's history,
        which the prefix cache then holds once."""
        draw = random.Random(seed)
        return [draw.randrange(*ORDINARY_IDS) for _ in range(n)]

    def answer_prefix(self, request: ChatRequest) -> str:
        """Random prompts never force a call, so they hold none of the answer."""
        return ""

    def thinks(self, request: ChatRequest) -> bool:
        return request.thinking

    def prepare_images(self, request: ChatRequest) -> None:
        """Each benchmark image is new (no prefix cache hits): processed in build, when it is timed."""

    def build(self, request: ChatRequest) -> Prompt:
        parts = [p for m in request.messages for p in m.content]
        images = [p for p in parts if isinstance(p, ImagePart)]
        text_len, history = self.prompt_len, []
        for p in parts:
            if isinstance(p, TextPart) and p.text.startswith("tokens:"):
                text_len = int(p.text.split(":", 1)[1])
            elif isinstance(p, TextPart) and p.text.startswith("history:"):
                n, seed = (int(v) for v in p.text.split(":")[1:])
                history = self.shared_ids(n, seed)
        if not images:
            return Prompt(history + self._ids(text_len))
        per_image = tuple(self.image_recipe.resize(p.image) for p in images)
        grid = torch.cat([self.image_recipe.grid(pixels) for pixels in per_image])
        tokens = self.spec.image_tokens
        ids: list[int] = []
        for n in (grid.prod(-1) // self.spec.vision.spatial_merge_size ** 2).tolist():
            ids += [tokens.image_start] + [tokens.image] * n + [tokens.image_end]
        return Prompt(history + ids + self._ids(text_len), per_image, grid, tuple(p.sha256 for p in images),
                      self.image_recipe)
