"""The quantize stage's activation ranges: calibration batches from the kind's adapter, or a pinned result
(:mod:`pipeline.quant.pin`) held to the recipe's bounds, and the candidate pin a run writes for ``tune``."""
from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import numpy as np
import onnx

from pipeline.artifacts import ExportArtifact
from pipeline.context import StageContext
from pipeline.errors import QuantizationError
from pipeline.models import registry
from pipeline.recipe.schema import ExcludeConfig
from pipeline.quant import pin, qdq



def pinned_amax(pinned: dict, acts: list[str], path: Path, retune: str) -> dict[str, float]:
    """The pinned amax of ``acts`` (:func:`pipeline.quant.pin.read` checked each is finite and > 0).

    Raises:
        QuantizationError: the pin lacks a tensor (the graph changed under a matching pin).
    """
    missing = [a for a in acts if a not in pinned["amax"]]
    if missing:
        raise QuantizationError(f"{path}: amax: no pinned amax for {missing[:3]} ({len(missing)} tensors); the graph "
                                f"changed since it was tuned: re-tune ({retune}), or bump pin.SEARCH_VERSION")
    return {a: float(pinned["amax"][a]) for a in acts}

def pinned_kept(model: onnx.ModelProto, kept: list[qdq.Target], targets: list[qdq.Target], pinned: dict,
                 path: Path, retune: str, tuning) -> list[qdq.Target]:
    """``kept`` without the pin's high-precision scopes, matched exactly as ``quantize.exclude.nodes``,
    held to the recipe's own bounds: each entry names a weight GEMM of the graph (``targets``), at
    least one GEMM stays quantized, and no fewer than ``tuning.min_quantized_fraction`` of them.

    Raises:
        QuantizationError: (exit 2) an entry matches no weight GEMM, or the pin's exclusions leave
            none quantized or go below the floor; names the file, the key and the GEMM counts.
    """
    if not pinned["excluded"]:
        return kept
    for i, pat in enumerate(pinned["excluded"]):
        if not any(fnmatch.fnmatchcase(t.node, pat) or fnmatch.fnmatchcase(t.scope, pat) for t in targets):
            raise QuantizationError(f"{path}: excluded[{i}]: {pat!r} matches no weight GEMM (module scope or node "
                                    f"name) of the exported graph; re-tune ({retune})")
    left = qdq.apply_exclusions(model, kept, ExcludeConfig(nodes=pinned["excluded"]))[0]
    floor = tuning.min_quantized_fraction if tuning is not None else 0.0
    if not left or len(left) / len(targets) < floor:
        why = ("leaves no weight GEMM quantized" if not left else
               f"goes below quantize.tuning.min_quantized_fraction ({floor:g})")
        raise QuantizationError(
            f"{path}: excluded: its {len(pinned['excluded'])} entries keep {len(kept) - len(left)} more GEMMs in high "
            f"precision, {len(left)} of {len(targets)} ({len(left) / len(targets):.1%}) quantized: that {why}; "
            f"re-tune ({retune})")
    return left

def write_candidate(ctx: StageContext, amax: dict[str, float], consumers: dict[str, list[str]], chan: dict,
                     found) -> None:
    """``quantize/tuned.json``: what ``tune`` pins (:func:`pipeline.quant.pin.candidate`)."""
    from pipeline.fsutil import write_text_atomic
    from pipeline.provenance import tool_versions

    if ctx.pin is None or (found is not None and found.status != "met"):
        return
    search = ({"status": found.status, "bound": found.bound, "trials": len(found.trials),
               "notes": found.notes} if found else {"status": "no search (no accuracy_budget)"})
    versions = tool_versions()
    data = pin.candidate(ctx.pin.fields, excluded=found.excluded_scopes if found else [], amax=amax,
                         consumers=consumers, channel_amax=chan, metrics=found.metrics if found else {}, search=search,
                         recorded={"versions": versions, "cpu": versions.get("cpu", "")})
    write_text_atomic(ctx.stage_dir / pin.CANDIDATE, json.dumps(data, indent=1) + "\n")

CALIBRATION_FEEDS = "calibration_feeds.npz"

def calibration_data(ctx: StageContext, exp: ExportArtifact) -> tuple[list[dict[str, np.ndarray]], dict]:
    """Calibration batches from the kind's adapter (:meth:`ModelAdapter.calibration_feeds`
    on the calibration split), and the shortfall.

    Returns ``(batches, shortfall)``: ``shortfall`` is empty when ``samples``
    samples (rows on axis 0) were found, else ``{"samples_requested": n, "shortfall": text}``
    for the console, the stage summary and the report.

    Raises:
        QuantizationError: fewer samples than ``min_samples`` (the recipe schema
            already refused batch/sequence sizes outside the first profile).
        DataError: the calibration data cannot be read.
    """
    cal = ctx.recipe.quantize.calibration
    batches = registry.adapter(ctx.recipe.model).calibration_feeds(exp, cal.data, cal)
    found = sum(rows(b) for b in batches)
    where = cal.data.describe()
    if found < cal.min_samples:
        raise QuantizationError(
            f"quantize.calibration: {where} gives {found} windows of "
            f"{cal.seq_len} tokens, below min_samples={cal.min_samples}; widen the split or shorten seq_len"
        )
    shortfall: dict = {}
    if found < cal.samples:
        text = (f"calibrated on {found} of the {cal.samples} requested samples: {where} holds only "
                f"{found} windows of {cal.seq_len} tokens (min_samples={cal.min_samples})")
        shortfall = {"samples_requested": cal.samples, "shortfall": text}
    return batches, shortfall

def rows(batch: dict[str, np.ndarray]) -> int:
    """Samples in one feed batch: axis 0 of its first input."""
    return int(next(iter(batch.values())).shape[0]) if batch else 0
