"""Uploaded images: each image's bytes decoded, downscaled and re-encoded once."""
import io

import numpy as np
import pytest
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


def _rotated_jpeg() -> bytes:
    """A 40x20 JPEG, left half red and right half blue, whose EXIF orientation (6) says to turn it a
    quarter clockwise to display it: upright it is 20x40, red on top."""
    px = np.zeros((20, 40, 3), dtype=np.uint8)
    px[:, :20] = (255, 0, 0)
    px[:, 20:] = (0, 0, 255)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=95, exif=exif)
    return buf.getvalue()


def _near(pixel, colour) -> bool:
    return max(abs(a - b) for a, b in zip(pixel, colour)) < 40


def test_a_phone_photo_is_turned_upright_as_its_exif_orientation_says():
    from localchat.engine.runtime.request import ImagePart
    data = _rotated_jpeg()
    part = prepare_image(data, "phone.jpg").part
    assert part.image.size == (20, 40)
    assert _near(part.image.getpixel((10, 5)), (255, 0, 0)) and _near(part.image.getpixel((10, 35)), (0, 0, 255))
    # a chat read back from history decodes the stored bytes the same way
    again = ImagePart.from_bytes(prepare_image(data, "phone.jpg").data)
    assert np.array_equal(np.asarray(again.image), np.asarray(part.image))
    # downscaled, it is stored upright (the re-encoded file carries no orientation)
    small = prepare_image(data, "phone.jpg", ImageLimits(target_pixels=10 * 20))
    assert small.part.image.size == (10, 20) and Image.open(io.BytesIO(small.data)).size == (10, 20)
    assert _near(ImagePart.from_bytes(small.data).image.getpixel((5, 2)), (255, 0, 0))


def test_transparent_pixels_are_shown_over_white_not_the_colour_stored_under_them():
    # black text on a transparent background: the transparent pixels store black too
    rgba = np.zeros((16, 16, 4), dtype=np.uint8)
    rgba[4:12, 4:12, 3] = 255  # an opaque black square
    rgba[0:2, :, :] = (255, 0, 0, 128)  # a half-transparent red band
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    img = prepare_image(buf.getvalue(), "logo.png").part.image
    assert img.mode == "RGB"
    assert img.getpixel((0, 8)) == (255, 255, 255) and img.getpixel((8, 8)) == (0, 0, 0)
    assert img.getpixel((8, 0)) == (255, 127, 127)
    # a palette PNG with a transparent index, likewise
    pal = Image.fromarray(np.where(rgba[..., 3] == 255, 1, 0).astype(np.uint8), "P")
    pal.putpalette([0, 0, 0, 0, 0, 0])
    buf = io.BytesIO()
    pal.save(buf, "PNG", transparency=0)
    img = prepare_image(buf.getvalue(), "icon.png").part.image
    assert img.getpixel((0, 8)) == (255, 255, 255) and img.getpixel((8, 8)) == (0, 0, 0)


def test_a_large_jpeg_decoded_at_a_reduced_size_looks_like_the_full_decode_downscaled(monkeypatch):
    # the decoder's own 1/2..1/8 scaling stands in for decoding every pixel before the downscale
    from PIL.JpegImagePlugin import JpegImageFile
    drafts = []
    real_draft = JpegImageFile.draft
    monkeypatch.setattr(JpegImageFile, "draft", lambda self, mode, size: drafts.append(size) or real_draft(self, mode, size))
    y, x = np.mgrid[0:600, 0:800]
    px = np.stack([x * 255 / 800, y * 255 / 600, 128 + 100 * np.sin(x / 9.0) * np.cos(y / 7.0)], -1)
    buf = io.BytesIO()
    Image.fromarray(px.astype(np.uint8)).save(buf, "JPEG", quality=95)
    limits = ImageLimits(target_pixels=300 * 225)
    got = prepare_image(buf.getvalue(), "photo.jpg", limits)
    assert drafts == [(300, 225)] and got.part.image.size == (300, 225)
    full = Image.open(io.BytesIO(buf.getvalue())).convert("RGB").resize((300, 225), Image.Resampling.LANCZOS)
    diff = np.asarray(full, np.float64) - np.asarray(got.part.image, np.float64)
    assert 10 * np.log10(255**2 / np.mean(diff**2)) > 35  # dB


def test_a_16_bit_greyscale_png_keeps_its_shades():
    # Pillow's own conversion clips 16-bit samples to 255: the picture would reach the model white
    ramp = np.tile(np.linspace(0, 65535, 256).astype(np.uint16), (8, 1))
    buf = io.BytesIO()
    Image.fromarray(ramp).save(buf, "PNG")
    img = prepare_image(buf.getvalue(), "scan.png").part.image
    row = np.asarray(img)[0, :, 0].astype(int)
    assert img.mode == "RGB" and row[0] == 0 and row[-1] == 255 and abs(row[128] - 128) <= 1
    assert np.all(np.diff(row) >= 0) and len(set(row.tolist())) > 200


def test_several_images_prepared_side_by_side_in_order_and_the_first_refusal_raised(monkeypatch):
    import threading
    import time

    from localchat.app.ui_images import ImageRejected, prepare_images
    monkeypatch.setattr(ui_images, "_prepared", BoundedCache(ui_images.PREPARED_BYTES, ui_images._footprint))
    running, most, lock = [0], [0], threading.Lock()
    real = ui_images._prepare

    def slow(*a):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # as long as a photo's decode, so the others start meanwhile
        with lock:
            running[0] -= 1
        return real(*a)

    monkeypatch.setattr(ui_images, "_prepare", slow)
    files = [(_png(i, 40 + i, 30), f"{i}.png") for i in range(4)]
    got = prepare_images(files)
    assert [p.name for p in got] == ["0.png", "1.png", "2.png", "3.png"]
    assert [p.part.image.size for p in got] == [(40, 30), (41, 30), (42, 30), (43, 30)]
    assert most[0] > 1
    bad = files[:1] + [(b"not an image", "a.txt"), (b"nor this", "b.txt")]
    with pytest.raises(ImageRejected, match="a.txt"):
        prepare_images(bad)
