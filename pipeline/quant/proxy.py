"""A cheap per-GEMM sensitivity proxy for the accuracy-budget search.

Measuring each GEMM alone costs a forward pass per GEMM (fp8-llm: 210), and on a small tuning
split the single-GEMM gains sit below the trial-to-trial spread: on fp8-llm (4 windows of 128
tokens) single reverted MLP GEMMs summed to -0.010 nats of KL per projection while reverting the
whole projection gained +0.010, so a ranking on them is mostly noise.

The proxy instead ranks with two coarse passes whose signals stand above that spread: one trial
per projection kind (``per_projection``: ``down_proj`` of every block together) and one per
block (``per_block``: every GEMM of ``layers.29``). A GEMM of projection ``p`` in block ``b`` gets
the rank-1 share

    gain(p, b) = max(g_p, 0) * max(g_b, 0) / sum_b' max(g_b', 0)

(``g`` the measured gain of reverting that group: the KL it removes), so that a projection's
GEMMs share its gain in proportion to their blocks' gains. GEMMs outside numbered blocks keep
their own group's gain. Measured against single-GEMM trials on fp8-llm (90 MLP GEMMs, 4 windows):
Spearman 0.37 for this share, -0.07 for each GEMM's local output error (why that is not used).
"""
from __future__ import annotations

from pipeline.quant import qdq
from pipeline.quant import sensitivity as S


def predicted_gain(targets: list[qdq.Target], proj_gain: dict[str, float],
                   block_gain: dict[str, float]) -> dict[str, float]:
    """Per-GEMM share of the module docstring, keyed by module scope (``per_gemm`` group name).

    Args:
        targets: the quantizable GEMMs.
        proj_gain: ``per_projection`` group -> gain (metric units, e.g. nats of KL).
        block_gain: ``per_block`` group -> gain, same units.

    Returns:
        scope -> predicted gain (>= 0), summed over GEMMs sharing a scope.
    """
    total = sum(max(v, 0.0) for g, v in block_gain.items()) or 1.0
    out: dict[str, float] = {}
    for t in targets:
        p, b = S.group_of(t, "per_projection"), S.group_of(t, "per_block")
        scope = S.group_of(t, "per_gemm")
        in_block = b != scope
        gain = max(proj_gain.get(p, 0.0), 0.0) * (max(block_gain.get(b, 0.0), 0.0) / total if in_block else 1.0)
        out[scope] = out.get(scope, 0.0) + gain
    return out
