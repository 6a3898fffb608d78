"""``build --bisect-crash``: reduce a graph that crashes the engine builder to the smallest
subgraph that still crashes it, as ``polygraphy debug reduce`` does, within a time limit.

Every candidate is built in a child process (:func:`pipeline.trt.builder.run_child`); it
"still crashes" when the child dies of the same signal. The nodes are taken in graph
(topological) order:

1. the end: the shortest prefix of the nodes that crashes (binary search), its graph outputs
   every tensor it hands to a later node (``polygraphy debug reduce``'s frontier);
2. the start (when the crash also happens at fixed shapes, see below): the latest node the kept
   range can start at (binary search). Tensors the dropped nodes made become graph inputs
   (floating point) or constants of their probed values (integers and booleans: shape
   arithmetic, positions, masks); a low-precision tensor (FP8 / INT8 between a Q and its DQ)
   is never cut: its producer stays;
3. the outputs: the last node's outputs alone, when that still crashes; else each output of the
   range is dropped in turn while it still crashes.

Cutting at the start needs every cut tensor's shape. ONNX Runtime (in this process) runs the
graph once at the first profile's ``opt`` shapes, with every intermediate tensor as an output;
the graph's inputs and the cut tensors then get those fixed shapes. If the whole graph does not
crash at fixed shapes, only the end is reduced, under the recipe's profiles.

The smallest crashing subgraph is saved as ``crash-subgraph.onnx`` with ``crash-subgraph.md``
naming its nodes, and the quantized GEMMs in it (or fed by its Q/DQ nodes): the
``quantize.exclude.nodes`` that remove its Q/DQ nodes.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.artifacts import ResolvedProfile
from pipeline.fsutil import write_text_atomic
from pipeline.quant.qdq import node_scope
from pipeline.triton.ir_version import required_ir

log = logging.getLogger(__name__)

SUBGRAPH = "crash-subgraph.onnx"
REPORT = "crash-subgraph.md"
GEMM_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose")
#: cut tensors of these types become graph inputs
_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
#: ... of these, constants (their probed value)
_INTEGERS = {TensorProto.INT64, TensorProto.INT32, TensorProto.BOOL, TensorProto.INT16, TensorProto.UINT16,
             TensorProto.UINT32, TensorProto.UINT64}
_INLINE_LIMIT = 1 << 30  # bytes of weights saved inside the ONNX file; above: beside it


class OutOfTime(Exception):
    """The time limit ran out before the next build."""


#: ``crashes(onnx_path, resolved_profiles, dynamic_inputs)``: whether building it crashes the same way
Probe = Callable[[Path, list[ResolvedProfile], list[str]], bool]


@dataclass
class Reduction:
    """What :func:`reduce_crash` found: the saved subgraph (``path``, None when not even the whole
    graph crashed again), its nodes ``(name, op type)`` in graph order, the quantized GEMMs to
    exclude, the builds it ran, its wall time, and whether it finished within the time limit."""

    path: Path | None
    nodes: list[tuple[str, str]] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    patterns: list[str] = field(default_factory=list)
    builds: int = 0
    seconds: float = 0.0
    finished: bool = True
    shapes: str = ""
    total_nodes: int = 0

    def describe(self) -> str:
        """Lines for the crash message."""
        how = (f"{self.builds} builds in {self.seconds:.0f} s"
               + ("" if self.finished else ", stopped by the time limit (the subgraph is the smallest found by then)"))
        if self.path is None and not self.finished:
            return f"bisect ({how}): no candidate crashed within the time limit; raise it (build --bisect-crash --bisect-time-limit SECONDS)"
        if self.path is None:
            return f"bisect ({how}): the whole graph did not crash again in a fresh builder; nothing to reduce"
        shown = ", ".join(f"{n} ({op})" for n, op in self.nodes[:20]) + (
            f", ... ({len(self.nodes) - 20} more)" if len(self.nodes) > 20 else "")
        lines = [f"bisect ({how}; {self.shapes}): the smallest subgraph that still crashes has {len(self.nodes)} of "
                 f"{self.total_nodes} nodes, saved to {self.path} (nodes listed in {self.path.with_name(REPORT)}): "
                 f"{shown}"]
        if self.exclude:
            lines.append(f"it holds the Q/DQ nodes of the quantized GEMMs {', '.join(self.exclude)}: to keep them in "
                         f"high precision, quantize.exclude.nodes: [{', '.join(self.patterns)}]"
                         + (" (their module scopes, in every layer: the same pattern repeats in each, and the crash "
                            "with it)" if self.patterns != self.exclude else "")
                         + ", which should avoid the crash (then build again); or build.backend: none")
        else:
            lines.append("it holds no Q/DQ node of a quantized GEMM, so excluding nodes from quantization may not "
                         "avoid it; build.backend: none does (no engine; the ONNX graph is served)")
        return "\n".join(lines)


def reduce_crash(onnx_path: Path, resolved: Sequence[ResolvedProfile], dynamic: Sequence[str], crashes: Probe,
                 out_dir: Path, time_limit_s: float, quantized_nodes: Sequence[str] | None = None) -> Reduction:
    """Reduce ``onnx_path`` (which crashed the builder) to the smallest subgraph that ``crashes``
    still, within ``time_limit_s`` seconds; save it and its report into ``out_dir``."""
    start = time.perf_counter()
    deadline = start + time_limit_s
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in (SUBGRAPH, SUBGRAPH + ".data", REPORT):
        (out_dir / stale).unlink(missing_ok=True)
    model = onnx.load(str(onnx_path))
    graph = _Graph(model)
    search = _Search(graph, resolved, dynamic, crashes, out_dir, deadline)
    try:
        search.run(_probe_values(model, graph, resolved, out_dir))
    except OutOfTime:
        search.finished = False
    red = Reduction(None, builds=search.builds, seconds=time.perf_counter() - start, finished=search.finished,
                    total_nodes=len(graph.nodes))
    if search.best is None:
        return red
    keep, outputs, static = search.best
    sub = graph.subgraph(keep, outputs, search.values if static else None)
    assert sub is not None  # it was built before
    red.path = _save(sub[0], out_dir / SUBGRAPH)
    red.nodes = [(graph.nodes[i].name, graph.nodes[i].op_type) for i in sorted(sub[1])]
    red.exclude = graph.quantized_gemms(sub[1], quantized_nodes)
    red.patterns = graph.exclusion_patterns(red.exclude)
    red.shapes = (f"fixed shapes: profile {resolved[0].name!r} opt" if static and resolved else
                  "fixed shapes" if static else "the recipe's profiles")
    write_text_atomic(out_dir / REPORT, _report(red, onnx_path))
    return red


def _report(red: Reduction, onnx_path: Path) -> str:
    rows = "\n".join(f"| {i} | `{n}` | {op} |" for i, (n, op) in enumerate(red.nodes))
    return (f"# Builder crash: smallest crashing subgraph\n\nOf {onnx_path} ({red.total_nodes} nodes); "
            f"{red.builds} builds in {red.seconds:.0f} s{'' if red.finished else ', cut short by the time limit'}; "
            f"{red.shapes}.\n\n| # | node | op |\n|---:|---|---|\n{rows}\n\n"
            + (f"Quantized GEMMs whose Q/DQ nodes it holds: {', '.join(red.exclude)}; to keep them (in every "
               f"layer) in high precision:\n\n```yaml\nquantize:\n  exclude:\n    nodes: "
               f"[{', '.join(repr(p) for p in red.patterns)}]\n```\n" if red.exclude else
               "No quantized GEMM's Q/DQ nodes are in it.\n"))


def _save(model: onnx.ModelProto, path: Path) -> Path:
    """Save with the weights inside, or beside it (``<name>.data``) when they are large."""
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if size > _INLINE_LIMIT:
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(model, str(path))
    return path


class _Graph:
    """The model's nodes in graph order, who makes and reads each tensor, and each tensor's type."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        g = model.graph
        self.nodes = list(g.node)
        self.inits = {i.name: i for i in g.initializer}
        self.inputs = {v.name: v for v in g.input if v.name not in self.inits}
        self.outputs = [o.name for o in g.output]
        self.producer = {out: i for i, n in enumerate(self.nodes) for out in n.output if out}
        self.readers: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            for t in n.input:
                if t:
                    self.readers.setdefault(t, []).append(i)
        self.types: dict[str, int] = {}
        try:
            bare = onnx.ModelProto()
            bare.CopyFrom(model)
            del bare.graph.initializer[:]
            bare.graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                                    for i in g.initializer)
            inferred = onnx.shape_inference.infer_shapes(bare).graph
            infos = [*inferred.value_info, *inferred.input, *inferred.output]
        except Exception as e:  # noqa: BLE001  types stay unknown: such tensors are not cut
            log.debug("bisect: shape inference failed: %s", e)
            infos = [*g.value_info, *g.input, *g.output]
        for v in infos:
            if v.type.HasField("tensor_type"):
                self.types[v.name] = v.type.tensor_type.elem_type
        self.types.update({name: i.data_type for name, i in self.inits.items()})

    def frontier(self, keep: set[int]) -> list[str]:
        """Tensors ``keep``'s nodes make that a node outside it reads, or that are graph outputs."""
        outs = []
        for i in sorted(keep):
            for t in self.nodes[i].output:
                if t and (t in self.outputs or any(r not in keep for r in self.readers.get(t, []))):
                    outs.append(t)
        return outs

    def ancestors(self, keep: set[int], outputs: Sequence[str]) -> set[int]:
        """The nodes of ``keep`` that ``outputs`` depend on."""
        todo = [self.producer[t] for t in outputs if t in self.producer and self.producer[t] in keep]
        seen: set[int] = set()
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            todo += [self.producer[t] for t in self.nodes[i].input if t in self.producer and self.producer[t] in keep]
        return seen

    def subgraph(self, keep: set[int], outputs: Sequence[str] | None,
                 values: dict[str, np.ndarray] | None) -> tuple[onnx.ModelProto, set[int]] | None:
        """The model of nodes ``keep`` with ``outputs`` (default: its frontier), or None when it has
        no output a builder can mark. With ``values`` (probed tensors; fixed shapes) tensors made by
        dropped nodes are cut (see the module docstring) and every input gets its probed shape;
        without, ``keep`` must hold every producer (a prefix)."""
        keep = set(keep)
        while True:  # pull in the producers of tensors that cannot be cut
            more = {self.producer[t] for i in keep for t in self.nodes[i].input
                    if t in self.producer and self.producer[t] not in keep and not self._cuttable(t, values)}
            if not more:
                break
            keep |= more
        outs = [t for t in (outputs if outputs is not None else self.frontier(keep))
                if self.types.get(t) in _FLOATS | _INTEGERS]
        if not outs:
            return None
        keep = self.ancestors(keep, outs)
        made = {t for i in keep for t in self.nodes[i].output if t}
        inputs, inits, seen = [], [], set()
        for i in sorted(keep):
            for t in self.nodes[i].input:
                if not t or t in made or t in seen:
                    continue
                seen.add(t)
                if t in self.inits:
                    inits.append(self.inits[t])
                elif values is not None and t in self.producer and self.types.get(t) in _INTEGERS:
                    inits.append(numpy_helper.from_array(values[t], t))
                elif values is not None:
                    inputs.append(helper.make_tensor_value_info(t, self.types[t], list(values[t].shape)))
                elif t in self.inputs:
                    inputs.append(self.inputs[t])
                else:
                    return None
        nodes = [self.nodes[i] for i in sorted(keep)]
        outputs_vi = [helper.make_tensor_value_info(t, self.types[t], None) for t in outs]
        g = helper.make_graph(nodes, "crash_subgraph", inputs, outputs_vi, inits)
        model = helper.make_model(g, opset_imports=list(self.model.opset_import), ir_version=self.model.ir_version)
        return model, keep

    def _cuttable(self, tensor: str, values: dict[str, np.ndarray] | None) -> bool:
        return values is not None and tensor in values and self.types.get(tensor) in _FLOATS | _INTEGERS

    def quantized_gemms(self, keep: set[int], quantized_nodes: Sequence[str] | None) -> list[str]:
        """GEMMs (in the whole graph) whose Q/DQ nodes are in ``keep``, or that are in it with a
        dequantized operand; only those of ``quantized_nodes`` when given. In graph order."""
        found: set[int] = set()
        for i in keep:
            node = self.nodes[i]
            if node.op_type in GEMM_OPS and any(self._dequantized(t) for t in node.input):
                found.add(i)
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                found |= self._gemms_fed_by(i)
        names = [self.nodes[i].name for i in sorted(found) if self.nodes[i].name]
        return [n for n in names if quantized_nodes is None or n in set(quantized_nodes)]

    def exclusion_patterns(self, names: Sequence[str]) -> list[str]:
        """``quantize.exclude.nodes`` patterns for the GEMMs ``names``: each one's torch module
        scope with its block indices as ``*`` (``model.layers.*.self_attn.q_proj``: that module in
        every layer), or its node name when the graph records no scope."""
        by_name = {n.name: n for n in self.nodes}
        out: list[str] = []
        for name in names:
            scope = node_scope(by_name[name]) if name in by_name else ""
            pattern = re.sub(r"(?<=\.)\d+(?=\.)", "*", scope) if scope else name
            if pattern not in out:
                out.append(pattern)
        return out

    def _dequantized(self, tensor: str) -> bool:
        i = self.producer.get(tensor)
        return i is not None and self.nodes[i].op_type == "DequantizeLinear"

    def _gemms_fed_by(self, i: int) -> set[int]:
        """GEMMs that read what node ``i`` makes, through Q -> DQ (and a Transpose / Reshape / Cast)."""
        out: set[int] = set()
        todo, seen = [i], set()
        while todo:
            j = todo.pop()
            if j in seen:
                continue
            seen.add(j)
            for t in self.nodes[j].output:
                for r in self.readers.get(t, []):
                    op = self.nodes[r].op_type
                    if op in GEMM_OPS:
                        out.add(r)
                    elif op in ("QuantizeLinear", "DequantizeLinear", "Transpose", "Reshape", "Cast"):
                        todo.append(r)
        return out


