"""Where one stage's memory goes: a timeline of this process's RSS, each sample
attributed to the pipeline function running then.

Runs the recipe's stages through ``--stage`` in this process (earlier stages
from the stage cache of ``--workspace``) while a thread samples the resident
set every 0.2 s together with the main thread's innermost frames in
``pipeline/`` and in the libraries it calls (torch.onnx, onnx, onnxruntime,
transformers). Prints, per phase (in order of first appearance), its peak
RSS and the RSS when it ended, against the FP32 weight bytes.

    .venv/bin/python benchmarks/stage_memory.py --recipe recipes/fp8-llm.yaml --stage export
    .venv/bin/python benchmarks/stage_memory.py --stage quantize --tune   # the accuracy-budget search
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
from pathlib import Path

import psutil

_LIBS = ("torch/onnx", "onnxscript", "onnx/", "onnxruntime", "transformers", "gguf")


def _phase(frame) -> str:
    """``pipeline.function > library module`` of the innermost frames of a stack."""
    ours, lib = "", ""
    while frame is not None:
        path = frame.f_code.co_filename
        if not ours and "/pipeline/" in path:
            ours = f"{path.rsplit('/pipeline/', 1)[1][:-3].replace('/', '.')}.{frame.f_code.co_name}"
        if not lib and not ours and any(k in path for k in _LIBS):
            lib = next(k for k in _LIBS if k in path).strip("/")
        frame = frame.f_back
    return f"{ours} > {lib}" if lib else ours or "(outside pipeline)"


class Timeline:
    """Sample (phase, RSS bytes) of the main thread every ``interval_s``."""

    def __init__(self, interval_s: float = 0.2):
        self.samples: list[tuple[str, int]] = []
        self._stop, self._interval = threading.Event(), interval_s
        self._main, self._proc = threading.main_thread().ident, psutil.Process()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            frame = sys._current_frames().get(self._main)
            self.samples.append((_phase(frame), self._proc.memory_info().rss))

    def __enter__(self) -> "Timeline":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def phases(self) -> list[tuple[str, int, int, float]]:
        """(phase, peak RSS, RSS at its last sample, seconds) in order of first appearance."""
        out: dict[str, list] = {}
        for name, rss in self.samples:
            row = out.setdefault(name, [0, 0, 0])
            row[0], row[1], row[2] = max(row[0], rss), rss, row[2] + self._interval
        return [(k, *v) for k, v in out.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/fp8-llm.yaml")
    ap.add_argument("--stage", default="export")
    ap.add_argument("--workspace", type=Path, help="work folder (earlier stages cached there); default: a new one")
    ap.add_argument("--min-mib", type=float, default=50, help="hide phases whose peak is below this")
    ap.add_argument("--tune", action="store_true",
                    help="--stage quantize: calibrate and search anew, ignoring a pinned result (make tune)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pipeline.onnx_io import files_on_disk_bytes
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline, run_tune

    with tempfile.TemporaryDirectory(prefix="trtpipe-stage-mem-") as tmp:
        ws = args.workspace or Path(tmp)
        recipe = load_recipe(Path(args.recipe), {"work_dir": str(ws / "artifacts"),
                                                 "output_dir": str(ws / "model_repository")})
        start = psutil.Process().memory_info().rss
        with Timeline() as tl:
            if args.tune:
                run_tune(recipe, Path(args.recipe), quiet=True)
            arts = run_pipeline(recipe, Path(args.recipe), quiet=True, only=[args.stage]).artifacts
        weights = files_on_disk_bytes(arts["export"].onnx_path)
    gib = 2**30
    print(f"{args.stage} of {recipe.name}: FP32 weights {weights / gib:.2f} GiB; RSS at start (imports) "
          f"{start / gib:.2f} GiB; peak {max(r for _, r in tl.samples) / gib:.2f} GiB")
    print(f"{'phase (pipeline function > library)':<72} {'s':>6} {'peak GiB':>9} {'end GiB':>8} {'peak/w':>7}")
    for name, peak, end, secs in tl.phases():
        if peak >= args.min_mib * 2**20:
            print(f"{name[:72]:<72} {secs:>6.1f} {peak / gib:>9.2f} {end / gib:>8.2f} {peak / weights:>6.1f}x")


if __name__ == "__main__":
    main()
