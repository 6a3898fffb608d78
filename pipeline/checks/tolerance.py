"""Numeric comparisons that cannot pass by accident.

A candidate element passes when ``|got - ref| <= atol + rtol * |ref|``
(the ``numpy.isclose`` rule). NaN or Inf in the candidate where the reference
is finite fails; NaN in the reference, an empty tensor or a shape mismatch
raises, because nothing trustworthy was compared.
"""
from __future__ import annotations

import fnmatch

import numpy as np

from pipeline.errors import AccuracyError
from pipeline.recipe.precisions import PRECISIONS

# (rtol, atol) defaults per precision of the candidate (the precision table's); recipes may override.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {p.name: p.export_tolerance for p in PRECISIONS.values()}


def tolerance(precision: str, override: tuple[float, float] | None = None) -> tuple[float, float]:
    """(rtol, atol) for a precision; ``override`` wins when given.

    Raises:
        AccuracyError: unknown precision.
    """
    if override is not None:
        return override
    if precision not in DEFAULT_TOLERANCES:
        raise AccuracyError(f"no default tolerance for precision {precision!r}; valid: {sorted(DEFAULT_TOLERANCES)}")
    return DEFAULT_TOLERANCES[precision]


_CHUNK = 1 << 22


def _chunk(ref: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> tuple[int, int, float]:
    """(mismatched, non-finite where the reference is finite, max finite abs error) of one chunk."""
    ref_finite, got_finite = np.isfinite(ref), np.isfinite(got)
    both = ref_finite & got_finite
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref)
    ok = np.where(both, err <= atol + rtol * np.abs(ref), ref == got)
    return int((~ok).sum()), int((ref_finite & ~got_finite).sum()), float(err[both].max()) if both.any() else 0.0


def tensor(name: str, ref: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> dict:
    """Compare one tensor. Returns a JSON-able report with ``passed``.

    Raises:
        AccuracyError: shapes differ, zero elements, or NaN in the reference.
    """
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape:
        raise AccuracyError(f"{name}: shape {list(got.shape)} differs from reference {list(ref.shape)}")
    if ref.size == 0:
        raise AccuracyError(f"{name}: comparison of zero elements proves nothing")
    ref_flat, got_flat = ref.reshape(-1), got.reshape(-1)
    if np.isnan(ref_flat).any():
        raise AccuracyError(f"{name}: reference holds NaN; the reference model or its input is broken")
    mismatched = bad_nonfinite = 0
    max_err = 0.0
    for start in range(0, ref_flat.size, _CHUNK):  # bounded float64 temporaries
        r = ref_flat[start : start + _CHUNK].astype(np.float64)
        g = got_flat[start : start + _CHUNK].astype(np.float64)
        bad, nonfinite, err = _chunk(r, g, rtol, atol)
        mismatched, bad_nonfinite = mismatched + bad, bad_nonfinite + nonfinite
        max_err = max(max_err, err)
    return {
        "name": name,
        "elements": int(ref.size),
        "max_abs_err": max_err,
        "mismatched": mismatched,
        "nonfinite_in_candidate": bad_nonfinite,
        "passed": mismatched == 0 and bad_nonfinite == 0,
    }


def for_output(name: str, default: tuple[float, float], per_output: dict | None) -> tuple[float, float]:
    """(rtol, atol) for one output: the first matching fnmatch pattern of
    ``per_output`` (values with ``rtol``/``atol``), else ``default``."""
    for pattern, tol in (per_output or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return tol.rtol, tol.atol
    return default


def outputs(refs: list[np.ndarray], gots: list[np.ndarray], names: list[str], rtol: float, atol: float,
            per_output: dict | None = None) -> dict:
    """Compare lists of outputs; report the worst one.

    Raises:
        AccuracyError: the lists differ in length or are empty, or as :func:`tensor`.
    """
    if not refs or len(refs) != len(gots) or len(refs) != len(names):
        raise AccuracyError(f"cannot compare {len(gots)} outputs with {len(refs)} reference outputs")
    reports = [tensor(n, r, g, *for_output(n, (rtol, atol), per_output)) for n, r, g in zip(names, refs, gots)]
    worst = max(reports, key=lambda r: (not r["passed"], r["max_abs_err"]))
    return {
        "passed": all(r["passed"] for r in reports),
        "max_abs_err": max(r["max_abs_err"] for r in reports),
        "worst": f"{worst['name']}: max_abs_err={worst['max_abs_err']:.3g}, "
        f"mismatched={worst['mismatched']}/{worst['elements']}, nonfinite={worst['nonfinite_in_candidate']}",
        "outputs_compared": len(reports),
    }
