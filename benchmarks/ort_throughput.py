"""Prefill and decode-step throughput of a reference graph and a quantized graph, side
by side in one run, in ONNX Runtime at the level each is served at
(:func:`pipeline.ort_sessions.optimization_level`: FP8 Q/DQ and full-range INT8 at
``basic``, everything else at ``all``).

Each shape runs the two graphs interleaved (reference, candidate, reference, ...)
after warm-up; the figure is the median of ``--runs``. Throughput = tokens / median
wall time (prefill: batch x sequence tokens; decode step: batch tokens, one new token
each over a past of ``--past``). Graphs without KV-cache inputs (encoders) get the
prefill shape only, with int64 inputs of ones (token ids of 1).

``--self-check`` times the reference against itself: the spread of that ratio is the
timing noise that ``pipeline.metrics.speed.SPEEDUP_MARGIN`` has to cover.
``--both-levels`` times the candidate at ``basic`` and at ``all`` (each against the
reference), whatever level it is served at: for INT8, the simulated and the integer-kernel
speed side by side. A full-range INT8 graph at ``all`` can give wrong numbers on a CPU
without VNNI (docs/quantization.md); its timing still shows what the kernels cost.

CPU numbers only: FP8 Q/DQ is simulated on CPU (quantize, dequantize, FP32 GEMM), so
its CPU speed says nothing about FP8 speed on a GPU.

    .venv/bin/python benchmarks/ort_throughput.py REF.onnx CAND.onnx [--batch 1] [--seq 64]
        [--past 64] [--runs 5] [--self-check] [--both-levels] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.metrics.speed import time_pair  # noqa: E402
from pipeline.onnx_io import graph_specs  # noqa: E402
from pipeline.ort_sessions import optimization_level, ort_session  # noqa: E402


def shapes(path: Path, batch: int, seq: int, past: int) -> dict[str, dict[str, np.ndarray]]:
    """Feeds per timed shape: ``prefill`` and, for a graph with a KV cache, ``decode_step``."""
    from pipeline.models.text_generation.kv import layout_from_specs
    from pipeline.models.text_generation.model import sample_feeds

    inputs, outputs = graph_specs(onnx.load(str(path), load_external_data=False))
    if any(s.name.startswith("past_key_values") for s in inputs):
        layout = layout_from_specs(inputs, outputs)
        return {"prefill": sample_feeds(layout, batch, seq, 0), "decode_step": sample_feeds(layout, batch, 1, past)}
    return {"prefill": {s.name: np.ones((batch, seq), np.int64) for s in inputs}}


def measure(ref_path: Path, cand_path: Path, batch: int, seq: int, past: int, runs: int,
            cand_level: str | None = None) -> dict:
    """Median ms and tokens/s per shape for both graphs (see the module docstring); the
    candidate at ``cand_level`` (None: the level it is served at)."""
    ref, cand = ort_session(str(ref_path)), ort_session(str(cand_path), cand_level)
    out: dict = {"reference": str(ref_path), "candidate": str(cand_path), "runs": runs,
                 "level_reference": optimization_level(ref_path),
                 "level_candidate": cand_level or optimization_level(cand_path)}
    first = [ref.get_outputs()[0].name]
    for name, feeds in shapes(ref_path, batch, seq, past).items():
        tokens = batch * (seq if name == "prefill" else 1)
        r, c = time_pair(lambda f=feeds: ref.run(first, f), lambda f=feeds: cand.run(first, f), runs, warmup=1)
        rm, cm = statistics.median(r), statistics.median(c)
        out[name] = {"tokens": tokens, "reference_ms": rm, "candidate_ms": cm,
                     "reference_tokens_per_s": tokens / rm * 1e3, "candidate_tokens_per_s": tokens / cm * 1e3,
                     "speedup": rm / cm, "reference_runs_ms": r, "candidate_runs_ms": c}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference", type=Path, help="FP32 ONNX graph (export/model.onnx)")
    ap.add_argument("candidate", type=Path, help="quantized ONNX graph (quantize/model.onnx)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64, help="prefill tokens per row (default 64)")
    ap.add_argument("--past", type=int, default=64, help="KV-cache length of the decode step (default 64)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per graph and shape (default 5)")
    ap.add_argument("--self-check", action="store_true", help="also time the reference against itself")
    ap.add_argument("--both-levels", action="store_true", help="time the candidate at basic and at all")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = ap.parse_args()
    levels = ["basic", "all"] if args.both_levels else [None]
    results = [measure(args.reference, args.candidate, args.batch, args.seq, args.past, args.runs, level)
               for level in levels]
    if args.self_check:
        results[0]["self_check"] = measure(args.reference, args.reference, args.batch, args.seq, args.past, args.runs)
    for result in results:
        report(result, args)
    print("CPU numbers: FP8 Q/DQ is simulated on CPU; they say nothing about GPU speed.")
    if args.json:
        args.json.write_text(json.dumps(results if args.both_levels else results[0], indent=2, allow_nan=False) + "\n")


def report(result: dict, args: argparse.Namespace) -> None:
    """Print one :func:`measure` result, a line per shape."""
    print(f"levels: reference {result['level_reference']}, candidate {result['level_candidate']}; "
          f"median of {args.runs} interleaved runs, batch {args.batch}")
    for name in ("prefill", "decode_step"):
        if name in result:
            m = result[name]
            print(f"{name:12s} ({m['tokens']} tokens): reference {m['reference_ms']:8.2f} ms "
                  f"{m['reference_tokens_per_s']:9.1f} tok/s | candidate {m['candidate_ms']:8.2f} ms "
                  f"{m['candidate_tokens_per_s']:9.1f} tok/s | speedup {m['speedup']:.3f}")
            if "self_check" in result:
                print(f"{'':12s} self-check (reference vs itself): ratio {result['self_check'][name]['speedup']:.3f}")


if __name__ == "__main__":
    main()
