from __future__ import annotations

import gc
import mmap
import weakref

import numpy as np
import psutil

from pipeline import memory
from pipeline.memory import PeakRSS


def test_peak_includes_memory_held_in_the_block():
    gc.collect()  # earlier tests' garbage must not be freed mid-measurement
    size = 64 * 2**20
    with PeakRSS() as m:
        before = psutil.Process().memory_info().rss
        block = mmap.mmap(-1, size)  # fresh anonymous pages, whatever malloc is in use
        np.frombuffer(block, np.uint8)[::4096] = 1  # touch every page
    block.close()
    assert m.peak_bytes >= before + 60 * 2**20


def test_a_rising_kernel_high_water_mark_is_the_blocks_peak(monkeypatch):
    """ru_maxrss is exact but process-wide (and inherited across fork/exec), so it
    counts only when it rises inside the block; the sampler covers the rest."""
    marks = iter([1 * 2**30, 5 * 2**30])  # at enter, at exit
    monkeypatch.setattr(memory, "_hwm_bytes", lambda: next(marks))
    with PeakRSS(interval_s=60) as m:  # the sampler never wakes
        pass
    assert m.peak_bytes == 5 * 2**30


def test_a_flat_high_water_mark_leaves_the_sampled_peak(monkeypatch):
    monkeypatch.setattr(memory, "_hwm_bytes", lambda: 50 * 2**30)
    with PeakRSS() as m:
        pass
    assert 0 < m.peak_bytes < 50 * 2**30  # the flat (inherited) mark is not taken as this block's peak


class _Cycle:
    def __init__(self):
        self.me = self


def test_stage_survivors_are_frozen_in_the_block_and_thawed_after():
    """release_freed inside frozen_between_stages collects cycles made before it, freezes the
    survivors (a later collection skips them), and the block's end thaws them for the collector."""
    gc.collect()
    assert gc.get_freeze_count() == 0
    garbage, kept = weakref.ref(_Cycle()), _Cycle()
    survivor = weakref.ref(kept)
    with memory.frozen_between_stages():
        memory.release_freed()
        assert garbage() is None and gc.get_freeze_count() > 0
        del kept  # now garbage too, but frozen
        gc.collect()
        assert survivor() is not None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert survivor() is None


def _frozen(obj) -> bool:
    """``obj`` is in the permanent generation: gc.get_objects() lists the three others only."""
    return not any(o is obj for o in gc.get_objects())


def test_a_caller_that_froze_objects_is_left_as_it_was():
    """Neither thawed nor frozen further. (Not gc.get_freeze_count(): frozen objects another thread
    frees by refcount leave the permanent generation, so the count may drop meanwhile.)"""
    before = _Cycle()
    gc.freeze()
    try:
        after = _Cycle()
        assert _frozen(before) and not _frozen(after)
        with memory.frozen_between_stages():
            memory.release_freed()
        assert _frozen(before) and not _frozen(after)
    finally:
        gc.unfreeze()