class _Search:
    """The reduction's state: the best (smallest) crashing candidate so far, builds run."""

    def __init__(self, graph: _Graph, resolved: Sequence[ResolvedProfile], dynamic: Sequence[str], crashes: Probe,
                 out_dir: Path, deadline: float):
        self.graph, self.resolved, self.dynamic, self.crashes = graph, list(resolved), list(dynamic), crashes
        self.out_dir, self.deadline = out_dir, deadline
        self.builds, self.finished = 0, True
        self.best: tuple[set[int], list[str] | None, bool] | None = None
        self.values: dict[str, np.ndarray] | None = None

    def crash(self, keep: set[int], outputs: list[str] | None, static: bool) -> bool:
        """Build the candidate; remember it when it crashes and is smaller than the best."""
        sub = self.graph.subgraph(keep, outputs, self.values if static else None)
        if sub is None:
            return False
        if time.perf_counter() > self.deadline:
            raise OutOfTime
        model, kept = sub
        path = _save(model, self.out_dir / ".candidate.tmp-subgraph.onnx")
        names = {v.name for v in model.graph.input}
        if static:
            resolved, dynamic = [], []
        else:
            resolved = [ResolvedProfile(p.name, {n: s for n, s in p.shapes.items() if n in names})
                        for p in self.resolved]
            dynamic = [n for n in self.dynamic if n in names]
        self.builds += 1
        try:
            crashed = self.crashes(path, resolved, dynamic)
        finally:
            for f in (path, path.with_name(path.name + ".data")):
                f.unlink(missing_ok=True)
        log.info("bisect: %d nodes (%s shapes): %s", len(kept), "fixed" if static else "profile",
                 "crashes" if crashed else "builds")
        if crashed and (self.best is None or len(kept) <= len(self.best[0])):
            self.best = (kept, outputs, static)
        return crashed

    def run(self, values: dict[str, np.ndarray] | None) -> None:
        n = len(self.graph.nodes)
        everything = set(range(n))
        static = False
        if values is not None:
            self.values = values
            static = self.crash(everything, None, True)
        if not static and not self.crash(everything, None, False):
            return
        lo, hi = 0, n - 1  # the end: the shortest crashing prefix [0, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if self.crash(set(range(mid + 1)), None, static):
                hi = mid
            else:
                lo = mid + 1
        end = hi
        if static:  # the start: the latest first node [lo, end] that still crashes
            lo, hi = 0, end
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.crash(set(range(mid, end + 1)), None, True):
                    lo = mid
                else:
                    hi = mid - 1
            first = lo
        else:
            first = 0
        keep = set(range(first, end + 1))
        last_outputs = [t for t in self.graph.nodes[end].output if t]
        if not self.crash(keep, last_outputs, static):
            self.drop_outputs(keep, static)

    def drop_outputs(self, keep: set[int], static: bool) -> None:
        """The outputs: drop each of the range's frontier tensors in turn while it still crashes
        (``polygraphy debug reduce``'s linear pass over the outputs)."""
        sub = self.graph.subgraph(keep, None, self.values if static else None)
        outputs = [o.name for o in sub[0].graph.output] if sub is not None else []
        for tensor in list(outputs):
            rest = [t for t in outputs if t != tensor]
            if rest and self.crash(keep, rest, static):
                outputs = rest


