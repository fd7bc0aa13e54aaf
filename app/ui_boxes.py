"""GLM-4.5V grounding boxes in an answer: readable labels in the text, and the boxes drawn on the image.

GLM-4.5V writes boxes as `<|begin_of_box|>[[x1,y1,x2,y2], ...]<|end_of_box|>` with coordinates
normalised to 0..1000 of the image width and height (zai-org/GLM-V README, "grounding"; noted in
/work/shared/reference/models.md A.8). Each box becomes "[box N]" in the text and a numbered
rectangle on a copy of the image, numbered in answer order so text and picture agree.
"""
from __future__ import annotations

import io
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont

from localchat.engine.runtime.reasoning import Box, parse_boxes
from localchat.engine.runtime.request import upright_rgb

if TYPE_CHECKING:  # history.py's exports use label_answer: no import cycle at run time
    from localchat.app.history import History

BEGIN, END = "<|begin_of_box|>", "<|end_of_box|>"
_SPAN = re.compile(re.escape(BEGIN) + r"(.*?)" + re.escape(END), re.S)

# Distinct on photos and on each other (red, blue, green, orange, magenta, cyan, yellow, purple).
PALETTE = [(230, 25, 75), (0, 130, 200), (60, 180, 75), (245, 130, 48),
           (240, 50, 230), (70, 240, 240), (255, 225, 25), (145, 30, 180)]


def label_answer(text: str, *, live: bool = False) -> tuple[str, list[Box]]:
    """(answer with every box span replaced by "[box N]" labels, the boxes in label order).

    A span without one complete group of four numbers is malformed: its tokens are dropped and
    its inner text kept. While `live`, an unclosed span at the end is hidden (its numbers are
    still arriving) instead of shown raw.
    """
    boxes = parse_boxes(text)
    by_span: dict[tuple[int, int], list[int]] = {}
    for n, b in enumerate(boxes, 1):
        by_span.setdefault((b.start, b.end), []).append(n)
    out, last = [], 0
    for m in _SPAN.finditer(text):
        out.append(text[last:m.start()])
        numbers = by_span.get((m.start(), m.end()))
        out.append("[" + ", ".join(f"box {n}" for n in numbers) + "]" if numbers else m.group(1))
        last = m.end()
    tail = text[last:]
    if live and BEGIN in tail:
        tail = tail[:tail.index(BEGIN)]
    out.append(tail.replace(BEGIN, "").replace(END, ""))
    return "".join(out), boxes


def box_coordinates(box: Box) -> list[float]:
    """[x1, y1, x2, y2] on the model's 0..1000 grid, integers where they are whole."""
    return [int(v) if float(v).is_integer() else v for v in (box.x1, box.y1, box.x2, box.y2)]


def pixel_rect(box: Box, width: int, height: int) -> tuple[int, int, int, int]:
    """Box in 0..1000 coordinates -> (left, top, right, bottom) pixels inside a width×height image;
    clamped to the image, corners ordered (a model may swap them)."""
    def px(v: float, size: int) -> int:
        return min(size - 1, max(0, round(v / 1000 * size)))
    xs = sorted((px(box.x1, width), px(box.x2, width)))
    ys = sorted((px(box.y1, height), px(box.y2, height)))
    return xs[0], ys[0], xs[1], ys[1]


def line_width(width: int, height: int) -> int:
    """About 0.6% of the short side: visible on a 4K photo, not a blob on a 64 px icon."""
    return max(1, round(min(width, height) / 160))


