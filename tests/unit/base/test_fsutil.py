from __future__ import annotations

import threading

from pipeline.fsutil import exchange


def test_exchange_swaps_two_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "v").write_text("new")
    (b / "v").write_text("old")
    assert exchange(a, b)
    assert (b / "v").read_text() == "new" and (a / "v").read_text() == "old"


def test_a_reader_never_sees_the_folder_missing(tmp_path):
    live, staged = tmp_path / "model", tmp_path / "staged"
    live.mkdir(), staged.mkdir()
    (live / "config.pbtxt").write_text("1")
    (staged / "config.pbtxt").write_text("2")
    seen, stop = set(), threading.Event()

    def poll():
        while not stop.is_set():
            try:
                seen.add((live / "config.pbtxt").read_text())
            except FileNotFoundError:
                seen.add("missing")

    reader = threading.Thread(target=poll)
    reader.start()
    for _ in range(500):
        exchange(live, staged)
    stop.set()
    reader.join()
    assert "missing" not in seen and seen <= {"1", "2"}
