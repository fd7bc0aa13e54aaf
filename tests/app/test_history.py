"""History: CRUD, search, export, WAL, persistence across restarts and a SIGKILL mid-answer."""
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from live_server import png_bytes
from localchat.app.history import DONE, INTERRUPTED, PARTIAL, ChatSettings, History


def test_crud_settings_and_restart(tmp_path):
    h = History(tmp_path)
    cid = h.create("Cats", ChatSettings(system_prompt="be brief", temperature=0.2, thinking=False))
    sha = h.put_image(png_bytes())
    h.add_message(cid, "user", "what cat?", images=[sha, sha])
    mid = h.begin_answer(cid)
    h.finish_answer(mid, "a tabby", "stripes suggest tabby", {"tokens_per_s": 12.5})
    h.rename(cid, "  Tabby  ")
    h.close()
    h = History(tmp_path)  # a restart sees everything
    conv = h.get(cid)
    assert conv.title == "Tabby" and conv.settings.system_prompt == "be brief" and conv.settings.thinking is False
    assert [(m.role, m.text, m.status) for m in conv.messages] == [("user", "what cat?", DONE), ("assistant", "a tabby", DONE)]
    assert conv.messages[0].images == [sha, sha] and conv.messages[1].reasoning == "stripes suggest tabby"
    assert conv.messages[1].stats == {"tokens_per_s": 12.5}
    assert h.image_path(sha).read_bytes() == png_bytes()
    assert sqlite3.connect(h.db_path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert h._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert h._db.execute("SELECT version FROM schema_version").fetchone()[0] == 1


def test_images_deduplicated_and_collected_on_delete(tmp_path, monkeypatch):
    import localchat.app.history as history_mod

    monkeypatch.setattr(history_mod, "_FRESH_IMAGE_S", 0.0)
    h = History(tmp_path)
    a, b = h.create("a"), h.create("b")
    shared, own = h.put_image(png_bytes(color=(1, 1, 1))), h.put_image(png_bytes(color=(2, 2, 2)))
    assert h.put_image(png_bytes(color=(1, 1, 1))) == shared
    h.add_message(a, "user", "x", images=[shared, own])
    h.add_message(b, "user", "y", images=[shared])
    assert len(list(h.images_dir.rglob("*.png"))) == 2
    h.delete(a)
    assert not h.exists(a) and h.image_path(shared).exists()
    with pytest.raises(KeyError):
        h.image_path(own)
    assert len(list(h.images_dir.rglob("*.png"))) == 1
    h.truncate(b, 0)
    assert list(h.images_dir.rglob("*.png")) == [] and h.get(b).messages == []


def test_list_search_and_truncate(tmp_path):
    h = History(tmp_path)
    a = h.create("Holiday plans")
    b = h.create("Work")
    h.add_message(b, "user", "The QUARTERLY report 100%")
    h.add_message(b, "assistant", "done")
    h.add_message(a, "user", "beach")
    assert [c[0] for c in h.list()] == [a, b]  # newest activity first
    assert [c[0] for c in h.list("quarterly")] == [b]
    assert [c[0] for c in h.list("holiday")] == [a]
    assert [c[0] for c in h.list("100%")] == [b] and h.list("1_0") == []  # LIKE wildcards are literal
    h.truncate(b, 1)
    assert [m.text for m in h.get(b).messages] == ["The QUARTERLY report 100%"]
    h.add_message(b, "assistant", "again")
    assert [m.position for m in h.get(b).messages] == [0, 1]


def test_export_json_and_markdown(tmp_path):
    h = History(tmp_path)
    cid = h.create("Export me", ChatSettings(system_prompt="sys"))
    sha = h.put_image(png_bytes())
    h.add_message(cid, "user", "look", images=[sha])
    mid = h.begin_answer(cid)
    h.finish_answer(mid, "An answer with $x^2$.", "I think", {"completion_tokens": 5})
    data = json.loads(h.export_json(cid))
    assert data["title"] == "Export me" and data["settings"]["system_prompt"] == "sys"
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    img = data["messages"][0]["images"][0]
    assert img["sha256"] == sha and img["data_url"].startswith("data:image/png;base64,")
    assert data["messages"][1]["reasoning"] == "I think"
    assert "data_url" not in json.loads(h.export_json(cid, embed_images=False))["messages"][0]["images"][0]
    md = h.export_markdown(cid, embed_images=False)
    assert md.startswith("# Export me") and "> **System:** sys" in md
    assert f"![image 1]({sha}.png)" in md and "<details><summary>Thinking</summary>" in md
    assert md.index("## User") < md.index("## Assistant") < md.index("An answer with $x^2$.")


def test_exports_show_grounding_boxes_as_the_chat_does(tmp_path):
    h = History(tmp_path)
    cid = h.create("Boxes")
    h.add_message(cid, "user", "where are the cats?")
    mid = h.begin_answer(cid)
    raw = ("Two cats: <|begin_of_box|>[[10,20,300,400],[500,520,990,1000]]<|end_of_box|> and a dog "
           "<|begin_of_box|>[12.5,0,40,60]<|end_of_box|>.")
    h.finish_answer(mid, raw, "", {})
    data = json.loads(h.export_json(cid))
    answer = data["messages"][1]
    assert answer["text"] == "Two cats: [box 1, box 2] and a dog [box 3]." and answer["raw_text"] == raw
    assert [b["xyxy_0_1000"] for b in answer["boxes"]] == [[10, 20, 300, 400], [500, 520, 990, 1000], [12.5, 0, 40, 60]]
    assert "begin_of_box" not in data["messages"][0]["text"] and "boxes" not in data["messages"][0]
    md = h.export_markdown(cid)
    assert "<|" not in md and "Two cats: [box 1, box 2] and a dog [box 3]." in md
    assert "- box 1: [10, 20, 300, 400]" in md and "- box 3: [12.5, 0, 40, 60]" in md


def test_an_export_imports_as_the_same_chat_elsewhere(tmp_path):
    from localchat.app.history_import import import_conversation

    h = History(tmp_path / "a")
    cid = h.create("Trip", ChatSettings(system_prompt="sys", temperature=0.3, thinking=False))
    red, blue = png_bytes(8, 8, (200, 0, 0)), png_bytes(8, 8, (0, 0, 200), fmt="JPEG")
    h.add_message(cid, "user", "where are the cats?", images=[h.put_image(red), h.put_image(blue)])
    mid = h.begin_answer(cid)
    raw = "A cat <|begin_of_box|>[[10,20,300,400]]<|end_of_box|>."
    h.finish_answer(mid, raw, "thinking", {"completion_tokens": 7, "dropped_messages": 2}, status="stopped")
    exported = h.export_json(cid).encode()

    other = History(tmp_path / "b")  # another machine: none of the images are there
    new = import_conversation(other, exported)
    conv, orig = other.get(new), h.get(cid)
    assert (conv.title, conv.settings) == (orig.title, orig.settings)
    strip = [(m.role, m.text, m.reasoning, m.images, m.stats, m.status) for m in orig.messages]
    assert [(m.role, m.text, m.reasoning, m.images, m.stats, m.status) for m in conv.messages] == strip
    assert other.image_path(conv.messages[0].images[1]).read_bytes() == blue
    # a second import is a second chat, and the images are stored once
    assert import_conversation(other, exported) != new and len(other.list()) == 2
    # without embedded images it imports only where the images already are
    bare = h.export_json(cid, embed_images=False).encode()
    assert import_conversation(h, bare) and len(h.list()) == 2
    other_bare = History(tmp_path / "c")
    with pytest.raises(ValueError, match="exported without images"):
        import_conversation(other_bare, bare)
    assert other_bare.list() == []


@pytest.mark.parametrize("data,reason", [
    (b"not json", "not JSON"), (b'{"format": "something-else"}', "not a localchat conversation"),
    (b'{"format": "localchat-conversation", "messages": [{"role": "tool"}]}', "message 1 is not"),
    (b'{"format": "localchat-conversation", "messages": [{"role": "user", "text": "x", "images": '
     b'[{"data_url": "data:image/png;base64,aGVsbG8="}]}]}', "image 1 is not a readable image"),
])
def test_a_file_that_is_not_an_export_is_refused_and_changes_nothing(tmp_path, data, reason):
    from localchat.app.history_import import ImportRejected, import_conversation

    h = History(tmp_path)
    with pytest.raises(ImportRejected, match=reason):
        import_conversation(h, data)
    assert h.list() == []


_WRITER = r"""
import sys, time
from localchat.app.history import History
h = History(sys.argv[1])
cid = h.create("crash test")
for i in range(3):
    h.add_message(cid, "user", f"question {i}")
    mid = h.begin_answer(cid)
    h.finish_answer(mid, f"answer {i}", "", {})
h.add_message(cid, "user", "question 3")
mid = h.begin_answer(cid)
text = ""
for i in range(10_000):
    text += f" tok{i}"
    if i % 5 == 0:
        h.checkpoint(mid, text, "")
    if i == 50:
        print(cid, flush=True)
    time.sleep(0.001)
"""


def test_sigkill_mid_answer_loses_only_the_answer_in_flight(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    cid = proc.stdout.readline().strip()
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    conv = History(tmp_path).get(cid)
    msgs = conv.messages
    assert [m.text for m in msgs[:7]] == ["question 0", "answer 0", "question 1", "answer 1", "question 2",
                                          "answer 2", "question 3"]
    assert all(m.status == DONE for m in msgs[:7])
    assert len(msgs) == 8 and msgs[7].status == INTERRUPTED and msgs[7].text.startswith(" tok0 tok1")


def test_a_second_server_on_the_same_data_dir_leaves_the_first_ones_answer_alone(tmp_path):
    first = History(tmp_path)
    cid = first.create(title="busy")
    first.add_message(cid, "user", "hi")
    mid = first.begin_answer(cid)
    second = History(tmp_path)  # another localchat opening the dir while the first generates
    assert second.get(cid).messages[-1].status == PARTIAL
    first.finish_answer(mid, "done now", "", {}, DONE)
    assert second.get(cid).messages[-1].status == DONE
    # a dir whose openers are all gone: a leftover partial answer is one that was cut short
    first.begin_answer(cid)
    first.close()
    second.close()
    assert History(tmp_path).get(cid).messages[-1].status == INTERRUPTED
