"""Per-group quantization sensitivity on a tuning split (issue 10 §2).

A *trial* is the Q/DQ graph with a set of GEMM groups left in high precision,
measured on the tuning windows against the FP32 reference. The reference
log-probabilities and the calibration amax are computed once and reused by
every trial; each weight is quantized once (:func:`pipeline.quant.qdq.insert_qdq`'s
``weight_cache``).

Metrics of a trial (text generation, teacher-forced next-token distributions):

* ``kld_mean``: mean over scored tokens of KL(P_fp32 || P_q), nats;
* ``relative_perplexity_increase``: ``exp(NLL_q) / exp(NLL_fp32) - 1``, token level;
* ``top1_agreement``: fraction of positions with the same argmax.

The sensitivity of a group is how much the chosen metric improves when only that
group is left in high precision (all others quantized).
"""
from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from scipy.special import log_softmax

from pipeline.errors import QuantizationError
from pipeline.quant import qdq

#: metrics a trial measures (and an accuracy budget may name), and whether lower is better
TRIAL_METRICS = {"kld_mean": True, "relative_perplexity_increase": True, "top1_agreement": False}
GROUPINGS = ("per_block", "per_projection")
_BLOCK = re.compile(r"(.*?layers?\.\d+)(?:\.|$)")


def group_of(target: qdq.Target, grouping: str) -> str:
    """The group name of a GEMM: its block's module path (``model.model.layers.3``)
    for ``per_block``, its projection name (``down_proj``) for ``per_projection``.
    A GEMM outside any numbered block is its own group (its scope or node name).

    Raises:
        QuantizationError: unknown ``grouping``.
    """
    if grouping not in GROUPINGS:
        raise QuantizationError(f"quantize.sensitivity.groups: {grouping!r} is not one of {list(GROUPINGS)}")
    scope = target.scope or target.node
    if grouping == "per_block":
        m = _BLOCK.match(scope)
        return m.group(1) if m else scope
    return scope.rsplit(".", 1)[-1]


def groups(targets: list[qdq.Target], grouping: str) -> dict[str, list[str]]:
    """Group name -> node names, in graph order of each group's first GEMM."""
    out: dict[str, list[str]] = {}
    for t in targets:
        out.setdefault(group_of(t, grouping), []).append(t.node)
    return out


@dataclass
class Reference:
    """FP32 teacher-forced statistics on the tuning windows, computed once.

    ``logp``: float32 ``[tokens, vocab]`` log-probabilities of the scored positions
    (memory: tokens x vocab x 4 bytes; SmolLM2, 8 windows of 128: 200 MB); ``nll``: summed FP32 NLL (nats); ``top1``:
    int64 ``[tokens]``; ``targets``: int64 ``[tokens]`` next-token ids.
    """

    logp: np.ndarray
    nll: float
    top1: np.ndarray
    targets: np.ndarray


@dataclass
class Trial:
    """One measured configuration: the groups left in high precision and its metrics."""

    excluded_groups: list[str]
    excluded_nodes: int
    metrics: dict[str, float]
    wall_s: float


