"""Per-group quantization sensitivity on a tuning split.

A *trial* is the Q/DQ graph with a set of GEMM groups left in high precision,
measured on the tuning windows against the FP32 reference. The reference
statistics and the calibration amax are computed once and reused by every trial.

Every trial runs in one ONNX Runtime session (:func:`switch_graph`): each
quantized GEMM reads ``Where(switch, QDQ(x), x)`` and ``Where(switch, DQ(w_q), w)``,
one boolean graph input per GEMM (a group is a set of GEMMs), so a trial is one forward pass over the
tuning windows, with no graph copy, serialization or session build per trial.
The GEMM sees exactly the values it sees in the graph
:func:`pipeline.quant.qdq.insert_qdq` writes (tested against it).

Metrics of a trial (text generation, teacher-forced next-token distributions):

* ``kld_mean``: mean over scored tokens of KL(P_fp32 || P_q), nats;
* ``relative_perplexity_increase``: ``exp(NLL_q) / exp(NLL_fp32) - 1``, token level;
* ``top1_agreement``: fraction of positions with the same argmax.

The sensitivity of a group is how much the chosen metric improves when only that
group is left in high precision (all others quantized).
"""
from __future__ import annotations

import copy
import dataclasses
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import QuantizationError
from pipeline.metrics.llm_quality import kl_from_reference, log_softmax64, reference_terms
from pipeline.onnx_io import PROTOBUF_LIMIT
from pipeline.ort_sessions import SharedWeights
from pipeline.quant import qdq

#: metrics a trial measures (and an accuracy budget may name), and whether lower is better
TRIAL_METRICS = {"kld_mean": True, "relative_perplexity_increase": True, "top1_agreement": False}
GROUPINGS = ("per_block", "per_projection", "per_gemm")
_BLOCK = re.compile(r"(.*?layers?\.\d+)(?:\.|$)")


def group_of(target: qdq.Target, grouping: str) -> str:
    """The group name of a GEMM: its block's module path (``model.model.layers.3``)
    for ``per_block``, its projection name (``down_proj``) for ``per_projection``, its
    own module path (``model.model.layers.3.mlp.down_proj``) for ``per_gemm``.
    A GEMM outside any numbered block is its own group (its scope or node name).

    Raises:
        QuantizationError: unknown ``grouping``.
    """
    if grouping not in GROUPINGS:
        raise QuantizationError(f"quantize.sensitivity.groups: {grouping!r} is not one of {list(GROUPINGS)}")
    scope = target.scope or target.node
    if grouping == "per_gemm":
        return scope
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


#: rows per float64 block when scoring logits (memory: rows x vocab x 8 bytes per temporary)
_CHUNK = 64
#: graph-input name prefix of the group switches of :func:`switch_graph`
SWITCH_PREFIX = "quant_switch_"


