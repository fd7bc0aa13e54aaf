"""Checks and downscaling for uploaded images, shared by the chat page and the /v1 API.

Refused: not decodable, more bytes than `max_bytes`, more pixels than `max_pixels` (a guard
against decompression bombs), more than `max_images` per message. Accepted images above
`target_pixels` are downscaled (aspect kept) and the caller shows the returned note.

An API client sends every image of a conversation again with each turn; decoding a 12 MP phone
photo, downscaling and re-encoding it takes ~120 ms on a 2-core machine (a JPEG decoded at half
size or less where that covers the target; ~270 ms in full). So the result for each image's bytes
is kept (the last PREPARED_BYTES of decoded pictures, least recently used out) and a repeated image
costs its hash.
"""
from __future__ import annotations

import hashlib
import io
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from localchat.engine.runtime.bounded_cache import BoundedCache
from localchat.engine.runtime.request import ImagePart, upright_rgb

_KEPT_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}


@dataclass(frozen=True)
class ImageLimits:
    max_images: int = 8
    max_bytes: int = 20 * 2**20
    max_pixels: int = 64_000_000
    # ~2 MP: about 2,600 GLM-4.5V image tokens (one token per 28x28 patch after 2x2 merge,
    # patch 14 per the checkpoint's preprocessor_config.json), so several images fit a chat.
    target_pixels: int = 1920 * 1080


class ImageRejected(ValueError):
    """The message says which image and which limit; it is shown to the user as is. `name`: the
    refused image's, where one image is meant."""

    def __init__(self, message: str, name: str | None = None):
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class PreparedImage:
    name: str
    data: bytes  # encoded bytes as stored in history and hashed for the prefix cache
    part: ImagePart
    note: str | None  # set when the image was downscaled


def check_count(n: int, limits: ImageLimits) -> None:
    if n > limits.max_images:
        raise ImageRejected(f"{n} images attached; the limit is {limits.max_images} per message. "
                            "Send the rest in a follow-up message.")


PREPARED_BYTES = 256 << 20
MAX_THREADS = 8


def _footprint(value) -> int:
    """Bytes a prepared image holds: (bytes kept, ImagePart, downscale) -> encoded + RGB pixels."""
    data, part, _ = value
    w, h = part.image.size
    return len(data) + 3 * w * h


# the images already prepared, by the sha256 of the bytes given and the limits: (bytes kept,
# ImagePart, (w, h, new w, new h) when downscaled)
_prepared = BoundedCache(PREPARED_BYTES, _footprint)


def prepare_image(data: bytes, name: str, limits: ImageLimits = ImageLimits()) -> PreparedImage:
    key = (hashlib.sha256(data).digest(), limits)
    kept = _prepared.get(key)
    if kept is None:
        kept = _prepare(data, name, limits)
        _prepared.put(key, kept)
    out, part, resized = kept
    note = None
    if resized:
        w, h, nw, nh = resized
        note = (f"{name} was {w}×{h}; downscaled to {nw}×{nh} "
                f"(limit {limits.target_pixels / 1e6:.1f} MP) to fit the context.")
    return PreparedImage(name, out, part, note)


def prepare_images(files: list[tuple[bytes, str]], limits: ImageLimits = ImageLimits()) -> list[PreparedImage]:
    """prepare_image for each (bytes, name), side by side on threads (Pillow releases the GIL while
    it decodes, resizes and encodes): several phone photos in one message take about the time of
    one per core. Raises the first ImageRejected in the given order."""
    if len(files) <= 1:
        return [prepare_image(data, name, limits) for data, name in files]
    with ThreadPoolExecutor(min(len(files), MAX_THREADS)) as pool:
        return list(pool.map(lambda file: prepare_image(file[0], file[1], limits), files))


def _prepare(data: bytes, name: str, limits: ImageLimits):
    if len(data) > limits.max_bytes:
        raise ImageRejected(f"{name} is {_mb(len(data))}; the limit is {_mb(limits.max_bytes)} per image.", name)
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only: size is known before decoding
    except (UnidentifiedImageError, OSError):
        raise ImageRejected(f"{name} is not an image localchat can read (use PNG, JPEG, WebP, GIF or BMP).", name)
    w, h = img.size
    if w * h > limits.max_pixels:
        raise ImageRejected(f"{name} is {w}×{h} = {w * h / 1e6:.0f} MP; the limit is "
                            f"{limits.max_pixels / 1e6:.0f} MP per image.", name)
    target = None
    if w * h > limits.target_pixels:
        scale = math.sqrt(limits.target_pixels / (w * h))
        target = max(1, int(w * scale)), max(1, int(h * scale))
        # a JPEG is then decoded at 1/2, 1/4 or 1/8 of its size where that still covers the target
        # (the decoder's own scaling), and the downscale starts from there: a 12 MP photo in half the time
        img.draft("RGB", target)
    try:
        img.load()
    except (OSError, Image.DecompressionBombError) as e:
        raise ImageRejected(f"{name} could not be decoded ({e}); re-save it as PNG or JPEG.", name)
    fmt = img.format
    rgb = upright_rgb(img)
    resized = None
    if target is not None:
        if (rgb.width > rgb.height) != (w > h):  # its EXIF orientation turned it a quarter
            w, h, target = h, w, target[::-1]
        rgb = rgb.resize(target, Image.Resampling.LANCZOS)
        data = _encode(rgb, "JPEG" if fmt == "JPEG" else "PNG")
        resized = (w, h, *target)
    elif fmt not in _KEPT_FORMATS:
        data = _encode(rgb, "PNG")
    return data, ImagePart(rgb, hashlib.sha256(data).hexdigest()), resized


def _mb(n: int) -> str:
    mb = n / 2**20
    return f"{mb:.0f} MB" if mb >= 10 else f"{mb:.2g} MB"


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {}))
    return buf.getvalue()
