"""Export faults in user models, found in the exported graph and named.

Any module works: the checks take the torch module (or a function running it),
its example feeds by input name, the ONNX file and ``dynamic_axes``
(``{input: {axis: dim name}}``). Four faults are caught, each as an
:class:`~pipeline.errors.ExportError` naming the input, the axis, the symbolic
dim and what to change in the model:

* **baked reshape**: ``x.reshape(2, 32)`` / ``x.view(2, -1)`` writes the
  example's batch into a constant shape. Found as a Reshape whose shape is a
  constant with a positive size at a position where its data input carries a
  symbolic dim (shape inference), or, when the exporter already fixed the
  input, the example's size at the dim's axis.
* **per-sample loop**: ``torch.stack([f(x[i]) for i in range(len(x))])``
  unrolls into one Gather/Slice per example row and a Concat of them; the
  exporter then fixes the batch to the example's. Found as constant indices
  ``0..k-1`` taken along a dynamic axis (or along the fixed axis of the
  example's size) and joined back by a ``k``-input Concat.
* **batch-1 example**: an example size of 0 or 1 on a dynamic axis lets the
  exporter specialise that dim (torch's 0/1 specialisation). Refused before
  export by :func:`check_example_sizes`; an axis fixed to 1 after export is
  blamed on it too.
* **fully masked row**: when a model has mask-like inputs (bool, or a name
  containing ``mask``), :func:`with_masked_row` sets one row (index along axis
  0, never the only row) to all zeros/False. :func:`compare_masked_row` then
  decides whether torch and ONNX Runtime *disagree* on that row's outputs:

  - a position finite in one and NaN/Inf in the other *disagrees*: that is
    the fault (e.g. ``scaled_dot_product_attention`` with a float ``-inf``
    mask: torch returns 0 for the row, the exported graph NaN). NaN spreads
    to whatever reads the row: a batch statistic, a reused cache slot, a
    TensorRT reduction;
  - positions non-finite in both are *undefined in both* (a ``softmax`` over
    only ``-inf`` is NaN in torch and ONNX alike) and accepted;
  - positions finite in both but different are accepted and counted
    (``finite_differ``): attention over zero keys has no defined value, and
    torch's SDPA returns 0 where the exported graph (a finite fill) returns
    the mean over the masked keys. A causal LM over past+new tokens is the
    usual case: a row with every past and new position masked is padding.

  The other rows are compared as usual, so a masked row that leaks into the
  rest of the batch is still caught.

Besides, :func:`check_run_shapes` catches a graph that runs at another size but
returns the example's size on an axis it declares symbolic, and
:func:`explain_ort_failure` turns an ONNX Runtime shape error at a check point
into the same named diagnosis.
"""
from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from pipeline.checks import tolerance as compare
from pipeline.errors import ExportError

DynamicAxes = dict[str, dict[int, str]]
Feeds = dict[str, np.ndarray]
RESHAPE_FIX = ("compute the size from the tensor instead of a constant: use x.flatten(1) or "
               "x.reshape(x.shape[0], -1) (x.view(-1, ...) where the dynamic dim is the one inferred)")
LOOP_FIX = ("vectorise the per-sample Python loop (one batched op over the whole tensor, e.g. "
            "torch.vmap or broadcasting) instead of iterating over rows and stacking the results")
EXAMPLE_FIX = "give an example with {dim} >= 2 (sizes 0 and 1 are specialised by the exporter)"
MASK_FIX = ("make the fully masked row well defined: use a large finite negative fill "
            "(torch.finfo(dtype).min) instead of -inf, or zero the row's output explicitly "
            "(e.g. out * mask.any(-1, keepdim=True))")


@dataclass(frozen=True)
class Axis:
    """One declared dynamic axis: ``input``'s ``axis`` is the symbolic dim ``dim``."""

    input: str
    axis: int
    dim: str

    def __str__(self) -> str:
        return f"input {self.input!r} axis {self.axis} ({self.dim})"