def switch_graph(model: onnx.ModelProto, targets: list[qdq.Target], group_nodes: dict[str, list[str]],
                 amax: dict[str, float], fmt: qdq.QFormat, per_channel: bool,
                 weight_cache: dict | None = None, shared: SharedWeights | None = None
                 ) -> tuple[onnx.ModelProto, dict[str, str]]:
    """One graph for every trial: each target GEMM reads ``Where(s, DQ(Q(x)), x)`` and
    ``Where(s, DQ(w_q), w)``, ``s`` a bool scalar graph input of its group (True: quantized).

    Activation Q/DQ and quantized weights are the ones :func:`pipeline.quant.qdq.insert_qdq`
    writes, so with a group's switch on its GEMMs see the same values as in that graph.
    Memory: the FP32 weights plus their quantized copies (1 byte per FP8/INT8 value); with
    ``shared``, the FP32 weights are its placeholders (:meth:`SharedWeights.strip`), not a copy.

    Args:
        model: FP32 graph with its weights loaded (not modified).
        targets: the quantizable GEMMs; group_nodes: group -> node names (every target in one group).
        amax, fmt, per_channel, weight_cache: as :func:`pipeline.quant.qdq.insert_qdq`.
        shared: the FP32 weights of ``model`` held once for every session (None: copied into the graph).

    Returns:
        ``(graph, {group: switch input name})``.

    Raises:
        QuantizationError: a target has no group, or an activation has no calibrated amax.
    """
    group_of_node = {n: g for g, nodes in group_nodes.items() for n in nodes}
    missing = [t.node for t in targets if t.node not in group_of_node]
    if missing:
        raise QuantizationError(f"sensitivity: GEMMs {missing[:3]} belong to no group")
    switches = {g: f"{SWITCH_PREFIX}{i}" for i, g in enumerate(group_nodes)}
    inits = {i.name: i for i in model.graph.initializer}
    model = shared.strip(model) if shared is not None else copy.deepcopy(model)
    g = model.graph
    by_node = {t.node: t for t in targets}
    new_inits: list = []
    nodes: list = []
    done_act: dict[str, str] = {}
    done_w: dict[str, str] = {}
    chosen: dict[tuple[str, str], str] = {}

    def select(name: str, quantized: str, switch: str, after: str | None = None) -> str:
        key = (name, switch)
        if key not in chosen:
            chosen[key] = f"{name}_{switch}"
            cond = switch if after is None else _gated(switch, after, nodes, chosen)
            nodes.append(helper.make_node("Where", [cond, quantized, name], [chosen[key]],
                                          name=f"{name}_{switch}_Where"))
        return chosen[key]

    for node in g.node:
        t = by_node.get(node.name)
        if t is not None:
            sw = switches[group_of_node[t.node]]
            if t.act not in done_act:
                done_act[t.act] = qdq._act_qdq(t.act, amax, fmt, nodes, new_inits)
            if t.weight not in done_w:
                done_w[t.weight] = (_shared_dq(inits[t.weight], t, fmt, per_channel, shared, new_inits)
                                    if shared is not None else
                                    qdq._weight_dq(inits[t.weight], t, fmt, per_channel, nodes, new_inits, "",
                                                   weight_cache))
            node.input[0] = select(t.act, done_act[t.act], sw)
            node.input[1] = select(t.weight, done_w[t.weight], sw, after=t.act)
        nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(new_inits + [numpy_helper.from_array(np.array(-1, np.int64), NEVER)])
    g.input.extend(helper.make_tensor_value_info(name, TensorProto.BOOL, []) for name in switches.values())
    return model, switches


#: int64 -1, a size no tensor has: ``Size(x) == NEVER`` is False, computed from ``x``
NEVER = "quant_switch_never"


def _gated(switch: str, act: str, nodes: list, done: dict) -> str:
    """``switch`` as a value computed from the GEMM's activation ``act``: Or(switch, Size(act) ==
    :data:`NEVER`). A weight's Where on it runs once the activation exists; on the bare graph input
    ONNX Runtime runs every weight's Where at the start and holds all their outputs (one more copy
    of the FP32 weights) until their GEMMs have run."""
    key = (act, switch, "gate")
    if key not in done:
        size, empty, done[key] = f"{act}_{switch}_size", f"{act}_{switch}_empty", f"{act}_{switch}_gate"
        nodes += [helper.make_node("Size", [act], [size], name=f"{size}_Size"),
                  helper.make_node("Equal", [size, NEVER], [empty], name=f"{empty}_Equal"),
                  helper.make_node("Or", [switch, empty], [done[key]], name=f"{done[key]}_Or")]
    return done[key]


def _shared_dq(w: onnx.TensorProto, t: qdq.Target, fmt: qdq.QFormat, per_channel: bool,
               shared: SharedWeights, inits: list) -> str:
    """The name of ``w``'s quantize-dequantized values, computed once and shared
    (:func:`pipeline.quant.qdq.dequantized`), in place of a DequantizeLinear that every run would
    recompute and whose FP32 output ONNX Runtime would hold for every weight at once."""
    name = f"{w.name}_dequantized"
    if name not in shared.arrays:
        # not through ``cache``: the quantized copy would stay beside the shared values (0.25 x W more)
        values = shared.arrays.get(w.name)
        inits.append(shared.add(name, qdq.dequantized(*qdq.quantized_weight(w, t, fmt, per_channel, "", values=values))))
    else:
        inits.append(shared.placeholder(name, list(shared.arrays[name].shape)))
    return name


@dataclass
class Reference:
    """FP32 teacher-forced statistics on the tuning windows, computed once.

    ``prob``: float32 ``[tokens, vocab]`` probabilities of the scored positions
    (tokens x vocab x 4 bytes: SmolLM2, 8 windows of 128 tokens, 1016 x 49152: 200 MB);
    ``neg_entropy``: float64 ``[tokens]``, sum_v p log p; ``nll``: float64 ``[tokens]`` FP32 NLL
    per token (nats); ``top1``, ``targets``: int64 ``[tokens]`` argmax and next-token ids.
    """

    prob: np.ndarray
    neg_entropy: np.ndarray
    nll: np.ndarray
    top1: np.ndarray
    targets: np.ndarray


