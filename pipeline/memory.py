"""Peak resident memory of this process over a block.

The kernel's high-water mark (``ru_maxrss``) is exact but process-wide and
monotonic: when it rises inside the block, it is the block's peak. When it
does not, the block stayed below an earlier peak, and a sampling thread gives
the block's own maximum.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import gc
import resource
import threading
from collections.abc import Iterator

import psutil

from pipeline.errors import MemoryFault, causes

#: what an allocation failure says inside an exception that is not a MemoryError
#: (ONNX Runtime's C++ ``std::bad_alloc`` / arena, torch's CPU allocator)
OOM_MESSAGES = ("bad_alloc", "Failed to allocate memory", "can't allocate memory", "not enough memory",
                "out of memory", "OutOfMemory", "Memory allocation failed")
#: what holds memory in each stage, as the advice of a :class:`MemoryFault`
STAGE_HINTS = {
    "export": "export holds the FP32 weights and torch's exporter state",
    "quantize": "quantize holds the calibration statistics and the accuracy-budget search's sessions; "
                "lower quantize.calibration / tuning batches, or pin a tuning result (make tune) elsewhere",
    "validate": "validate holds the FP32 and the candidate sessions together; lower the eval split",
}


class PeakRSS:
    """``with PeakRSS() as m: ...`` then ``m.peak_mib`` (MiB, sampled every 20 ms)."""

    def __init__(self, interval_s: float = 0.02):
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._proc = psutil.Process()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakRSS":
        self._hwm_before = _hwm_bytes()
        self.peak_bytes = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)
        hwm = _hwm_bytes()
        if hwm > self._hwm_before:
            self.peak_bytes = max(self.peak_bytes, hwm)

    @property
    def peak_mib(self) -> float:
        return round(self.peak_bytes / 2**20, 1)


def _hwm_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def release_freed() -> None:
    """Hand memory that Python and the native libraries have freed back to the OS (glibc's
    ``malloc_trim``; a no-op elsewhere). The stages run in one process: without this, the pages
    a stage freed (export's torch activations, a search's sessions) stay resident and count in
    every later stage's peak. Inside :func:`frozen_between_stages` the survivors of the
    collection are then frozen (``gc.freeze``), so the next call scans only what was made since."""
    gc.collect()
    if _freezing:
        gc.freeze()
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, loaded once (a ``dlopen`` takes ~0.08 s in a process holding torch); None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc
        return None


_freezing = False


@contextlib.contextmanager
def frozen_between_stages() -> Iterator[None]:
    """Let :func:`release_freed` freeze what survives each stage, and thaw it all (``gc.unfreeze``)
    when the block ends, so nothing stays out of the collector's reach after a run.

    Why: once torch's exporter is imported a process holds ~600 k tracked objects, and a full
    collection costs ~0.35 s (measured on a 2-core Xeon); a run collects after every stage. A
    caller that froze objects itself (``gc.get_freeze_count() > 0``) is left as it is: no freezing."""
    global _freezing
    if _freezing or gc.get_freeze_count():
        yield
        return
    try:
        _freezing = True
        yield
    finally:
        gc.unfreeze()  # first: a signal handled between the two lines leaves nothing frozen
        _freezing = False


def out_of_memory(exc: BaseException | None) -> BaseException | None:
    """The allocation failure in ``exc`` or its ``__cause__`` / ``__context__`` chain: a
    ``MemoryError``, an ``OSError`` with ``ENOMEM``, or an exception whose message holds one of
    :data:`OOM_MESSAGES` (CPU and CUDA allocators of ONNX Runtime, torch and TensorRT); else
    None. A ``raise ... from None`` ends the chain."""
    return next((e for e in causes(exc, past_from_none=False) if _is_oom(e)), None)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True
    return not isinstance(exc, MemoryFault) and any(m in str(exc) for m in OOM_MESSAGES)


def memory_fault(exc: BaseException, stage: str | None = None, peak_mib: float | None = None) -> MemoryFault | None:
    """A :class:`MemoryFault` (exit 4) for an allocation failure in ``exc`` (:func:`out_of_memory`),
    naming ``stage``, its peak resident memory (MiB) and this machine's total and available
    memory (``psutil.virtual_memory``), with what the stage holds; None for any other error."""
    cause = out_of_memory(exc)
    if cause is None:
        return None
    vm = psutil.virtual_memory()
    first = (str(cause).splitlines() or [""])[0][:200]
    where = f"stage {stage}" if stage else "the run"
    peak = f"; peak resident memory {peak_mib:,.0f} MiB" if peak_mib else ""
    hint = STAGE_HINTS.get(stage or "", "")
    return MemoryFault(f"{where}: out of memory ({type(cause).__name__}: {first}){peak}; this machine has "
                       f"{vm.total / 2**30:.1f} GiB, {vm.available / 2**30:.1f} GiB available now. "
                       + (f"{hint[0].upper()}{hint[1:]}. " if hint else "")
                       + "Free memory (other jobs), or run on a machine with more")
