"""Memory bandwidth of this machine: a numpy copy benchmark (the figure `pipeline plan`
divides the served weights by for its CPU decode roofline).

Each run copies a float64 array far larger than the last-level cache with
``np.copyto``; read + write bytes (2 x the array, the STREAM "copy" convention)
over the run's wall time is one GB/s sample (10^9 bytes/s); the median of the
runs is reported. The implementation is :func:`pipeline.plan.measure.copy_bandwidth`.

    .venv/bin/python benchmarks/memory_bandwidth.py [--size-mib 256] [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.plan.measure import copy_bandwidth  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=256, help="array size, MiB (default 256)")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs (default 7)")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    result = copy_bandwidth(args.size_mib, args.repeats)
    runs = ", ".join(f"{g:.2f}" for g in result["runs_gbs"])
    print(f"copy bandwidth: {result['median_gbs']:.2f} GB/s median of {args.repeats} runs "
          f"({args.size_mib} MiB array, read + write counted); runs: {runs}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
