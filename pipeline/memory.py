"""Peak resident memory of this process over a block, sampled in a thread."""
from __future__ import annotations

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
        self.peak_bytes = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._proc.memory_info().rss)

    @property
    def peak_mib(self) -> float:
        return round(self.peak_bytes / 2**20, 1)
