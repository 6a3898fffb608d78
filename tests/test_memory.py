from __future__ import annotations

import numpy as np

from pipeline.memory import PeakRSS


def test_peak_covers_a_short_lived_allocation():
    with PeakRSS() as base:
        pass
    with PeakRSS() as m:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
        del block
    assert m.peak_mib >= base.peak_mib + 60