def declared(dynamic_axes: DynamicAxes) -> list[Axis]:
    """The declared dynamic axes, in declaration order."""
    return [Axis(n, int(a), d) for n, axes in dynamic_axes.items() for a, d in axes.items()]


def example_sizes(example_feeds: Feeds, dynamic_axes: DynamicAxes) -> dict[str, int]:
    """Size of every dynamic dim in the example feeds: ``{dim name: size}``.

    Raises:
        ExportError: an axis names an input the feeds lack, or an axis beyond its rank.
    """
    sizes: dict[str, int] = {}
    for ax in declared(dynamic_axes):
        if ax.input not in example_feeds:
            raise ExportError(f"export.dynamic_axes: {ax}: the example inputs have no {ax.input!r}; "
                              f"they are {sorted(example_feeds)}")
        shape = np.shape(example_feeds[ax.input])
        if ax.axis >= len(shape):
            raise ExportError(f"export.dynamic_axes: {ax}: the example {ax.input!r} has rank {len(shape)}")
        sizes.setdefault(ax.dim, int(shape[ax.axis]))
    return sizes


def check_example_sizes(example_feeds: Feeds, dynamic_axes: DynamicAxes) -> None:
    """Refuse an example size of 0 or 1 on a dynamic axis (e.g. a batch-1 example).

    Raises:
        ExportError: names the input, axis and dim, and asks for an example size >= 2.
    """
    for ax in declared(dynamic_axes):
        size = np.shape(example_feeds.get(ax.input, np.zeros(0)))
        if ax.input in example_feeds and ax.axis < len(size) and size[ax.axis] < 2:
            raise ExportError(f"export: {ax} has example size {size[ax.axis]}, which the exporter specialises "
                              f"to a constant; {EXAMPLE_FIX.format(dim=ax.dim)}")


# --- graph scans ------------------------------------------------------------------------


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Inline initializers and Constant-node tensors, by name (external data skipped)."""
    out = {}
    for t in graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL and len(t.dims) <= 1:
            out[t.name] = numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    out[n.output[0]] = numpy_helper.to_array(a.t)
    return out


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | str]]:
    """Every tensor's shape known after ONNX shape inference (symbolic dims as names)."""
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # inference is best effort here; the exporter's value_info remains
        pass
    g = model.graph
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*g.input, *g.value_info, *g.output] if v.type.tensor_type.HasField("shape")}


def _axis_of(dim: str | int, shape: list[int | str] | None, pos: int) -> bool:
    return shape is not None and pos < len(shape) and shape[pos] == dim


def baked_reshapes(model: onnx.ModelProto, dynamic_axes: DynamicAxes,
                   sizes: dict[str, int] | None = None) -> list[tuple[Axis, str, list[int]]]:
    """Reshape nodes whose constant shape bakes a dynamic dim: ``[(axis, node name, shape)]``.

    A position ``p`` of a constant shape is baked when its value is > 0 and the
    data input's dim ``p`` is a declared symbolic dim, or (graph already fixed)
    the data input's dim ``p`` equals that dim's example size in ``sizes`` at an
    axis ``p`` that some input declares for it.
    """
    consts, shapes, found = _constants(model.graph), _shapes(model), []
    by_dim = {ax.dim: ax for ax in reversed(declared(dynamic_axes))}
    for node in model.graph.node:
        if node.op_type != "Reshape" or node.input[1] not in consts:
            continue
        target = [int(v) for v in consts[node.input[1]].reshape(-1)]
        data = shapes.get(node.input[0])
        for p, v in enumerate(target):
            q = _aligned(target, data, p)
            for dim, ax in by_dim.items():
                fixed = sizes is not None and sizes.get(dim) == v and ax.axis == q and _axis_of(v, data, q)
                if v > 0 and (_axis_of(dim, data, q) or fixed):
                    found.append((ax, node.name, target))
    return found


