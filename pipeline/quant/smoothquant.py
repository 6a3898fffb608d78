"""SmoothQuant on the ONNX graph: move activation outliers into the weights.

Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models" (ICML 2023). For each input channel j
of a weight GEMM ``Y = X W`` (``W`` ``[in, out]``)::

    s_j = max|X_j| ** alpha / max|W_j,:| ** (1 - alpha)
    Y = (X / s) (diag(s) W)

``X / s`` is folded into the op that produces ``X``, so the FP32 graph computes
the same function:

* an RMSNorm / LayerNorm scale: ``Mul(normalized, gamma[C])`` -> ``gamma / s``;
* the previous linear layer through an elementwise product: ``down_proj``'s input
  is ``SiLU(gate) * up``, linear in ``up``'s output channels, so ``W_up[:, j] / s_j``.

GEMMs that share one input (q/k/v after the attention norm, gate/up after the
MLP norm) share one ``s``: the weight maximum is taken over all of them. An
input produced by anything else (``o_proj`` after the attention: ``softmax(QK) V``
is not linear in a per-channel scale of the value projection's *input*, and the
reshape/transpose mixes heads) is left unsmoothed and reported.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.errors import QuantizationError
from pipeline.quant.qdq import Target

#: lower bound on amax and on s, so a dead channel cannot divide by zero
_EPS = 1e-5


@dataclass
class SmoothReport:
    """What :func:`smooth` did: activation tensor -> how it was folded."""

    folded: dict[str, str] = field(default_factory=dict)  # act -> "norm:<init>" or "linear:<node>"
    skipped: dict[str, str] = field(default_factory=dict)  # act -> reason
    scales: dict[str, np.ndarray] = field(default_factory=dict)  # act -> s [C]

    def summary(self) -> dict:
        """JSON-ready: counts, the skipped activations with reasons, and s's range per folded input."""
        return {"smoothed_inputs": len(self.folded), "skipped_inputs": dict(self.skipped),
                "folded_into": dict(self.folded),
                "scale_range": {a: [float(s.min()), float(s.max())] for a, s in self.scales.items()}}


def smoothing_scales(act_amax: np.ndarray, weights: list[np.ndarray], alpha: float) -> np.ndarray:
    """``s_j = max|X_j|^alpha / max|W_j|^(1-alpha)`` for one shared input.

    Args:
        act_amax: float ``[C]`` per-channel abs-max of the input over calibration data.
        weights: float32 ``[C, out_k]`` weights of every GEMM reading that input
            (the maximum over all of them is used).
        alpha: migration strength in [0, 1]; 0 leaves activations, 1 moves everything to weights.

    Returns:
        float32 ``[C]``, strictly positive and finite.

    Raises:
        QuantizationError: alpha outside [0, 1], or a weight whose rows differ from ``C``.
    """
    if not 0.0 <= alpha <= 1.0:
        raise QuantizationError(f"quantize.smoothquant.alpha: {alpha} is outside [0, 1]")
    c = act_amax.shape[0]
    bad = [w.shape for w in weights if w.ndim != 2 or w.shape[0] != c]
    if bad:
        raise QuantizationError(f"smoothquant: weights {bad} do not have {c} input rows")
    w_amax = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
    s = np.maximum(act_amax, _EPS) ** alpha / np.maximum(w_amax, _EPS) ** (1.0 - alpha)
    return np.clip(s, _EPS, 1.0 / _EPS).astype(np.float32)


