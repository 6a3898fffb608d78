"""Peak resident memory of this process over a block.

The kernel's high-water mark (``ru_maxrss``) is exact but process-wide and
monotonic: when it rises inside the block, it is the block's peak. When it
does not, the block stayed below an earlier peak, and a sampling thread gives
the block's own maximum.
"""
from __future__ import annotations

import resource
import threading

import psutil


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
