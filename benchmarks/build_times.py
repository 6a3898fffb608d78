"""Cold build, then warm no-change rebuild, of one recipe, side by side.

Prints each stage's wall time (s) and peak RSS (MiB) from the cold run's
manifest, the whole-process wall time and peak RSS of both runs, and their
ratio. Each run is a fresh `python -m pipeline build` process with its own
empty work and output folders, so nothing is shared with earlier builds.

    .venv/bin/python benchmarks/build_times.py --recipe recipes/fp8-llm.yaml
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(recipe: str, ws: Path) -> tuple[float, int, dict]:
    cmd = [sys.executable, "-m", "pipeline", "build", recipe, "--quiet",
           "--set", f"work_dir={ws / 'artifacts'}", "--set", f"output_dir={ws / 'model_repository'}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode not in (0, 1):
        sys.exit(f"build failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    name = Path(recipe).stem
    man = json.loads((ws / "artifacts" / name / "manifest.json").read_text())
    # ru_maxrss of children is the max over all children so far: report it only when it grew.
    return wall, max(peak_kib, before) // 1024 if peak_kib > before else -1, man


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/fp8-llm.yaml")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trtpipe-bench-") as tmp:
        ws = Path(tmp)
        cold_wall, cold_rss, man = build(args.recipe, ws)
        warm_wall, warm_rss, warm = build(args.recipe, ws)
    print(f"{'stage':<10} {'status':<8} {'wall (s)':>9} {'peak RSS (MiB)':>15}")
    for name, st in man["stages"].items():
        print(f"{name:<10} {st['status']:<8} {st['wall_s']:>9.1f} {str(st.get('peak_rss_mib')):>15}")
    hits = sum(bool(s.get("cache_hit")) for s in warm["stages"].values())
    print(f"\ncold build: {cold_wall:7.1f} s wall, peak RSS {cold_rss} MiB (whole process)")
    print(f"warm build: {warm_wall:7.1f} s wall, {hits}/{len(warm['stages'])} stages from cache")
    print(f"cold / warm wall ratio: {cold_wall / warm_wall:.1f}x")
    print(f"targets: cold < 480 s -> {'met' if cold_wall < 480 else 'MISSED'}; "
          f"peak RSS < 6144 MiB -> {'met' if 0 < cold_rss < 6144 else 'MISSED'}; "
          f"warm < 5 s -> {'met' if warm_wall < 5 else 'MISSED'}")


if __name__ == "__main__":
    main()