def smooth(model: onnx.ModelProto, targets: list[Target], act_amax: dict[str, np.ndarray],
           alpha: float) -> SmoothReport:
    """Apply SmoothQuant in place to ``model`` (weights loaded) for the MatMul ``targets``.

    Modified tensors get new initializers (``<name>_smooth<k>``), so a weight or
    norm scale shared by other nodes is never changed under them.

    Args:
        model: FP32 graph with its initializers loaded.
        targets: weight GEMMs (:func:`pipeline.quant.qdq.find_targets`); only MatMul
            targets with ``[in, out]`` weights (axis 1) are smoothed.
        act_amax: per-channel abs-max ``[C]`` of each target's input
            (:func:`pipeline.quant.calibrate.collect_channel_amax`).
        alpha: migration strength, ``quantize.smoothquant.alpha``.

    Returns:
        The :class:`SmoothReport`.

    Raises:
        QuantizationError: an input lacks per-channel statistics, or alpha is invalid.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    by_act: dict[str, list[Target]] = defaultdict(list)
    for t in targets:
        by_act[t.act].append(t)
    nodes = {n.name: n for n in g.node}
    report = SmoothReport()
    for k, (act, group) in enumerate(by_act.items()):
        reason = _unsupported(act, group, nodes, consumers, act_amax)
        fold = None if reason else _fold_site(producer.get(act), inits, producer, consumers, act_amax[act].shape[0])
        if reason or fold is None:
            report.skipped[act] = reason or f"produced by {_op(producer.get(act))}: no norm scale or linear layer to fold into"
            continue
        weights = [numpy_helper.to_array(inits[t.weight]) for t in group]
        s = smoothing_scales(act_amax[act], weights, alpha)
        for t, w in zip(group, weights):
            _replace_input(g, inits, nodes[t.node], 1, w * s[:, None], f"{t.weight}_smooth{k}")
        kind, node, idx, arr = fold
        folded = arr / s if kind == "norm" else arr / s[None, :]
        _replace_input(g, inits, node, idx, folded.astype(np.float32), f"{node.input[idx]}_smooth{k}")
        report.folded[act] = f"{kind}:{node.name}"
        report.scales[act] = s
    _drop_unused(g)
    return report


def _unsupported(act: str, group: list[Target], nodes: dict, consumers: dict, act_amax: dict) -> str | None:
    if act not in act_amax:
        raise QuantizationError(f"smoothquant: input {act!r} of {group[0].node!r} has no per-channel statistics")
    if any(nodes[t.node].op_type != "MatMul" or t.weight_axis != 1 for t in group):
        return "not a MatMul with an [in, out] weight"
    if {n.name for n in consumers[act]} != {t.node for t in group}:
        return "read by nodes other than the quantized GEMMs (folding would change them)"
    return None


def _fold_site(node: onnx.NodeProto | None, inits: dict, producer: dict, consumers: dict, c: int):
    """``(kind, node, input index, float32 array)`` to divide by s, or None.

    ``norm``: a Mul by a ``[C]`` initializer (the norm's scale). ``linear``: a Mul
    of two activations, one of which is a MatMul output read by nothing else,
    with a ``[K, C]`` initializer weight (``up_proj`` in ``SiLU(gate) * up``).
    """
    if node is None or node.op_type != "Mul":
        return None
    for idx, name in enumerate(node.input):
        if name in inits and tuple(inits[name].dims) == (c,):
            return "norm", node, idx, numpy_helper.to_array(inits[name]).astype(np.float32)
    if any(name in inits for name in node.input):
        return None
    for name in node.input:
        mm = producer.get(name)
        if (mm is not None and mm.op_type == "MatMul" and len(consumers[name]) == 1 and mm.input[1] in inits
                and len(inits[mm.input[1]].dims) == 2 and inits[mm.input[1]].dims[1] == c):
            return "linear", mm, 1, numpy_helper.to_array(inits[mm.input[1]]).astype(np.float32)
    return None


def _replace_input(g: onnx.GraphProto, inits: dict, node: onnx.NodeProto, idx: int, value: np.ndarray,
                   name: str) -> None:
    """Point ``node.input[idx]`` at a new initializer ``name`` (``inits`` stays current)."""
    tensor = numpy_helper.from_array(value.astype(np.float32), name)
    g.initializer.append(tensor)
    inits[name] = tensor
    node.input[idx] = name


def _drop_unused(g: onnx.GraphProto) -> None:
    used = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for i in reversed(range(len(g.initializer))):
        if g.initializer[i].name not in used:
            del g.initializer[i]


def _op(node: onnx.NodeProto | None) -> str:
    return "a graph input" if node is None else f"{node.op_type} node {node.name!r}"


def prepare(sq, out_dir, progress, src, model: onnx.ModelProto, kept: list[Target],
            batches: list[dict[str, np.ndarray]], channel_amax: dict[str, np.ndarray] | None = None
            ) -> tuple[onnx.ModelProto, list[Target], str, dict, dict[str, np.ndarray]]:
    """The SmoothQuant step of quantization (``sq``: the recipe's ``quantize.smoothquant``; ``out_dir``:
    where the smoothed graph goes; ``progress``: the console). It never sees the stage.

    Without ``sq``, returns ``model`` as given (weights not loaded). With it,
    loads ``model``'s weights from beside ``src``,
    collects per-channel input amax over ``batches``, smooths the inputs of the
    MatMul targets in ``kept`` and writes the smoothed FP32 graph to
    ``<out_dir>/smoothed_fp32.onnx`` (per-tensor calibration then runs on it).

    Args:
        channel_amax: a pinned per-channel amax (:mod:`pipeline.quant.pin`): used instead of
            collecting it over ``batches``.

    Returns:
        ``(model, kept targets re-found in it, graph path to calibrate, info for the artifact,
        the per-channel amax used: float32 [channels] per activation, empty without SmoothQuant)``.

    Raises:
        QuantizationError: see :func:`smooth`.
    """
    from pathlib import Path

    from onnx.external_data_helper import load_external_data_for_model

    from pipeline import onnx_io
    from pipeline.quant import calibrate, qdq

    if sq is None:
        return model, kept, str(src), {}, {}
    load_external_data_for_model(model, str(Path(src).parent))
    mm = [t for t in kept if t.weight_axis == 1 and t.node in {n.name for n in model.graph.node if n.op_type == "MatMul"}]
    acts = sorted({t.act for t in mm})
    with progress.step(f"smoothquant: per-channel amax of {len(acts)} GEMM inputs, alpha {sq.alpha}"):
        chan = channel_amax if channel_amax is not None else calibrate.collect_channel_amax(model, acts, batches)
        report = smooth(model, mm, chan, sq.alpha)
    path = Path(out_dir) / "smoothed_fp32.onnx"
    onnx_io.save_model_atomic(model, path)
    names = {t.node for t in kept}
    kept = [t for t in qdq.find_targets(model, [n for n in ("MatMul", "Gemm", "Conv")]) if t.node in names]
    return model, kept, str(path), {"alpha": sq.alpha, **report.summary()}, chan
