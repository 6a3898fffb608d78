"""Standard errors of gate metrics by a paired bootstrap over eval units (Efron &
Tibshirani, *An Introduction to the Bootstrap*, 1993, ch. 6: the bootstrap estimate
of a standard error is the standard deviation of the statistic over resamples).

"Paired": the reference and the candidate are resampled together (the same windows,
or the same word pairs), so their shared variation cancels, as it does in the metric.
Units are whole eval windows (text generation) or items (word pairs, sentences),
never single tokens: tokens of one window are correlated, and treating them as
independent understates the error.

Deterministic: a fixed seed (:data:`SEED`) and :data:`RESAMPLES` resamples.

A metric ``m`` with a standard error is written as ``m_stderr`` in
``validate/metrics.json``, with ``stderr_basis[m]`` (:func:`basis`) saying how many
eval tokens or items it rests on and how it was computed.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

RESAMPLES = 2000
SEED = 0


def resample_counts(n_units: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """How often each unit is drawn in each resample: float64 ``[resamples, n_units]``,
    each row a multinomial draw of ``n_units`` with equal probabilities (resampling
    with replacement). ``counts @ per_unit_sums`` gives every resample's sums at once.

    Raises:
        ValueError: ``n_units`` < 2 (one unit has no spread to resample).
    """
    if n_units < 2:
        raise ValueError(f"a bootstrap needs at least 2 eval units, got {n_units}")
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=resamples).astype(np.float64)


def resample_indices(n_units: int, resamples: int = RESAMPLES, seed: int = SEED) -> np.ndarray:
    """Unit indices of each resample: int ``[resamples, n_units]`` (for statistics that
    are not sums, e.g. a rank correlation).

    Raises:
        ValueError: ``n_units`` < 2.
    """
    if n_units < 2:
        raise ValueError(f"a bootstrap needs at least 2 eval units, got {n_units}")
    return np.random.default_rng(seed).integers(0, n_units, size=(resamples, n_units))


def ratio_of_sums_stderr(num: np.ndarray, den: np.ndarray,
                         transform: Callable[[np.ndarray], np.ndarray] | None = None,
                         counts: np.ndarray | None = None) -> float:
    """Bootstrap standard error of ``transform(sum(num) / sum(den))`` over units.

    Args:
        num, den: float ``[n_units]`` per-unit sums (e.g. a window's summed NLL
            difference and its scored-token count).
        transform: applied to each resample's ratio (e.g. ``np.exp`` for a perplexity ratio).
        counts: :func:`resample_counts` for ``n_units`` (made here when None).

    Returns:
        The sample standard deviation (ddof 1) of the statistic over resamples.

    Raises:
        ValueError: fewer than 2 units, or ``num`` and ``den`` differ in length.
    """
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"per-unit sums must be two [n] arrays, got {num.shape} and {den.shape}")
    counts = resample_counts(len(num)) if counts is None else counts
    stat = (counts @ num) / (counts @ den)
    if transform is not None:
        stat = transform(stat)
    return float(np.std(stat, ddof=1))


def basis(n: int, unit: str, units: int, resampled: str, resamples: int = RESAMPLES) -> dict:
    """The record ``stderr_basis[<metric>]``: ``n`` eval tokens or items (``unit``) the
    metric averages over, and the method, e.g. ``{"n": 6120, "unit": "tokens", "method":
    "paired bootstrap over 24 eval windows, 2000 resamples (seed 0)"}``."""
    return {"n": int(n), "unit": unit,
            "method": f"paired bootstrap over {units} {resampled}, {resamples} resamples (seed {SEED})"}
