"""Grounding boxes: labels in the answer text, drawing on the image, and the rendered chat."""

from PIL import Image

from live_server import png_bytes
from localchat.app.ui_boxes import PALETTE, draw_boxes, label_answer, line_width, pixel_rect
from localchat.app.ui_render import render
from localchat.engine.runtime.reasoning import Box

B, E = "<|begin_of_box|>", "<|end_of_box|>"
GREY = (128, 128, 128)


def _box(x1, y1, x2, y2):
    return Box(x1, y1, x2, y2, 0, 0)


def test_label_answer_numbers_boxes_in_order_and_hides_tokens():
    text = f"The cat {B}[[100,200,300,400]]{E} and two dogs {B}[[1,2,3,4],[5,6,7,8]]{E}."
    shown, boxes = label_answer(text)
    assert shown == "The cat [box 1] and two dogs [box 2, box 3]."
    assert [(b.x1, b.y2) for b in boxes] == [(100, 400), (1, 4), (5, 8)]


def test_label_answer_malformed_and_unclosed_spans():
    shown, boxes = label_answer(f"a {B}[[1,2,3]]{E} b {B}[[10,20,30,40]]{E} c {B}[[5,")
    assert boxes[0].x1 == 10 and len(boxes) == 1
    assert shown == "a [[1,2,3]] b [box 1] c [[5,"  # finished answer: stray token dropped, text kept
    live, _ = label_answer(f"a {B}[[10,20,30,40]]{E} c {B}[[5,", live=True)
    assert live == "a [box 1] c "  # still streaming: the unfinished span is hidden
    assert label_answer("plain answer") == ("plain answer", [])


def test_pixel_rect_clamps_and_orders_corners():
    assert pixel_rect(_box(500, 250, 100, 750), 200, 100) == (20, 25, 100, 75)  # x1 > x2 swapped
    assert pixel_rect(_box(-50, -1, 1200, 5000), 200, 100) == (0, 0, 199, 99)


def test_draw_boxes_colours_the_edges_and_leaves_the_rest():
    img = Image.new("RGB", (400, 300), GREY)
    out = draw_boxes(img, [_box(250, 500, 500, 900), _box(900, 100, 600, 400)])  # second one reversed
    assert img.getpixel((100, 270)) == GREY, "the source image must not be changed"
    lw = line_width(400, 300)
    assert lw >= 2
    # Box 1: pixels (100,150)-(200,270); right and bottom edges away from the number tag.
    assert out.getpixel((200, 210)) == PALETTE[0]
    assert out.getpixel((200 - lw + 1, 210)) == PALETTE[0]
    assert out.getpixel((150, 270)) == PALETTE[0]
    assert out.getpixel((150, 210)) == GREY  # inside
    assert out.getpixel((205 + lw, 210)) == GREY  # outside
    # Box 2 after ordering: pixels (240,30)-(360,120).
    assert out.getpixel((360, 80)) == PALETTE[1] and out.getpixel((300, 120)) == PALETTE[1]
    assert out.getpixel((300, 80)) == GREY
    # The number tag above box 1 is filled with its colour.
    tag = [out.getpixel((x, y)) for x in range(100, 110) for y in range(130, 150)]
    assert tag.count(PALETTE[0]) > len(tag) // 3


def test_draw_boxes_clamped_box_draws_on_the_image_border():
    out = draw_boxes(Image.new("RGB", (100, 80), GREY), [_box(-100, -100, 2000, 2000)])
    assert out.getpixel((99, 40)) == PALETTE[0] and out.getpixel((50, 79)) == PALETTE[0]
    assert out.getpixel((50, 40)) == GREY


def _conversation(history, images, answer):
    cid = history.create()
    shas = [history.put_image(png_bytes(60, 40, c)) for c in images]
    history.add_message(cid, "user", "where is it?", images=shas)
    history.add_message(cid, "assistant", answer, stats={"finish_reason": "stop"})
    return history.get(cid).messages, shas


def _file_messages(chat):
    return [m for m in chat if isinstance(m["content"], list) and m["role"] == "assistant"]


def test_render_adds_the_boxed_image_after_the_answer(history):
    msgs, (sha,) = _conversation(history, [GREY], f"Here {B}[[0,0,500,500]]{E}.")
    chat, positions = render(msgs, history)
    texts = [m["content"] for m in chat if isinstance(m["content"], str)]
    assert "Here [box 1]." in texts and not any(B in t for t in texts)
    (boxed,) = _file_messages(chat)
    assert len(boxed["content"]) == 1, "one image: no caption"
    path = boxed["content"][0]["path"]
    assert path != str(history.image_path(sha))
    drawn = Image.open(path)
    assert drawn.size == (60, 40) and drawn.convert("RGB").getpixel((30, 10)) == PALETTE[0]
    assert positions[chat.index(boxed)] == msgs[1].position
    # Rendering again reuses the stored copy instead of storing another.
    again, _ = render(msgs, history)
    assert _file_messages(again)[0]["content"][0]["path"] == path


def test_render_uses_last_of_several_images_with_a_caption(history):
    msgs, shas = _conversation(history, [(255, 255, 255), (0, 0, 0)], f"{B}[[0,0,1000,1000]]{E}")
    (boxed,) = _file_messages(render(msgs, history)[0])
    path, caption = boxed["content"][0]["path"], boxed["content"][1]
    assert "last of the 2 images" in caption
    assert Image.open(path).convert("RGB").getpixel((30, 20)) == (0, 0, 0)  # drawn on the black one


def test_render_without_boxes_or_images_adds_nothing(history):
    msgs, _ = _conversation(history, [GREY], "No boxes here.")
    assert _file_messages(render(msgs, history)[0]) == []
    msgs, _ = _conversation(history, [], f"{B}[[1,2,3,4]]{E}")
    chat, _ = render(msgs, history)
    assert _file_messages(chat) == [] and any(m["content"] == "[box 1]" for m in chat)


def test_boxes_are_drawn_on_the_photo_turned_upright(history):
    """Box coordinates refer to the image the model saw, which a JPEG's EXIF orientation turned."""
    import io

    import numpy as np
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 600x400, shown (and seen by the model) 400x600
    buf = io.BytesIO()
    Image.fromarray(np.full((400, 600, 3), 128, dtype=np.uint8)).save(buf, "JPEG", quality=95, exif=exif)
    cid = history.create()
    sha = history.put_image(buf.getvalue())
    history.add_message(cid, "user", "where is it?", images=[sha])
    history.add_message(cid, "assistant", f"{B}[[0,0,1000,500]]{E}", stats={"finish_reason": "stop"})
    chat, _ = render(history.get(cid).messages, history)
    (boxed,) = _file_messages(chat)
    drawn = Image.open(boxed["content"][0]["path"]).convert("RGB")
    assert drawn.size == (400, 600)
    r, g, _ = drawn.getpixel((200, 299))  # the box's bottom edge, at half the upright height
    assert r - g > 100
    r, g, _ = drawn.getpixel((200, 450))  # below the box
    assert abs(r - g) < 20
