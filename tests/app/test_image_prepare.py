"""Uploaded images: each image's bytes decoded, downscaled and re-encoded once."""
import io

import numpy as np
from PIL import Image

from localchat.app import ui_images
from localchat.app.ui_images import ImageLimits, prepare_image
from localchat.engine.runtime.bounded_cache import BoundedCache


def _png(seed: int, w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.RandomState(seed).randint(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_a_repeated_image_is_prepared_once_and_named_each_time(monkeypatch):
    calls = []
    real = ui_images._prepare
    monkeypatch.setattr(ui_images, "_prepared", BoundedCache(ui_images.PREPARED_BYTES, ui_images._footprint))
    monkeypatch.setattr(ui_images, "_prepare", lambda *a: calls.append(a[1]) or real(*a))
    small = ImageLimits(target_pixels=100 * 100)
    data = _png(0, 400, 200)
    first = prepare_image(data, "a.png", small)
    again = prepare_image(data, "image 2", small)
    assert calls == ["a.png"]
    assert again.data == first.data and again.part.sha256 == first.part.sha256
    assert again.part.image.size == (141, 70)
    assert again.note.startswith("image 2 was 400×200; downscaled to 141×70")
    assert prepare_image(data, "b.png").note is None and calls == ["a.png", "b.png"]  # other limits: prepared again
    assert prepare_image(_png(1, 400, 200), "c.png", small) is not None and len(calls) == 3


def test_prepared_images_kept_within_their_budget(monkeypatch):
    import hashlib
    a, b = _png(0, 64, 64), _png(1, 64, 64)
    sizes = [64 * 64 * 3 + len(d) for d in (a, b)]
    kept = BoundedCache(sum(sizes) - 1, ui_images._footprint)  # room for either, not both
    monkeypatch.setattr(ui_images, "_prepared", kept)
    prepare_image(a, "a")
    prepare_image(b, "b")  # a goes out
    assert [k[0] for k in kept.kept] == [hashlib.sha256(b).digest()] and kept.used == sizes[1]
