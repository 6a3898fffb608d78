"""Summaries of a load run: percentiles, TTFT / TPOT / goodput, batch statistics.

Percentiles are numpy's default (linear interpolation between closest ranks,
Hyndman & Fan 1996 definition 7). Goodput is the rate of requests that meet
every SLO bound (Zhong et al. 2024, "DistServe", Sec. 2; vLLM's
benchmark_serving ``--goodput``): here TTFT <= ``slo.ttft_ms`` and TPOT <=
``slo.tpot_ms`` for LLMs, latency <= ``slo.latency_ms`` otherwise.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from pipeline.recipe.schema import ServeSLO
from pipeline.serve.client import Generation

QUANTILES = (50, 90, 99)


def percentiles(values: Sequence[float], quantiles: Sequence[int] = QUANTILES) -> dict[str, float]:
    """``{"p50": ..., "p90": ..., "p99": ...}`` of ``values`` (NaN where there are none)."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {f"p{q}": float("nan") for q in quantiles}
    return {f"p{q}": float(np.percentile(finite, q)) for q in quantiles}


def llm_level(gens: Sequence[Generation], duration_s: float, slo: ServeSLO) -> dict:
    """One concurrency level of streamed generations.

    Returns TTFT and TPOT percentiles (ms; TPOT per request, see
    :attr:`Generation.tpot_ms`), inter-token latency percentiles over all gaps
    (ms), ``output_tokens_per_s``, ``requests_per_s``, ``goodput_rps`` and
    ``slo_met`` (fraction of requests meeting both bounds). ``duration_s``:
    first send to last token of the level.
    """
    met = [g.ttft_ms <= slo.ttft_ms and (len(g.times) < 2 or g.tpot_ms <= slo.tpot_ms) for g in gens]
    tokens = sum(len(g.tokens) for g in gens)
    return {
        "requests": len(gens),
        "duration_s": duration_s,
        "ttft_ms": percentiles([g.ttft_ms for g in gens]),
        "tpot_ms": percentiles([g.tpot_ms for g in gens]),
        "itl_ms": percentiles([gap for g in gens for gap in g.gaps_ms]),
        "output_tokens_per_s": tokens / duration_s,
        "requests_per_s": len(gens) / duration_s,
        "goodput_rps": sum(met) / duration_s,
        "slo_met": sum(met) / len(gens),
    }


def latency_level(latencies_ms: Sequence[float], duration_s: float, slo_ms: float) -> dict:
    """One concurrency level of single inferences: latency percentiles (ms),
    ``inferences_per_s``, ``goodput_rps`` (latency <= ``slo_ms``) and ``slo_met``."""
    met = sum(1 for v in latencies_ms if v <= slo_ms)
    return {
        "requests": len(latencies_ms),
        "duration_s": duration_s,
        "latency_ms": percentiles(latencies_ms),
        "inferences_per_s": len(latencies_ms) / duration_s,
        "goodput_rps": met / duration_s,
        "slo_met": met / len(latencies_ms),
    }


def tpot_at(gaps_ms: Sequence[float], position: int, half_window: int = 4) -> float:
    """TPOT at an output position, ms: the median inter-token gap of output
    positions ``position - half_window`` .. ``position + half_window - 1``
    (position k's gap: token k's arrival minus token k - 1's; ``gaps_ms[k - 1]``).

    Raises:
        ValueError: the generation is too short for the window.
    """
    first, last = position - half_window, position + half_window - 1
    if first < 1 or last > len(gaps_ms):
        raise ValueError(f"TPOT at position {position} needs tokens 0..{last}; the generation has {len(gaps_ms) + 1}")
    return float(np.median(gaps_ms[first - 1 : last]))


def tpot_by_position(gens: Sequence[Generation], positions: Sequence[int]) -> dict:
    """TPOT at each output position, ms, over several long requests: per request
    :func:`tpot_at`, then the median over requests; ``ratio`` = last position's TPOT
    over the first's (medians), ``ratio_range`` the per-request ratios' min and max.

    Raises:
        ValueError: a generation is too short for a position's window.
    """
    first, last = str(positions[0]), str(positions[-1])
    rows = []
    for g in gens:
        tpot = {str(p): tpot_at(g.gaps_ms, p) for p in positions}
        rows.append({"tokens": len(g.tokens), "ttft_ms": g.ttft_ms, "tpot_ms": tpot,
                     "ratio": ratio(tpot[last], tpot[first]), "gaps_ms": [round(x, 2) for x in g.gaps_ms]})
    median = {str(p): float(np.median([r["tpot_ms"][str(p)] for r in rows])) for p in positions}
    ratios = [r["ratio"] for r in rows]
    return {"requests": rows, "tokens": min(r["tokens"] for r in rows), "tpot_ms": median,
            "ratio": ratio(median[last], median[first]), "ratio_range": [min(ratios), max(ratios)]}


def stats_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two :func:`pipeline.serve.client.model_statistics` readings."""
    out = {k: after[k] - before[k] for k in ("inference_count", "execution_count", "compute_infer_ns", "queue_ns")}
    sizes = sorted(set(after["batches"]) | set(before["batches"]))
    batches = {s: after["batches"].get(s, 0) - before["batches"].get(s, 0) for s in sizes}
    out["batches"] = {s: n for s, n in batches.items() if n}
    return out


def batch_summary(delta: dict, wall_s: float) -> dict:
    """Executed batch sizes of a :func:`stats_delta`, and how they show batching and instances.

    ``mean_batch`` = inferences / executions (1.0: no request shared an execution).
    ``busy_instances`` = summed execution compute time / wall time (Little's law, Little 1961:
    the mean number of executions running at once; above 1 only when more than
    one instance computes concurrently).
    """
    executions = delta["execution_count"]
    return {
        "executions_by_batch_size": {str(k): v for k, v in sorted(delta["batches"].items())},
        "executions": executions,
        "inferences": delta["inference_count"],
        "mean_batch": delta["inference_count"] / executions if executions else float("nan"),
        "busy_instances": delta["compute_infer_ns"] / 1e9 / wall_s if wall_s > 0 else float("nan"),
    }


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")