@dataclass
class Trial:
    """One measured configuration: the groups left in high precision and its metrics."""

    excluded_groups: list[str]
    excluded_nodes: int
    metrics: dict[str, float]
    wall_s: float
    windows: int = 0  # tuning windows measured (the sensitivity pass may use fewer than the search)


@dataclass
class TrialRunner:
    """Measures Q/DQ variants of one FP32 graph on the tuning feeds, all in one
    session of :func:`switch_graph` (built on the first trial).

    Args:
        model: the FP32 graph (smoothed, if SmoothQuant is on), with its weights loaded or with
            ``weights_dir``.
        targets: all quantizable GEMMs; ``group_nodes`` maps group -> node names.
        amax: per-tensor activation amax of every target's input (calibration).
        fmt, per_channel: the quantization format and weight granularity.
        feeds: tuning batches (prefill feeds with ``input_ids`` int64 ``[b, seq]``).
        logits: ``(session, feeds) -> float32 [b, seq, vocab]``.
        reference_session: an ONNX Runtime session of the FP32 reference graph; used
            once for :meth:`reference`, then released.
        weights_dir: the folder of ``model``'s external data when it was loaded without it: the
            weights are then memory-mapped from there (:class:`pipeline.ort_sessions.SharedWeights`).
    """

    model: onnx.ModelProto
    targets: list[qdq.Target]
    group_nodes: dict[str, list[str]]
    amax: dict[str, float]
    fmt: qdq.QFormat
    per_channel: bool
    feeds: list[dict[str, np.ndarray]]
    logits: Callable[[ort.InferenceSession, dict], np.ndarray]
    reference_session: ort.InferenceSession | None
    weights_dir: str | None = None
    trials: list[Trial] = field(default_factory=list)
    _cache: dict = field(default_factory=dict)
    _ref: Reference | None = None
    _switch: tuple[ort.InferenceSession, dict[str, str]] | None = None
    _shared: SharedWeights | None = None

    def shared(self) -> SharedWeights:
        """The FP32 weights of :attr:`model`, held once for every switch-graph session."""
        if self._shared is None:
            self._shared = SharedWeights(self.model, weights_dir=self.weights_dir)
        return self._shared

    def reference(self) -> Reference:
        """The FP32 statistics (computed on first use).

        Raises:
            QuantizationError: the reference gives non-finite logits.
        """
        if self._ref is None:
            sess = self.reference_session
            if sess is None:  # no FP32 session given: the switch graph with every group off
                sess, switches = self._switched()
                run = lambda f: self.logits(sess, {**f, **_switch_feeds(switches, ())})  # noqa: E731
            else:
                run = lambda f: self.logits(sess, f)  # noqa: E731
            parts = [_reference_part(run(f), f["input_ids"]) for f in self.feeds]
            prob, neg_h, nll, top1, tg = (np.concatenate([p[i] for p in parts]) for i in range(5))
            if not np.isfinite(prob).all():
                raise QuantizationError("quantize.tuning: the FP32 reference gives non-finite logits on the tuning data")
            self._ref = Reference(prob, neg_h, nll, top1, tg)
            self.reference_session = None  # release the FP32 session's memory
        return self._ref

    def add_groups(self, group_nodes: dict[str, list[str]]) -> None:
        """Name more groups (e.g. single GEMMs of a group, for a refinement); a trial may mix
        names of any granularity. Raises QuantizationError for a node that is not a target."""
        known = {t.node for t in self.targets}
        bad = [n for nodes in group_nodes.values() for n in nodes if n not in known]
        if bad:
            raise QuantizationError(f"sensitivity: {bad[:3]} are not quantizable GEMMs")
        self.group_nodes.update(group_nodes)

    def nodes_of(self, groups: list[str]) -> set[str]:
        """The GEMM node names of ``groups``."""
        return {n for g in groups for n in self.group_nodes[g]}

    def measure(self, excluded_groups: list[str], batches: int | None = None) -> Trial:
        """Metrics (:data:`TRIAL_METRICS`) of the graph with ``excluded_groups`` in high
        precision, on the first ``batches`` tuning feed batches (default: all); a
        configuration (the same GEMMs) already measured on as many batches is returned from memory."""
        feeds = self.feeds[:batches] if batches else self.feeds
        off = self.nodes_of(excluded_groups)
        key = frozenset(off)
        if (key, len(feeds)) in self._cache:  # the same GEMMs, perhaps named by other groups
            hit = self._cache[(key, len(feeds))]
            names = sorted(excluded_groups)
            return hit if hit.excluded_groups == names else dataclasses.replace(hit, excluded_groups=names)
        start = time.perf_counter()
        self.reference()  # before the switch graph's session: the FP32 one is released first
        sess, switches = self._switched()
        metrics = self.score(sess, switches, off, feeds)
        windows = sum(int(f["input_ids"].shape[0]) for f in feeds)
        trial = Trial(sorted(excluded_groups), len(off), metrics, time.perf_counter() - start, windows)
        self._cache[(key, len(feeds))] = trial
        self.trials.append(trial)
        return trial

    def score(self, sess: ort.InferenceSession, switches: dict[str, str], off: set[str],
              feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
        """:data:`TRIAL_METRICS` of a switch-graph session with the GEMMs ``off`` in high precision."""
        ref = self.reference()
        on = _switch_feeds(switches, {t.node for t in self.targets} - off)
        kl, nll, agree, row = 0.0, 0.0, 0, 0
        for f in feeds:
            lg = self.logits(sess, {**f, **on})[:, :-1]
            lg = lg.reshape(-1, lg.shape[-1])
            k, l, a = _score_against(lg, ref, row)
            kl, nll, agree, row = kl + k, nll + l, agree + a, row + lg.shape[0]
        ref_nll = float(ref.nll[:row].sum())  # the same scored tokens as the candidate's
        return {"kld_mean": kl / row, "relative_perplexity_increase": float(np.expm1((nll - ref_nll) / row)),
                "top1_agreement": agree / row}

    def _switched(self) -> tuple[ort.InferenceSession, dict[str, str]]:
        """The :func:`switch_graph` session, one switch per GEMM, and the switch names (built once)."""
        if self._switch is None:
            per_node = {t.node: [t.node] for t in self.targets}
            graph, switches = switch_graph(self.model, self.targets, per_node, self.amax, self.fmt,
                                           self.per_channel, shared=self.shared())
            self._switch = (_session(graph, shared=self.shared()), switches)
        return self._switch


def _switch_feeds(switches: dict[str, str], quantized: Collection[str]) -> dict[str, np.ndarray]:
    """Bool scalar feeds: True for the switches named in ``quantized``, False for the others."""
    return {name: np.array(g in quantized) for g, name in switches.items()}


def _reference_part(logits: np.ndarray, ids: np.ndarray) -> tuple:
    """Reference statistics of one batch: ``(prob f32 [n, V], neg_entropy f64 [n], nll f64 [n], top1 [n],
    targets [n])``
    of every position but the last (``logits`` float ``[b, seq, V]``, ``ids`` int64 ``[b, seq]``)."""
    lg = logits[:, :-1].reshape(-1, logits.shape[-1])
    tg = ids[:, 1:].reshape(-1).astype(np.int64)
    prob = np.empty(lg.shape, np.float32)
    neg_h = np.empty(len(lg))
    nll = np.empty(len(lg))
    for lo in range(0, len(lg), _CHUNK):
        lp = log_softmax64(lg[lo : lo + _CHUNK])
        prob[lo : lo + _CHUNK], neg_h[lo : lo + _CHUNK] = reference_terms(lp)
        nll[lo : lo + _CHUNK] = -np.take_along_axis(lp, tg[lo : lo + _CHUNK, None], axis=1)[:, 0]
    return prob, neg_h, nll, lg.argmax(axis=1), tg


def _score_against(lg: np.ndarray, ref: Reference, row: int) -> tuple[float, float, int]:
    """Summed KL(ref || cand), summed candidate NLL and top-1 matches of candidate logits
    float ``[n, V]`` against reference rows ``row .. row + n``.

    KL per token from :func:`pipeline.metrics.llm_quality.kl_from_reference`, float64 in blocks of
    :data:`_CHUNK` rows.
    """
    kl = nll = 0.0
    for lo in range(0, len(lg), _CHUNK):
        z = lg[lo : lo + _CHUNK]
        r = slice(row + lo, row + lo + len(z))
        lq = log_softmax64(z)
        kl += float(kl_from_reference(ref.prob[r], ref.neg_entropy[r], lq).sum())
        nll -= float(np.take_along_axis(lq, ref.targets[r, None], axis=1)[:, 0].sum())
    agree = int((lg.argmax(axis=1) == ref.top1[row : row + len(lg)]).sum())
    return kl, nll, agree


def thread_noise(runner: TrialRunner, metric: str, batches: int = 1) -> float:
    """Float-kernel noise of a trial metric: ``|m_other - m_default|`` of the all-quantized
    configuration on the first ``batches`` tuning batches, in a second session that differs from
    the runner's in its intra-op thread count (one, or two where the default is one) and in running
    without ONNX Runtime's graph fusions: both change how the float work is split and summed, as
    another CPU's kernels do (on one AVX-512 machine the thread count alone changed no bit)."""
    base = runner.measure([], batches)
    per_node = {t.node: [t.node] for t in runner.targets}
    graph, switches = switch_graph(runner.model, runner.targets, per_node, runner.amax, runner.fmt,
                                   runner.per_channel, shared=runner.shared())
    threads = 1 if (ort.SessionOptions().intra_op_num_threads or 0) != 1 else 2
    sess = _session(graph, threads, ort.GraphOptimizationLevel.ORT_DISABLE_ALL, shared=runner.shared())
    del graph
    other = runner.score(sess, switches, set(), runner.feeds[:batches])
    return abs(other[metric] - base.metrics[metric])


def _session(model: onnx.ModelProto, threads: int = 0, level=None, *, consume: bool = False,
             shared: SharedWeights | None = None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of an in-memory graph, at the level validate uses for FP8 Q/DQ
    (basic: exact simulated quantization; :mod:`pipeline.ort_sessions`) unless ``level`` says another;
    ``threads`` intra-op threads (0: ONNX Runtime's default, one per core).

    A graph at or over protobuf's 2 GiB (the switch graph of a ~0.5 B model: FP32 and quantized
    weights) cannot be serialized: its large initializers go to ONNX Runtime beside the proto
    (``add_external_initializers``). ``consume``: ``model`` may be emptied of them (else a copy is).
    ``shared``: ``model``'s FP32 weights are its placeholders (:meth:`SharedWeights.session`)."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if level is None else level
    if shared is not None:  # the proto then holds the quantized weights alone (< 2 GiB below ~8 B parameters)
        return shared.session(model, opts)
    values = []
    if model.ByteSize() >= PROTOBUF_LIMIT:
        if not consume:
            model = copy.deepcopy(model)
        names, values = _initializers_outside(model)
        opts.add_external_initializers(names, values)
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    sess._pipeline_initializers = values  # ONNX Runtime reads them in place: keep them alive
    return sess


def _initializers_outside(model: onnx.ModelProto, min_bytes: int = 1 << 20) -> tuple[list[str], list]:
    """Move every FP32 initializer of ``min_bytes`` or more (the bulk: the FP32 weights) out of
    ``model`` (marked external, data cleared) into OrtValues: ``(names, values)`` for
    ``SessionOptions.add_external_initializers``, which takes numpy types only (no FP8)."""
    names, values = [], []
    for t in model.graph.initializer:
        if (t.data_type != onnx.TensorProto.FLOAT or t.data_location == onnx.TensorProto.EXTERNAL
                or len(t.raw_data) < min_bytes):
            continue
        names.append(t.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(numpy_helper.to_array(t))))
        t.ClearField("raw_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        entry = t.external_data.add()
        entry.key, entry.value = "location", "in-memory"
    return names, values


@dataclass
class Sensitivity:
    """Ranked sensitivity: rows ``{group, gemms, metric_value, improvement}``, most sensitive first."""

    metric: str
    baseline: float
    rows: list[dict]
    windows: int = 0  # tuning windows each value was measured on


def measure_sensitivity(runner: TrialRunner, metric: str, batches: int | None = None) -> Sensitivity:
    """For each group of ``runner.group_nodes``: ``metric`` with only that group in high
    precision, and the improvement over the all-quantized baseline (positive = the group
    hurts), on the first ``batches`` tuning feed batches (default: all; see :meth:`TrialRunner.measure`).

    Raises:
        QuantizationError: ``metric`` is not a trial metric.
    """
    if metric not in TRIAL_METRICS:
        raise QuantizationError(f"sensitivity metric {metric!r} is not one of {sorted(TRIAL_METRICS)}")
    lower = TRIAL_METRICS[metric]
    first = runner.measure([], batches)
    base, windows = first.metrics[metric], first.windows
    rows = []
    for g, nodes in runner.group_nodes.items():
        value = runner.measure([g], batches).metrics[metric]
        rows.append({"group": g, "gemms": len(nodes), "metric_value": value,
                     "improvement": (base - value) if lower else (value - base)})
    rows.sort(key=lambda r: -float(r["improvement"]))
    return Sensitivity(metric, base, rows, windows)


def write_report(sens: Sensitivity, folder: Path) -> tuple[Path, Path]:
    """``sensitivity.md`` (ranked table) and ``sensitivity.png`` (matplotlib bar chart) in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = [f"Sensitivity on the tuning split ({sens.windows} windows): `{sens.metric}` with only that group "
             f"left in high precision (all quantized: {sens.baseline:.6g}).", "", f"| rank | group | GEMMs | {sens.metric} | improvement |",
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
