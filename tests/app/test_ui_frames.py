"""An answer's stream gathered into page updates."""
import time

import pytest

from localchat.app.ui_frames import frames


def _paced(n: int, every_s: float, fail_at: int | None = None):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("the server went away")
        if every_s:
            time.sleep(every_s)
        yield i


def test_a_burst_becomes_one_update_with_every_item_in_order():
    start = time.monotonic()
    lists = list(frames(_paced(5000, 0.0), frame_s=0.04))
    elapsed = time.monotonic() - start
    assert [i for batch in lists for i in batch] == list(range(5000))
    assert len(lists) <= elapsed / 0.04 + 2 and all(lists)  # a few lists, not 5000


def test_a_steady_stream_updates_at_most_once_a_frame_and_the_first_item_at_once():
    start = time.monotonic()
    stamps, lists = [], []
    for batch in frames(_paced(40, 0.01), frame_s=0.05):
        stamps.append(time.monotonic())
        lists.append(batch)
    assert [i for batch in lists for i in batch] == list(range(40))
    assert lists[0] == [0] and stamps[0] - start < 0.05  # not held back for a frame
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert all(g >= 0.045 for g in gaps[:-1])  # the last comes when the stream ends
    elapsed = stamps[-1] - start  # ~0.4 s, longer on a busy machine
    assert 3 <= len(lists) <= elapsed / 0.05 + 2  # a list a frame, not one an item


def test_what_the_stream_raises_comes_after_the_items_before_it():
    got = []
    with pytest.raises(RuntimeError, match="went away"):
        for batch in frames(_paced(10, 0.001, fail_at=6), frame_s=0.01):
            got += batch
    assert got == list(range(6))
