"""Timing of the FP32 reference against the candidate graph, as ONNX Runtime runs them
at the level each is served at (:func:`pipeline.ort_sessions.optimization_level`).

Metrics (``validate/metrics.json``): ``speedup_vs_fp32`` = median FP32 latency /
median candidate latency at one shape (> 1: the candidate is faster); ``speedup_vs_fp32_spread``
(``[min, max]`` of the per-run paired ratios); ``decode_``-prefixed twins for a second shape (text
generation: one decode step, :func:`pipeline.models.text_generation.metrics.llm_decode_speedup`);
``latency_fp32_ms``, ``latency_candidate_ms`` (medians, ms), ``speed_shape``,
``speed_runs``, ``speedup_vs_fp32_margin``, ``speed_level`` (the candidate's ORT level),
``speed_cpu_flags`` (:func:`pipeline.provenance.cpu_flags`: VNNI decides INT8 speed) and ``speed_note``.

Noise margin (gate ``{metric: speedup_vs_fp32, min: 1.0}``, "keep only if faster",
for CPU targets): the gate should pass at ``speedup_vs_fp32 >= min - SPEEDUP_MARGIN``.
:data:`SPEEDUP_MARGIN` = 0.10. Timing one graph against itself
(``benchmarks/ort_throughput.py --self-check``, 5 interleaved runs, medians, SmolLM2-135M
on 2 CPU cores shared with other jobs) gave ratios of 1.016 (prefill 64 tokens) and
1.008 (decode step); other jobs starting mid-run move single medians by several percent
more. 10 % keeps a graph as fast as FP32 from failing on that noise, while a graph 30 %
slower (MiniLM INT8 at the basic level) still fails. The metric stays the measured
ratio; the margin belongs to the gate check (:func:`pipeline.recipe.gates.evaluate` passes a
``min`` gate on ``speedup_vs_fp32`` at ``>= min - SPEEDUP_MARGIN`` and reports that bound),
so a recipe writes ``min: 1.0`` for "keep only if faster, beyond noise".

Runs are interleaved (reference, candidate, reference, ...) after warm-up runs, so a
change of machine load during the measurement hits both graphs alike.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pipeline.recipe.gates import SPEEDUP_MARGIN  # noqa: F401  (the gate's margin; its measurement is above)
from pipeline.provenance import INT8_DOT_FLAGS, cpu_flags
from pipeline.recipe.precisions import PRECISIONS


def speed_note(precision: str, level: str, providers: list[str] | None = None,
               flags: list[str] | None = None) -> str:
    """One sentence on what the timing means (written as ``speed_note``)."""
    where = ", ".join(providers or ["CPUExecutionProvider"])
    base = f"ONNX Runtime {where}, candidate at graph optimization level '{level}'"
    gate = (f" A speedup_vs_fp32 gate with min m passes at >= m - {SPEEDUP_MARGIN:g} (timing noise margin).")
    if PRECISIONS[precision].cpu_simulated:
        return (f"{base}: {PRECISIONS[precision].cpu_simulation}, so these CPU numbers say nothing about "
                f"{precision.upper()} speed on a GPU (TensorRT); they apply to CPU targets only." + gate)
    int8 = int8_note(level, flags) if PRECISIONS[precision].integer else ""
    return (f"{base}: CPU timing, it applies to CPU targets; GPU speed is measured only through a TensorRT "
            f"engine.{int8}" + gate)


def int8_note(level: str, flags: list[str] | None = None) -> str:
    """What decides INT8 speed on this CPU, and the faster option where there is one (a
    sentence with a leading space). ``flags``: :func:`pipeline.provenance.cpu_flags`."""
    flags = cpu_flags() if flags is None else flags
    dot = [f for f in flags if f in INT8_DOT_FLAGS]
    if level == "basic":
        text = (" INT8 with full-range weights runs at level 'basic': quantize, dequantize and an FP32 GEMM, exact on "
                "every CPU and slower than FP32. Faster on CPU: quantize.reduce_range: true (7-bit weights, which ONNX "
                "Runtime's integer GEMMs at level 'all' compute exactly on every x86 CPU).")
    else:
        text = " INT8 GEMMs run in ONNX Runtime's integer kernels (level 'all')."
    if dot:
        return text + f" This CPU has {', '.join(dot)} (8-bit dot products into int32)."
    return (text + f" This CPU has none of {', '.join(INT8_DOT_FLAGS)}: its integer kernels multiply in int16 pairs, "
            "so INT8 may be no faster than FP32 here; for CPU speed keep precision fp32 there, or serve on a CPU with "
            "VNNI.")


def time_pair(run_ref: Callable[[], object], run_cand: Callable[[], object], runs: int = 5,
              warmup: int = 1) -> tuple[list[float], list[float]]:
    """Wall times (ms) of ``runs`` interleaved calls of each function, after ``warmup`` each.

    Raises:
        ValueError: ``runs`` < 1 or ``warmup`` < 0.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"time_pair: runs={runs} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        run_ref()
        run_cand()
    ref: list[float] = []
    cand: list[float] = []
    for _ in range(runs):
        for fn, out in ((run_ref, ref), (run_cand, cand)):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return ref, cand