def _probe_values(model: onnx.ModelProto, graph: _Graph, resolved: Sequence[ResolvedProfile],
                  out_dir: Path) -> dict[str, np.ndarray] | None:
    """Every tensor's value in one ONNX Runtime run at the first profile's ``opt`` shapes (random
    floats, integer inputs 1, boolean inputs true); None when the graph does not run so."""
    import onnxruntime as ort

    feeds: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(0)
    opt = resolved[0].shapes if resolved else {}
    for name, vi in graph.inputs.items():
        t = vi.type.tensor_type
        shape = opt[name]["opt"] if name in opt else [d.dim_value for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if t.elem_type in _FLOATS:
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif t.elem_type == TensorProto.BOOL:
            feeds[name] = np.ones(shape, bool)
        else:
            feeds[name] = np.ones(shape, dtype)
    wanted = [t for n in graph.nodes for t in n.output
              if t and graph.types.get(t) in _FLOATS | _INTEGERS and t not in graph.outputs]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_tensor_value_info(t, graph.types[t], None) for t in wanted)
    probe.ir_version = min(probe.ir_version, required_ir(probe)[0])  # lossless; an older ONNX Runtime reads it
    path = _save(probe, out_dir / ".probe.tmp-model.onnx")
    try:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        values = dict(zip(names, sess.run(names, feeds)))
    except Exception as e:  # noqa: BLE001  no fixed-shape reduction; the end is still reduced
        log.warning("bisect: ONNX Runtime could not run the graph at fixed shapes (%s: %s); reducing its end only",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return None
    finally:
        for f in (path, path.with_name(path.name + ".data")):
            f.unlink(missing_ok=True)
    return {**feeds, **values}
