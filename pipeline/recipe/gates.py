"""Accuracy gates: one type (:class:`pipeline.recipe.schema.Gate`), used by ``validate.gates``
and, later, ``quantize.accuracy_budget``.

A gate names a metric that its model kind writes to ``validate/metrics.json`` and
exactly one bound (``max`` or ``min``). This module knows which metrics each kind
produces (:func:`kind_metrics`), checks a gate list against them before any work
(:func:`problems`) and turns measured metrics into verdicts (:func:`evaluate`).

Uncertainty. Where a metric has a standard error σ (``<metric>_stderr`` in
``metrics.json``, :func:`stderr_metrics`; :mod:`pipeline.metrics.uncertainty`), each
verdict carries it, the margin in standard errors and a "within noise" flag (the value
is less than :data:`NOISE_SE` standard errors from the bound), with the eval size
that would resolve it (:func:`n_needed`). A gate's ``statistic`` chooses the test, as
TensorRT-LLM's accuracy tests do (threshold = bound ± z_α·σ, σ the standard error of
the mean, so it already holds the 1/√n; z_α = Φ⁻¹(confidence), one-sided):

* ``point`` (default): value against the bound; a value within noise can go either way
  on another eval set or CPU.
* ``evidence_of_regression``: fails only when the value is past the bound by more than
  z·σ (max: value > bound + z·σ; min: value < bound - z·σ). Errs toward passing: a
  model exactly at the bound fails with probability at most 1 - confidence, and a true
  regression smaller than about z·σ can pass. For CI that must not flake.
* ``evidence_of_meeting``: passes only when the value is inside the bound by more than
  z·σ (max: value <= bound - z·σ; min: value >= bound + z·σ). Errs toward failing: a
  model past the bound passes with probability at most 1 - confidence, and a model that
  truly meets it by less than about z·σ fails. For a release that must hold the bound.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.artifacts import GateResult
from pipeline.errors import InternalError, RecipeError
from pipeline.recipe import kinds
from pipeline.recipe.legacy import RENAMED_KINDS

if TYPE_CHECKING:
    from pipeline.recipe.schema import Gate

#: suffix of a metric's standard error in ``metrics.json`` (:mod:`pipeline.metrics.uncertainty`)
STDERR_SUFFIX = "_stderr"
#: ``metrics.json`` key of the per-metric records of what each standard error rests on
BASIS_KEY = "stderr_basis"

Loc = tuple[str | int, ...]

#: The unit of a gate metric's value, where it has one: the gate line prints it after the value;
#: a ``fraction`` also prints as a signed percentage (``+0.97 %``), as the README's table gives it.
UNITS: dict[str, str] = {"relative_perplexity_increase": "fraction",
                         **dict.fromkeys(("kld_mean", "kld_p50", "kld_p90", "kld_p99", "kld_p999", "kld_max"), "nats")}

#: a value closer to its bound than this many standard errors is "within noise"
NOISE_SE = 2.0

#: allowed shortfall of ``speedup_vs_fp32`` below a gate's ``min`` (timing noise), fraction;
#: how it was measured: :mod:`pipeline.metrics.speed`.
SPEEDUP_MARGIN = 0.10
#: gate metric -> allowed shortfall below a ``min`` bound (timing noise)
NOISE_MARGINS = {"speedup_vs_fp32": SPEEDUP_MARGIN, "decode_speedup_vs_fp32": SPEEDUP_MARGIN}

def kind_metrics(kind: str) -> frozenset[str]:
    """The metric names a gate may name for model kind ``kind`` (an old kind name reads its new
    name's row): :attr:`pipeline.recipe.kinds.KindFacts.gate_metrics`.

    Raises:
        KeyError: ``kind`` has no row (the message lists the kinds).
    """
    return kinds.facts(RENAMED_KINDS.get(kind, kind)).gate_metrics


def stderr_metrics(kind: str) -> frozenset[str]:
    """The gate metrics of ``kind`` that carry a standard error (``<metric>_stderr``), the only ones a
    statistical test (``statistic`` other than ``point``) may name; empty for an unknown kind."""
    row = kinds.KINDS.get(RENAMED_KINDS.get(kind, kind))
    return row.stderr_metrics if row is not None else frozenset()


def problems(gates: Sequence[Gate], kind: str, at: Loc) -> list[tuple[Loc, str]]:
    """What is wrong with ``gates`` for a ``kind`` model, as ``(key path, message)``:
    a metric the kind does not produce (naming the valid ones) or two gates with one
    name (their junit test case names must differ). ``at`` is the list's key path,
    e.g. ``("validate", "gates")``; each problem's path adds the gate index. A
    statistical test on a metric without a standard error (:func:`stderr_metrics`) is one.
    """
    try:
        valid = kind_metrics(kind)
    except KeyError as e:
        return [(at, e.args[0])] if gates else []
    out: list[tuple[Loc, str]] = []
    seen: dict[str, int] = {}
    for i, gate in enumerate(gates):
        if gate.metric not in valid:
            base = gate.metric.removesuffix(STDERR_SUFFIX)
            hint = (f"; it is the standard error of {base}: gate {base} with statistic: evidence_of_regression "
                    "or evidence_of_meeting" if base != gate.metric and base in stderr_metrics(kind) else "")
            out.append(((*at, i, "metric"), f"{gate.metric!r} is not a metric of a {kind} model; "
                        f"valid: {sorted(valid)}{hint}"))
        if gate.statistic != "point" and gate.metric in valid and gate.metric not in stderr_metrics(kind):
            out.append(((*at, i, "statistic"), f"{gate.statistic} needs a standard error, and {gate.metric!r} has "
                        f"none; use statistic: point, or a metric with one: {sorted(stderr_metrics(kind))}"))
        if gate.label in seen:
            out.append(((*at, i), f"gate name {gate.label!r} is also the name of gate {seen[gate.label]}; "
                        "give one of them its own name (name: <text>)"))
        seen.setdefault(gate.label, i)
    return out


def evaluate(gates: Sequence[Gate], metrics: dict, prefix: str = "") -> list[GateResult]:
    """One verdict per gate, on metric ``prefix + gate.metric`` (``engine.`` where a
    TensorRT engine ships and was measured).

    A metric without a finite value (``null`` in ``metrics.json``, with a
    ``<metric>_reason``; NaN; inf) fails its gate and is reported as NaN.

    Args:
        gates: the recipe's gates, in order.
        metrics: metric name -> number or None, as the validate stage writes them; a
            metric's standard error is read from ``<metric>_stderr`` and its eval size
            from ``stderr_basis[<metric>]`` (:mod:`pipeline.metrics.uncertainty`).
        prefix: prepended to every gate's metric name.

    A ``min`` gate on a timing metric (:data:`NOISE_MARGINS`: ``speedup_vs_fp32``, "keep
    only if faster") passes at ``value >= min - margin`` (0.10: see
    :mod:`pipeline.metrics.speed`); its result's ``bound`` is that effective bound, so
    the report reads e.g. ``speedup_vs_fp32 = 0.95 (bound >= 0.9)`` for ``min: 1.0``.
    A statistical ``statistic`` compares with :func:`threshold` (module docstring).

    Returns:
        :class:`~pipeline.artifacts.GateResult` per gate; ``op`` is ``"<="`` for a
        ``max`` bound, ``">="`` for a ``min`` bound; the uncertainty fields are None
        where the metric has no standard error.

    Raises:
        InternalError: a gate's metric is missing from ``metrics`` (the recipe check
            refuses gates on metrics the kind does not produce, so this is a bug).
        RecipeError: a statistical test on a finite value whose standard error is
            missing or null (e.g. one eval window: nothing to resample).
    """
    return [_evaluate_one(gate, metrics, prefix) for gate in gates]


def _evaluate_one(gate: Gate, metrics: dict, prefix: str) -> GateResult:
    metric = prefix + gate.metric
    if metric not in metrics:
        raise InternalError(f"gate {gate.label!r} needs metric {metric!r}, which was not measured; "
                            f"measured: {sorted(metrics)}")
    raw = metrics[metric]
    value = math.nan if raw is None else float(raw)
    se_raw = metrics.get(f"{metric}{STDERR_SUFFIX}")
    se = float(se_raw) if se_raw is not None and math.isfinite(float(se_raw)) else None
    upper = gate.max is not None
    if gate.max is not None:
        bound = float(gate.max)
    else:
        assert gate.min is not None  # the schema requires exactly one bound
        bound = float(gate.min) - NOISE_MARGINS.get(gate.metric, 0.0)  # documented noise margin (speedup)
    if gate.statistic != "point" and se is None and math.isfinite(value):
        raise RecipeError(f"validate.gates: {gate.label} asks for statistic {gate.statistic}, but {metric} has no "
                          f"standard error here ({metrics.get(f'{metric}{STDERR_SUFFIX}_reason') or 'null'}); "
                          "measure more than one eval window / item, or use statistic: point")
    limit = threshold(bound, upper, se, gate.statistic, gate.confidence) if se is not None else bound
    passed = value <= limit if upper else value >= limit
    res = GateResult(gate.label, metric, value, bound, "<=" if upper else ">=", bool(passed and math.isfinite(value)),
                     statistic=gate.statistic, threshold=limit, unit=UNITS.get(gate.metric),
                     confidence=gate.confidence if gate.statistic != "point" else None)
    if se is not None and math.isfinite(value):
        _add_uncertainty(res, se, upper, metrics.get(BASIS_KEY, {}).get(metric, {}))
    elif f"{metric}{STDERR_SUFFIX}" in metrics or metrics.get(f"{metric}{STDERR_SUFFIX}_reason"):
        res.no_stderr = str(metrics.get(f"{metric}{STDERR_SUFFIX}_reason") or "fewer than 2 eval units to resample")
    return res


def threshold(bound: float, upper: bool, se: float, statistic: str, confidence: float) -> float:
    """The value a gate compares with: ``bound`` (point), ``bound ± z·se`` otherwise,
    z = Φ⁻¹(confidence) (one-sided normal quantile, :meth:`statistics.NormalDist.inv_cdf`).

    ``evidence_of_regression`` moves the threshold past the bound (max: +z·se, min: -z·se);
    ``evidence_of_meeting`` moves it inside (max: -z·se, min: +z·se).

    Raises:
        ValueError: an unknown ``statistic``.
    """
    if statistic == "point":
        return bound
    if statistic not in ("evidence_of_regression", "evidence_of_meeting"):
        raise ValueError(f"statistic {statistic!r}; valid: point, evidence_of_regression, evidence_of_meeting")
    shift = NormalDist().inv_cdf(confidence) * se
    outward = shift if statistic == "evidence_of_regression" else -shift
    return bound + outward if upper else bound - outward


def margin_se(value: float, bound: float, upper: bool, se: float) -> float:
    """Distance to the bound in standard errors, positive on the passing side:
    (bound - value) / se for a max bound, (value - bound) / se for a min bound;
    ±inf for se = 0 (the sign of the gap; 0 on the bound)."""
    gap = (bound - value) if upper else (value - bound)
    return gap / se if se > 0 else math.copysign(math.inf, gap) if gap else 0.0


def n_needed(n_now: int, se: float, gap: float, k: float = NOISE_SE) -> int | None:
    """Eval tokens (or items) that would put the bound ``k`` standard errors from the value:
    a standard error of a mean scales as 1/√n, so se(n') = se·√(n/n') and
    n' = n·(k·se / |gap|)², rounded up (``gap`` = value - bound). None when ``gap`` is 0
    (no size resolves a value on the bound)."""
    if gap == 0:
        return None
    return math.ceil(n_now * (k * se / abs(gap)) ** 2)


def _add_uncertainty(res: GateResult, se: float, upper: bool, basis: dict) -> None:
    """Fill the result's standard error, margin, noise flag and eval sizes."""
    res.stderr, res.margin_se = se, margin_se(res.value, res.bound, upper, se)
    res.within_noise = abs(res.margin_se) < NOISE_SE
    res.n, res.n_unit, res.stderr_method = basis.get("n"), basis.get("unit"), basis.get("method")
    if res.within_noise and res.n:
        res.n_needed = n_needed(res.n, se, res.value - res.bound)
