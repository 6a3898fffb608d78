from __future__ import annotations

import subprocess
import sys

import numpy as np

from pipeline.memory import PeakRSS


def test_peak_includes_memory_held_in_the_block():
    with PeakRSS() as base:
        pass
    with PeakRSS() as m:
        block = np.ones(64 * 2**20 // 8)  # 64 MiB, touched
    del block
    assert m.peak_mib >= base.peak_mib + 60


def test_peak_catches_a_short_lived_allocation_through_the_kernel_high_water_mark():
    # A fresh process, so the block's allocation raises the process high-water mark.
    code = (
        "import numpy as np\n"
        "from pipeline.memory import PeakRSS\n"
        "with PeakRSS() as base: pass\n"
        "with PeakRSS(interval_s=60) as m:\n"  # the sampler never wakes: only ru_maxrss can see it
        "    b = np.ones(256 * 2**20 // 8); del b\n"
        "print(m.peak_mib - base.peak_mib)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) >= 250