def speedup_metrics(run_ref: Callable[[], object], run_cand: Callable[[], object], *, shape: str,
                    precision: str, level: str, providers: list[str] | None = None, runs: int = 5,
                    warmup: int = 1, prefix: str = "") -> dict:
    """``speedup_vs_fp32`` and its context (see the module docstring) from :func:`time_pair`, and
    ``speedup_vs_fp32_spread``: ``[min, max]`` of the per-run ratios (FP32 run i / candidate run i,
    each pair timed back to back), the spread the median comes from.

    Args:
        run_ref, run_cand: one inference each at the same feeds.
        shape: the timed shape, in words (e.g. ``"prefill batch 1 x 256 tokens"``).
        precision: the candidate's precision; level: its ORT optimization level.
        prefix: a second timing's key prefix (e.g. ``"decode_"``): then only ``<prefix>speedup_vs_fp32``,
            its spread, the two latencies, ``<prefix>speed_shape`` and ``<prefix>speed_runs`` are
            returned (the level, CPU flags and note are the first timing's).
    """
    ref, cand = time_pair(run_ref, run_cand, runs, warmup)
    ref_ms, cand_ms = statistics.median(ref), statistics.median(cand)
    ratios = [r / c for r, c in zip(ref, cand)]
    out = {f"{prefix}speedup_vs_fp32": ref_ms / cand_ms, f"{prefix}speedup_vs_fp32_spread": [min(ratios), max(ratios)],
           f"{prefix}latency_fp32_ms": ref_ms, f"{prefix}latency_candidate_ms": cand_ms,
           f"{prefix}speed_shape": shape, f"{prefix}speed_runs": runs}
    if prefix:
        return out
    return {**out, "speedup_vs_fp32_margin": SPEEDUP_MARGIN, "speed_level": level, "speed_cpu_flags": cpu_flags(),
            "speed_note": speed_note(precision, level, providers)}


def timed_view(runner, view):
    """What the speed line times for ``runner``: ``view`` (its session view), or for a candidate whose
    weights validate dequantizes once (:class:`pipeline.runners.weights_fed.WeightsFed`) a session of the
    graph as written, as Triton's ONNX Runtime backend runs it (dequantizing at every run): the
    slower of the served paths, so a speed gate never passes on a path the default target skips."""
    from pipeline.runners.weights_fed import WeightsFed

    session = getattr(runner, "session", None)
    return session.as_written() if isinstance(session, WeightsFed) else view


def session_level(runner) -> tuple[str, list[str]] | None:
    """(ORT optimization level name, providers) of a runner holding a real
    ``onnxruntime.InferenceSession`` (:class:`pipeline.runners.base.OrtRunner`; its weights possibly
    dequantized once, :class:`pipeline.runners.weights_fed.WeightsFed`); None otherwise."""
    import onnxruntime as ort

    from pipeline.ort_sessions import ORT_LEVELS
    from pipeline.runners.weights_fed import WeightsFed

    session = getattr(runner, "session", None)
    if not isinstance(session, (ort.InferenceSession, WeightsFed)):
        return None
    level = session.get_session_options().graph_optimization_level
    names = [k for k, v in ORT_LEVELS.items() if v == level]
    return (names[0] if names else str(level)), list(session.get_providers())