def _aligned(target: list[int], data: list[int | str] | None, p: int) -> int:
    """The data axis that position ``p`` of a Reshape's ``target`` keeps: positions after an
    inferred ``-1`` count from the end when the rank changes (``[B, S, 64] -> [-1, 64]``
    flattens B and S into the -1 and keeps 64 as the last axis), all others from the start."""
    if data is None or -1 not in target or len(target) == len(data) or p < target.index(-1):
        return p
    return p + len(data) - len(target)


def _picked_index(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> tuple[int, int] | None:
    """(axis, index) when ``node`` takes one constant row: Gather with a scalar index, or a
    Slice of width 1 on one axis."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Gather" and node.input[1] in consts and consts[node.input[1]].ndim == 0:
        return int(attrs.get("axis", 0)), int(consts[node.input[1]])
    if node.op_type == "Slice" and len(node.input) >= 4 and all(i in consts for i in node.input[1:4]):
        starts, ends, axes = (consts[i].reshape(-1) for i in node.input[1:4])
        if len(axes) == 1 and int(ends[0]) - int(starts[0]) == 1:  # Python ints: INT64_MAX ends cannot overflow
            return int(axes[0]), int(starts[0])
    return None


def unrolled_axes(model: onnx.ModelProto, dynamic_axes: DynamicAxes,
                  sizes: dict[str, int] | None = None) -> list[tuple[Axis, int]]:
    """Dynamic axes a per-sample loop was unrolled over: ``[(axis, rows unrolled)]``.

    Evidence: rows ``0..k-1`` (k >= 2) taken one by one along the same axis of
    tensors whose dim there is the declared symbol (or, graph already fixed, of
    size ``sizes[dim]`` == k), and a Concat of exactly ``k`` inputs along that axis.
    """
    consts, shapes = _constants(model.graph), _shapes(model)
    concats = {(int(onnx.helper.get_attribute_value(a)), len(n.input))
               for n in model.graph.node if n.op_type == "Concat" for a in n.attribute if a.name == "axis"}
    found = []
    for ax in {a.dim: a for a in reversed(declared(dynamic_axes))}.values():
        rows: set[int] = set()
        for node in model.graph.node:
            picked = _picked_index(node, consts)
            data = shapes.get(node.input[0]) if node.input else None
            if picked is None or picked[0] != ax.axis:
                continue
            size = (sizes or {}).get(ax.dim)
            if _axis_of(ax.dim, data, ax.axis) or (size is not None and _axis_of(size, data, ax.axis)):
                rows.add(picked[1])
        k = len(rows)
        if k >= 2 and rows == set(range(k)) and (ax.axis, k) in concats:
            found.append((ax, k))
    return found


def explain(model: onnx.ModelProto, dynamic_axes: DynamicAxes, sizes: dict[str, int] | None = None,
            suspect: Axis | None = None, fixed_to: int | None = None) -> str | None:
    """The named cause of a graph fixed to the example's sizes, or None when none is found.

    Args:
        sizes: example size per dynamic dim, when known.
        suspect: the axis already seen fixed (graph input) or failing.
        fixed_to: the constant that axis was fixed to.
    """
    if suspect is not None and fixed_to is not None and fixed_to <= 1:
        return (f"{suspect} was fixed to {fixed_to}: the example had {suspect.dim}={fixed_to}; "
                + EXAMPLE_FIX.format(dim=suspect.dim))
    if suspect is not None and fixed_to is not None:
        sizes = {**(sizes or {}), suspect.dim: fixed_to}
    for ax, k in unrolled_axes(model, dynamic_axes, sizes):
        if suspect is None or ax.dim == suspect.dim:
            return (f"{ax}: a per-sample loop was unrolled into {k} copies (rows 0..{k - 1} taken one by one "
                    f"and concatenated), so the graph only works for {ax.dim}={k}; {LOOP_FIX}")
    for ax, node, target in baked_reshapes(model, dynamic_axes, sizes):
        if suspect is None or ax.dim == suspect.dim:
            return (f"{ax}: Reshape node {node!r} has the constant shape {target}, which bakes {ax.dim} "
                    f"into a constant; {RESHAPE_FIX}")
    return None


def check_symbolic(model: onnx.ModelProto, dynamic_axes: DynamicAxes,
                   sizes: dict[str, int] | None = None, *, source: str | Path | None = None) -> None:
    """Every declared dynamic axis is symbolic in the graph, and no Reshape or unrolled
    loop bakes one into a constant.

    Args:
        source: the graph file when the model came as ONNX (``model.source.onnx``): a
            fixed input dim is then the graph's own, and the fix is to make it symbolic
            (there is no torch example to blame).

    Raises:
        ExportError: names the input, axis and dim, the cause found and the fix.
    """
    inits = {i.name for i in model.graph.initializer}
    graph_in = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
                for v in model.graph.input if v.name not in inits}
    for ax in declared(dynamic_axes):
        if ax.input not in graph_in:
            raise ExportError(f"export.dynamic_axes: graph has no input {ax.input!r}; inputs are {sorted(graph_in)}")
        got = graph_in[ax.input][ax.axis]
        if not isinstance(got, str) and source is not None:
            raise ExportError(fixed_source_dim(model, dynamic_axes, ax, graph_in[ax.input], source))
        if not isinstance(got, str):
            cause = explain(model, dynamic_axes, sizes, ax, int(got)) or (
                "the exporter specialised it (a shape-dependent branch, a constant size, or an example size "
                f"of 0/1 does this); {EXAMPLE_FIX.format(dim=ax.dim)} and size it from the tensor")
            raise ExportError(f"export: {ax} was baked in as the constant {got}. {cause}")
    cause = explain(model, dynamic_axes, sizes)
    if cause:
        raise ExportError(f"export: {cause}")


def fixed_source_dim(model: onnx.ModelProto, dynamic_axes: DynamicAxes, ax: Axis,
                     shape: list[int | str], source: str | Path) -> str:
    """The message for an ONNX source graph whose input ``ax`` has the fixed size
    ``shape[ax.axis]``: make that dim symbolic in the graph (re-export with dynamic
    axes, or rename it with ``onnx.tools.update_model_dims``); plus any Reshape or
    unrolled loop in the graph that bakes the same size in."""
    fixed = int(shape[ax.axis])
    want = [ax.dim if i == ax.axis else d for i, d in enumerate(shape)]
    msg = (f"export: model.source.onnx {source}: the graph's input {ax.input!r} has the fixed dim {fixed} at "
           f"axis {ax.axis} (shape {shape}), but export.dynamic_axes declares it symbolic ({ax.dim}); make it "
           f"symbolic in the graph: re-export the model with dynamic axes (torch.onnx.export(..., dynamic_axes="
           f"{{{ax.input!r}: {{{ax.axis}: {ax.dim!r}}}}}) or dynamic_shapes), or rename the dim with "
           f"onnx.tools.update_model_dims.update_inputs_outputs_dims(model, {{{ax.input!r}: {want}}}, {{...}}) "
           f"and save the graph again")
    inside = explain(model, dynamic_axes, {ax.dim: fixed}) if fixed > 1 else None
    return f"{msg}. The graph also fixes it inside: {inside}" if inside else msg


# --- runs at other sizes ----------------------------------------------------------------


def explain_ort_failure(model: onnx.ModelProto, dynamic_axes: DynamicAxes, err: Exception,
                        feeds: Feeds, sizes: dict[str, int] | None = None) -> ExportError:
    """An ExportError for ONNX Runtime failing on ``feeds``, naming the axis and node at fault."""
    shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
    cause = explain(model, dynamic_axes, sizes)
    node = re.search(r"Name:'([^']+)'", str(err))
    where = f" in node {node.group(1)!r}" if node else ""
    msg = f"export: ONNX Runtime fails{where} at input shapes {shapes}: {str(err).strip()[:400]}"
    return ExportError(f"{msg}. {cause}" if cause else msg)


def check_run_shapes(model: onnx.ModelProto, dynamic_axes: DynamicAxes, feeds: Feeds,
                     outputs: Sequence[np.ndarray], ref: Sequence[np.ndarray] | None = None,
                     sizes: dict[str, int] | None = None) -> None:
    """ONNX Runtime outputs must have the fed size on every axis the graph declares
    symbolic, and torch's shapes where ``ref`` is given.

    Raises:
        ExportError: names the output, the axis and the dim, plus the cause found in the graph.
    """
    fed = {ax.dim: int(np.shape(feeds[ax.input])[ax.axis]) for ax in declared(dynamic_axes) if ax.input in feeds}
    for i, (spec, got) in enumerate(zip(model.graph.output, outputs)):
        dims = [d.dim_param or d.dim_value for d in spec.type.tensor_type.shape.dim]
        want = list(np.shape(ref[i])) if ref is not None else [fed.get(d, np.shape(got)[a]) if isinstance(d, str)
                                                               else d for a, d in enumerate(dims)]
        if list(np.shape(got)) == want:
            continue
        axis = next((a for a, (g, w) in enumerate(zip(np.shape(got), want)) if g != w), 0)
        dim = dims[axis] if axis < len(dims) else "?"
        cause = explain(model, dynamic_axes, sizes) or "a size was fixed to the example's inside the graph"
        raise ExportError(f"export: output {spec.name!r} axis {axis} ({dim}) has size {np.shape(got)[axis]} "
                          f"instead of {want[axis]} at input shapes { {k: list(np.shape(v)) for k, v in feeds.items()} }. "
                          f"{cause}")


# --- fully masked rows ------------------------------------------------------------------


def mask_inputs(feeds: Feeds) -> list[str]:
    """Mask-like inputs: bool dtype or a name containing ``mask``, rank >= 2."""
    return [k for k, v in feeds.items() if np.ndim(v) >= 2 and (v.dtype == np.bool_ or "mask" in k.lower())]


def with_masked_row(feeds: Feeds) -> tuple[Feeds, int | None]:
    """``feeds`` with the last row (axis 0) of every mask-like input set to zeros/False.

    Returns ``(new feeds, row)``; ``row`` is None (feeds unchanged) when there is
    no mask-like input or a batch below 2 (one row must stay unmasked).
    """
    names = mask_inputs(feeds)
    if not names or min(np.shape(feeds[n])[0] for n in names) < 2:
        return feeds, None
    out = dict(feeds)
    row = min(np.shape(feeds[n])[0] for n in names) - 1
    for n in names:
        out[n] = feeds[n].copy()
        out[n][row] = np.zeros_like(out[n][row])
    return out, row


def _batch_axis(model: onnx.ModelProto, name: str, dim: str | None) -> int | None:
    spec = next((o for o in model.graph.output if o.name == name), None)
    dims = [d.dim_param for d in spec.type.tensor_type.shape.dim] if spec is not None else []
    return dims.index(dim) if dim in dims else None


def compare_masked_row(model: onnx.ModelProto, dynamic_axes: DynamicAxes, masked: Feeds, row: int,
                       ref: Sequence[np.ndarray], got: Sequence[np.ndarray], tol: tuple[float, float],
                       per_output: dict | None = None) -> dict:
    """Compare torch (``ref``) and ORT (``got``) on feeds with the fully masked ``row``.

    Rows other than ``row`` follow the usual comparison (compare.tensor); the
    masked row follows the rule in the module docstring. An output without an
    axis carrying the masks' axis-0 dim is compared as a whole by that rule.

    Returns:
        ``{"row", "masked_inputs", "undefined_in_both", "finite_differ", "passed"}``:
        positions of the masked row NaN/Inf in both, and finite in both but
        beyond ``tol`` apart (both accepted).

    Raises:
        ExportError: the masked row is finite in one and NaN/Inf in the other, or
            another row differs beyond ``tol``; names the mask input, its axis and the output.
    """
    masks = mask_inputs(masked)
    dim = dynamic_axes.get(masks[0], {}).get(0) if masks else None
    undefined = differ = 0
    for spec, r, g in zip(model.graph.output, ref, got):
        rtol, atol = compare.for_output(spec.name, tol, per_output)
        b = _batch_axis(model, spec.name, dim)
        r_row, g_row = (np.take(r, row, axis=b), np.take(g, row, axis=b)) if b is not None else (r, g)
        if b is not None:
            rest = compare.tensor(spec.name, np.delete(r, row, axis=b), np.delete(g, row, axis=b), rtol, atol)
            if not rest["passed"]:
                raise ExportError(f"export: with row {row} of {masks} fully masked, output {spec.name!r} differs "
                                  f"on the other rows: max_abs_err={rest['max_abs_err']:.3g}")
        fr, fg = np.isfinite(r_row), np.isfinite(g_row)
        both = fr & fg
        close = np.abs(r_row[both].astype(np.float64) - g_row[both]) <= atol + rtol * np.abs(r_row[both])
        if (fr != fg).any():
            counts = {"finite in torch, NaN/Inf in ONNX Runtime": int((fr & ~fg).sum()),
                      "NaN/Inf in torch, finite in ONNX Runtime": int((fg & ~fr).sum())}
            detail = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
            raise ExportError(f"export: input {masks[0]!r} axis 1 ({dynamic_axes.get(masks[0], {}).get(1, '?')}) "
                              f"fully masked in row {row} (all of {masks}): torch and ONNX Runtime disagree on "
                              f"output {spec.name!r} row {row}: {detail}; {MASK_FIX}")
        undefined += int((~fr & ~fg).sum())
        differ += int((~close).sum())
    return {"row": row, "masked_inputs": masks, "undefined_in_both": undefined, "finite_differ": differ,
            "passed": True}


# --- the whole verification, for any module ---------------------------------------------


def torch_runner(module, input_names: Sequence[str]) -> Callable[[Feeds], list[np.ndarray]]:
    """Run ``module`` on feeds passed positionally in ``input_names`` order, under no_grad.

    Returns float/int numpy outputs (a single tensor becomes a one-element list).
    """
    import torch

    def run(feeds: Feeds) -> list[np.ndarray]:
        with torch.no_grad():
            out = module(*(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in input_names))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [o.detach().numpy() for o in outs]

    return run


def resized(feeds: Feeds, dynamic_axes: DynamicAxes, dim: str, size: int) -> Feeds:
    """``feeds`` with every axis named ``dim`` grown or cut to ``size`` (rows repeated cyclically)."""
    out = dict(feeds)
    for ax in declared(dynamic_axes):
        if ax.dim == dim and ax.input in out:
            n = np.shape(out[ax.input])[ax.axis]
            out[ax.input] = np.take(out[ax.input], np.arange(size) % n, axis=ax.axis)
    return out


def verify_export(module, example_feeds: Feeds, onnx_path: str | Path, dynamic_axes: DynamicAxes, *,
                  run_torch: Callable[[Feeds], Sequence[np.ndarray]] | None = None,
                  tol: tuple[float, float] = (1e-4, 1e-4)) -> list[dict]:
    """Check an exported module for the four faults and compare ORT with torch.

    Sizes probed: every dynamic dim, one at a time, at example + 1 and 2 x example
    (a probe where torch itself fails, e.g. a sequence bound to a past length, is
    skipped); then the example with a fully masked row when there are mask inputs.

    Args:
        module: the torch module (run positionally in graph input order unless ``run_torch``).
        example_feeds: the export example, numpy arrays by input name.
        dynamic_axes: ``{input: {axis: dim name}}``.

    Returns:
        One report per run: ``{"dims": {dim: size}, "passed": True, ...}``.

    Raises:
        ExportError: any fault, naming the input, axis and dim and the fix.
    """
    from pipeline.ort_sessions import ort_session

    check_example_sizes(example_feeds, dynamic_axes)
    sizes = example_sizes(example_feeds, dynamic_axes)
    model = onnx.load(str(onnx_path), load_external_data=False)
    check_symbolic(model, dynamic_axes, sizes)
    sess = ort_session(str(onnx_path))
    names = [i.name for i in sess.get_inputs()]
    run_torch = run_torch or torch_runner(module, names)
    reports = []
    for dim, size in sizes.items():
        for new in (size + 1, 2 * size):
            feeds = resized(example_feeds, dynamic_axes, dim, new)
            try:
                ref = [np.asarray(r) for r in run_torch(feeds)]
            except Exception:  # torch refuses this probe alone (dims tied together): not the graph's fault
                continue
            reports.append(run_point(model, sess, dynamic_axes, feeds, ref, tol, sizes) | {"dims": {dim: new}})
    masked, row = with_masked_row(example_feeds)
    if row is not None:
        ref = [np.asarray(r) for r in run_torch(masked)]
        got = sess.run(None, {n: masked[n] for n in names})
        reports.append(compare_masked_row(model, dynamic_axes, masked, row, ref, got, tol) | {"dims": sizes})
    return reports


def run_point(model: onnx.ModelProto, sess, dynamic_axes: DynamicAxes, feeds: Feeds, ref: Sequence[np.ndarray],
              tol: tuple[float, float], sizes: dict[str, int] | None = None, per_output: dict | None = None) -> dict:
    """Run ORT on ``feeds``; check shapes and values against torch's ``ref``.

    Returns:
        compare.outputs's report.

    Raises:
        ExportError: ORT fails, an output has the wrong size (named axis and cause),
            or values differ beyond ``tol``.
    """
    try:
        got = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    except Exception as e:  # onnxruntime raises its own exception types
        raise explain_ort_failure(model, dynamic_axes, e, feeds, sizes) from e
    check_run_shapes(model, dynamic_axes, feeds, got, ref, sizes)
    report = compare.outputs(list(ref), got, [o.name for o in sess.get_outputs()], *tol, per_output=per_output)
    if not report["passed"]:
        shapes = {k: list(np.shape(v)) for k, v in feeds.items()}
        raise ExportError(f"export: ONNX Runtime disagrees with torch at input shapes {shapes}: {report['worst']}")
    return report


def export_module(module, example_feeds: Feeds, dynamic_axes: DynamicAxes, out: str | Path, opset: int = 19,
                  output_names: Sequence[str] | None = None) -> None:
    """torch.onnx.export(dynamo=True) of any module, as the export stage's adapters do it:
    inputs positional in ``example_feeds`` order, one ``torch.export.Dim(name, min=1,
    max=8192)`` per dim name (shared across inputs).

    Raises:
        ExportError: an example size is 0/1 on a dynamic axis, or the exporter failed.
    """
    import torch

    check_example_sizes(example_feeds, dynamic_axes)
    dims: dict[str, torch.export.Dim] = {}
    shapes = {n: {a: dims.setdefault(d, torch.export.Dim(d, min=1, max=8192))
                  for a, d in dynamic_axes.get(n, {}).items()} or None for n in example_feeds}
    args = tuple(torch.from_numpy(v) for v in example_feeds.values())
    try:
        with quiet_export():
            torch.onnx.export(module, args, str(out), dynamo=True, dynamic_shapes=tuple(shapes.values()),
                              input_names=list(example_feeds), output_names=list(output_names or []) or None,
                              opset_version=opset, external_data=False, verbose=False)
    except Exception as e:  # the exporter raises many types; keep its text
        raise ExportError(f"export: torch.onnx.export failed: {type(e).__name__}: {e}") from e


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Silence the exporter's chatter (deprecation warnings, missing-torchvision notes,
    step banners) inside the block; errors still raise. Mutes torch.onnx's logger below
    ERROR, Python warnings and stdout."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(None):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