@dataclass
class TrialRunner:
    """Builds and measures Q/DQ variants of one FP32 graph on the tuning feeds.

    Args:
        model: the FP32 graph (smoothed, if SmoothQuant is on) with its weights loaded.
        targets: all quantizable GEMMs; ``group_nodes`` maps group -> node names.
        amax: per-tensor activation amax of every target's input (calibration).
        fmt, per_channel: the quantization format and weight granularity.
        feeds: tuning batches (prefill feeds with ``input_ids`` int64 ``[b, seq]``).
        logits: ``(session, feeds) -> float32 [b, seq, vocab]``.
        reference_session: an ONNX Runtime session of the FP32 reference graph.
    """

    model: onnx.ModelProto
    targets: list[qdq.Target]
    group_nodes: dict[str, list[str]]
    amax: dict[str, float]
    fmt: qdq.QFormat
    per_channel: bool
    feeds: list[dict[str, np.ndarray]]
    logits: Callable[[ort.InferenceSession, dict], np.ndarray]
    reference_session: ort.InferenceSession
    trials: list[Trial] = field(default_factory=list)
    _cache: dict = field(default_factory=dict)
    _weights: dict = field(default_factory=dict)
    _ref: Reference | None = None

    def reference(self) -> Reference:
        """The FP32 statistics (computed on first use).

        Raises:
            QuantizationError: the reference gives non-finite logits.
        """
        if self._ref is None:
            parts = [self._score(self.reference_session, f) for f in self.feeds]
            logp = np.concatenate([p[0] for p in parts])
            if not np.isfinite(logp).all():
                raise QuantizationError("quantize.tuning: the FP32 reference gives non-finite logits on the tuning data")
            tg = np.concatenate([p[1] for p in parts])
            nll = -float(np.take_along_axis(logp, tg[:, None], axis=1).sum())
            self._ref = Reference(logp, nll, logp.argmax(axis=1), tg)
        return self._ref

    def measure(self, excluded_groups: list[str]) -> Trial:
        """Metrics (:data:`TRIAL_METRICS`) of the graph with ``excluded_groups`` in high
        precision; a configuration already measured is returned from memory."""
        key = frozenset(excluded_groups)
        if key in self._cache:
            return self._cache[key]
        start = time.perf_counter()
        ref = self.reference()
        skip = {n for g in excluded_groups for n in self.group_nodes[g]}
        kept = [t for t in self.targets if t.node not in skip]
        variant = qdq.insert_qdq(copy.deepcopy(self.model), kept, self.amax, self.fmt, self.per_channel,
                                 inplace=True, weight_cache=self._weights)
        sess = _session(variant)
        del variant
        kl, nll, agree, row = 0.0, 0.0, 0, 0
        for f in self.feeds:
            logp, _ = self._score(sess, f)
            n = logp.shape[0]
            rlp = ref.logp[row : row + n]
            kl += float((np.exp(rlp) * (rlp - logp)).sum())
            nll -= float(np.take_along_axis(logp, ref.targets[row : row + n, None], axis=1).sum())
            agree += int((logp.argmax(axis=1) == ref.top1[row : row + n]).sum())
            row += n
        metrics = {"kld_mean": kl / row, "relative_perplexity_increase": float(np.expm1((nll - ref.nll) / row)),
                   "top1_agreement": agree / row}
        trial = Trial(sorted(excluded_groups), len(skip), metrics, time.perf_counter() - start)
        self._cache[key] = trial
        self.trials.append(trial)
        return trial

    def _score(self, sess: ort.InferenceSession, feeds: dict) -> tuple[np.ndarray, np.ndarray]:
        """Log-probs float32 ``[tokens, vocab]`` at every position but the last, and the next-token ids."""
        lg = self.logits(sess, feeds)[:, :-1].astype(np.float32)
        ids = feeds["input_ids"][:, 1:]
        return log_softmax(lg.reshape(-1, lg.shape[-1]), axis=-1), ids.reshape(-1).astype(np.int64)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of an in-memory graph, at the level validate uses for Q/DQ."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@dataclass
class Sensitivity:
    """Ranked sensitivity: rows ``{group, gemms, metric_value, improvement}``, most sensitive first."""

    metric: str
    baseline: float
    rows: list[dict]


def measure_sensitivity(runner: TrialRunner, metric: str) -> Sensitivity:
    """For each group: ``metric`` with only that group in high precision, and the
    improvement over the all-quantized baseline (positive = the group hurts).

    Raises:
        QuantizationError: ``metric`` is not a trial metric.
    """
    if metric not in TRIAL_METRICS:
        raise QuantizationError(f"sensitivity metric {metric!r} is not one of {sorted(TRIAL_METRICS)}")
    lower = TRIAL_METRICS[metric]
    base = runner.measure([]).metrics[metric]
    rows = []
    for g, nodes in runner.group_nodes.items():
        value = runner.measure([g]).metrics[metric]
        rows.append({"group": g, "gemms": len(nodes), "metric_value": value,
                     "improvement": (base - value) if lower else (value - base)})
    rows.sort(key=lambda r: -float(r["improvement"]))
    return Sensitivity(metric, base, rows)


def write_report(sens: Sensitivity, folder: Path) -> tuple[Path, Path]:
    """``sensitivity.md`` (ranked table) and ``sensitivity.png`` (matplotlib bar chart) in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Sensitivity on the tuning split: `{sens.metric}` with only that group left in high precision "
             f"(all quantized: {sens.baseline:.6g}).", "", f"| rank | group | GEMMs | {sens.metric} | improvement |",
             "|---:|---|---:|---:|---:|"]
    lines += [f"| {i} | `{r['group']}` | {r['gemms']} | {r['metric_value']:.6g} | {r['improvement']:.6g} |"
              for i, r in enumerate(sens.rows, 1)]
    md = folder / "sensitivity.md"
    md.write_text("\n".join(lines) + f"\n\n![sensitivity]({folder.name}/sensitivity.png)\n")  # relative to report.md
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(sens.rows)), 4))
    ax.bar(range(len(sens.rows)), [r["improvement"] for r in sens.rows], color="tab:blue")
    ax.set_xticks(range(len(sens.rows)), [_short(r["group"]) for r in sens.rows], rotation=90, fontsize=7)
    ax.set_ylabel(f"{sens.metric} improvement")
    ax.set_title("Per-group sensitivity (left in high precision, others quantized)")
    fig.tight_layout()
    png = folder / "sensitivity.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return md, png


def _short(group: str) -> str:
    """Chart label: ``layers.3`` for a block path, else the last name component."""
    m = re.search(r"layers?\.\d+$", group)
    return m.group(0) if m else group.rsplit(".", 1)[-1]