def draw_boxes(image: Image.Image, boxes: Sequence[Box]) -> Image.Image:
    """An RGB copy of `image` with box i outlined in PALETTE[i % 8] and labelled i+1 at its top-left."""
    out = image.convert("RGB")  # convert always copies
    w, h = out.size
    lw = line_width(w, h)
    draw = ImageDraw.Draw(out)
    font = ImageFont.load_default(size=max(10, lw * 5))
    for i, box in enumerate(boxes):
        colour = PALETTE[i % len(PALETTE)]
        left, top, right, bottom = pixel_rect(box, w, h)
        draw.rectangle((left, top, right, bottom), outline=colour, width=lw)
        label = str(i + 1)
        tl, tt, tr, tb = draw.textbbox((0, 0), label, font=font)
        tw, th = tr - tl + 2 * lw, tb - tt + 2 * lw
        # The tag sits above the box when there is room, else just inside its top edge.
        y = top - th if top >= th else top
        x = min(left, max(0, w - tw))
        draw.rectangle((x, y, x + tw, y + th), fill=colour)
        dark = sum(colour) > 450  # light tag -> black digits
        draw.text((x + lw - tl, y + lw - tt), label, font=font, fill=(0, 0, 0) if dark else (255, 255, 255))
    return out


def pick_image(turn_images: Sequence[str], earlier_images: Sequence[str], n_boxes: int) -> tuple[str, str] | None:
    """(sha256 of the image the boxes refer to, caption or "") for an answer, or None without images.

    The boxes refer to the answered user turn's image; with several, the last one (GLM gives no
    image index). A turn without images asks about an earlier one: the latest image before it.
    """
    boxes = f"{n_boxes} box{'es' if n_boxes != 1 else ''}"
    if len(turn_images) == 1:
        return turn_images[0], ""
    if turn_images:
        return turn_images[-1], (f"{boxes} drawn on the last of the {len(turn_images)} images in your "
                                 "message; the model does not say which image it means.")
    if earlier_images:
        return earlier_images[-1], f"{boxes} drawn on the latest image earlier in this chat."
    return None


class BoxedImages:
    """Drawn copies kept in the History image store (content-hashed, so redraws dedupe).

    No message refers to a drawn copy, so History's image collection may delete it after a
    while; the memo then misses and the next render draws it again.
    """

    def __init__(self, limit: int = 256):
        self._memo: OrderedDict[tuple, str] = OrderedDict()
        self._lock = threading.Lock()
        self._limit = limit

    def path(self, history: History, sha: str, boxes: Sequence[Box]) -> str | None:
        """File path of image `sha` with `boxes` drawn, or None when the source image is gone."""
        key = (str(history.data_dir), sha, tuple((b.x1, b.y1, b.x2, b.y2) for b in boxes))
        with self._lock:
            drawn = self._memo.get(key)
        if drawn is not None:
            try:
                p = history.image_path(drawn)
                if p.exists():
                    return str(p)
            except KeyError:
                pass
        try:
            with Image.open(history.image_path(sha)) as src:
                fmt = src.format
                img = draw_boxes(upright_rgb(src), boxes)  # boxes lie on the upright image the model saw
        except (KeyError, OSError):  # image file deleted or unreadable: show the labels only
            return None
        buf = io.BytesIO()
        # Photos stay JPEG (a PNG of a 2 MP photo is several MB); drawings and screenshots PNG.
        if fmt == "JPEG":
            img.save(buf, "JPEG", quality=90)
        else:
            img.save(buf, "PNG")
        drawn = history.put_image(buf.getvalue())
        with self._lock:
            self._memo[key] = drawn
            self._memo.move_to_end(key)
            while len(self._memo) > self._limit:
                self._memo.popitem(last=False)
        return str(history.image_path(drawn))


BOXED = BoxedImages()


def boxes_message(history: History, boxes: Sequence[Box], turn_images: Sequence[str],
                  earlier_images: Sequence[str]) -> dict | None:
    """The chatbot message showing `boxes` on the image they refer to, or None (no boxes/no image)."""
    if not boxes:
        return None
    picked = pick_image(turn_images, earlier_images, len(boxes))
    if picked is None:
        return None
    sha, caption = picked
    path = BOXED.path(history, sha, boxes)
    if path is None:
        return None
    alt = f"the image with {len(boxes)} numbered box{'es' if len(boxes) != 1 else ''}"
    content: list = [{"path": path, "alt_text": alt}]
    if caption:
        content.append(caption)
    return {"role": "assistant", "content": content}
