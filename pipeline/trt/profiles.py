"""Optimization profiles: recipe ``build.profiles`` resolved against the graph's inputs.

A recipe profile names ranges per *symbolic dimension* (``batch``,
``sequence``, ``past_sequence``, ``total_sequence``...) and, optionally, whole
per-input shape ranges. TensorRT wants per-input min/opt/max shapes; this
module turns the first into the second and rejects anything that would only
fail later inside the TensorRT builder, naming the profile, input and axis.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Iterable

import onnx

from pipeline.artifacts import ResolvedProfile, TensorSpec
from pipeline.errors import ProfileError
from pipeline.recipe.schema import DimRange, Profile, ShapeRange

KINDS = ("min", "opt", "max")

# op_type -> indices of inputs whose *values* become a shape, size, count or index range.
SHAPE_CONSUMERS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,),
    "Expand": (1,),
    "Tile": (1,),
    "Slice": (1, 2, 3, 4),
    "ConstantOfShape": (0,),
    "Range": (0, 1, 2),
    "TopK": (1,),
    "Resize": (2, 3),
    "Upsample": (1,),
    "Pad": (1,),
    "Split": (1,),
    "Squeeze": (1,),
    "Unsqueeze": (1,),
    "OneHot": (1,),
}
# Ops through which a value keeps feeding the shape computation (all their inputs).
_PASS_THROUGH = {"Cast", "Concat", "Unsqueeze", "Squeeze", "Identity", "Gather",
                 "Add", "Sub", "Mul", "Div", "Max", "Min"}
# Ops whose *data* input passes through (their other inputs are shape inputs themselves).
_DATA_ONLY = {"Unsqueeze", "Squeeze"}


def shape_tensor_inputs(model: onnx.ModelProto) -> list[str]:
    """Graph inputs whose values (not shapes) flow into a shape-consuming input.

    Walks back from every shape-like operand (Reshape's shape, Expand's shape,
    Tile repeats, Slice starts/ends/axes/steps, ConstantOfShape, Range, TopK k,
    Resize scales/sizes, Pad pads, Split sizes, Squeeze/Unsqueeze axes, OneHot
    depth) through Cast, Concat, Unsqueeze, Squeeze, Identity, Gather and
    integer arithmetic (Add/Sub/Mul/Div/Max/Min). ``Shape``/``Size`` stop the
    walk: they read a tensor's shape, not its values. Top-level graph only.

    Returns:
        Names of such graph inputs (initializers excluded), in graph order.
    """
    graph = model.graph
    inits = {i.name for i in graph.initializer}
    inputs = [v.name for v in graph.input if v.name not in inits]
    producer = {out: node for node in graph.node for out in node.output}
    seeds = [
        node.input[i]
        for node in graph.node
        for i in SHAPE_CONSUMERS.get(node.op_type, ())
        if i < len(node.input) and node.input[i]
    ]
    reached = _walk_back(seeds, producer)
    return [name for name in inputs if name in reached]


def _walk_back(seeds: Iterable[str], producer: dict[str, onnx.NodeProto]) -> set[str]:
    """Tensor names reachable backwards from ``seeds`` through pass-through ops."""
    seen: set[str] = set()
    stack = list(seeds)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None or node.op_type not in _PASS_THROUGH:
            continue
        operands = node.input[:1] if node.op_type in _DATA_ONLY else node.input
        stack.extend(x for x in operands if x)
    return seen


def resolve_profiles(
    profiles: list[Profile],
    inputs: list[TensorSpec],
    shape_tensors: Collection[str] = (),
) -> list[ResolvedProfile]:
    """Per-input min/opt/max shapes for every recipe profile.

    Args:
        profiles: ``recipe.build.profiles``.
        inputs: graph inputs; ``shape`` holds ints (static sizes) or str
            (symbolic dim names). An int below 1 is taken as an unknown size
            (ONNX dims with neither a value nor a name come out as 0).
        shape_tensors: graph inputs whose values feed shapes (see
            :func:`shape_tensor_inputs`).

    Returns:
        One :class:`ResolvedProfile` per profile, in order; ``shapes`` holds
        every graph input (static ones too) as ``{"min"|"opt"|"max": [int, ...]}``
        and ``dims`` the symbolic dim ranges the profile defines.

    Raises:
        ProfileError: a profile names an input the graph lacks; a dynamic axis
            has neither a ``dims`` entry nor an explicit shape; an explicit shape
            has the wrong rank or contradicts a static size; a ``dims`` key is
            used by no input; or an input is a shape tensor (needs value ranges,
            which recipes cannot express).
    """
    return [_resolve_one(p, inputs, set(shape_tensors)) for p in profiles]


def _resolve_one(profile: Profile, inputs: list[TensorSpec], shape_tensors: set[str]) -> ResolvedProfile:
    _check_input_names(profile, inputs)
    _check_shape_tensors(profile, inputs, shape_tensors)
    shapes: dict[str, dict[str, list[int]]] = {}
    for spec in inputs:
        explicit = profile.inputs.get(spec.name)
        if explicit is not None:
            shapes[spec.name] = _explicit_shape(profile, spec, explicit)
        else:
            shapes[spec.name] = _shape_from_dims(profile, spec)
    _check_unused_dims(profile, inputs)
    dims = {name: {k: getattr(r, k) for k in KINDS} for name, r in profile.dims.items()}
    return ResolvedProfile(name=profile.name, shapes=shapes, dims=dims)


def _where(profile: Profile, spec: TensorSpec, axis: int | None = None) -> str:
    at = f"build.profiles[{profile.name!r}]: input {spec.name!r} {_show(spec.shape)}"
    return at if axis is None else f"{at} axis {axis}"


def _show(shape: list[int | str]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _is_unknown(dim: int | str) -> bool:
    return isinstance(dim, int) and dim < 1


def _check_input_names(profile: Profile, inputs: list[TensorSpec]) -> None:
    known = [s.name for s in inputs]
    for name in profile.inputs:
        if name not in known:
            raise ProfileError(
                f"build.profiles[{profile.name!r}].inputs: the graph has no input {name!r}; "
                f"its inputs are {known}"
            )


def _check_shape_tensors(profile: Profile, inputs: list[TensorSpec], shape_tensors: set[str]) -> None:
    for spec in inputs:
        if spec.name in shape_tensors:
            raise ProfileError(
                f"{_where(profile, spec)} is a shape tensor: its values feed a shape "
                "(Reshape/Expand/Slice/Range/...). TensorRT needs min/opt/max *value* ranges for "
                "such an input (IOptimizationProfile::setShapeValues, set_shape_input in Python), "
                "which this tool does not support; a shape range in profile.inputs is not enough. "
                "Re-export so that value is computed inside the graph (e.g. from Shape of another input)"
            )


def _explicit_shape(profile: Profile, spec: TensorSpec, rng: ShapeRange) -> dict[str, list[int]]:
    if len(rng.min) != len(spec.shape):
        raise ProfileError(
            f"build.profiles[{profile.name!r}].inputs[{spec.name!r}]: shape has rank {len(rng.min)} "
            f"but the graph input {_show(spec.shape)} has rank {len(spec.shape)}"
        )
    for axis, dim in enumerate(spec.shape):
        if isinstance(dim, int) and not _is_unknown(dim):
            got = [rng.min[axis], rng.opt[axis], rng.max[axis]]
            if got != [dim, dim, dim]:
                raise ProfileError(
                    f"build.profiles[{profile.name!r}].inputs[{spec.name!r}] axis {axis}: "
                    f"min/opt/max {got[0]}/{got[1]}/{got[2]} contradict the static size {dim} "
                    f"of graph input {_show(spec.shape)}; use {dim} for min, opt and max"
                )
    return {"min": list(rng.min), "opt": list(rng.opt), "max": list(rng.max)}


def _shape_from_dims(profile: Profile, spec: TensorSpec) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {k: [] for k in KINDS}
    for axis, dim in enumerate(spec.shape):
        rng = _axis_range(profile, spec, axis, dim)
        for k in KINDS:
            out[k].append(rng[k])
    return out


def _axis_range(profile: Profile, spec: TensorSpec, axis: int, dim: int | str) -> dict[str, int]:
    if isinstance(dim, str):
        r: DimRange | None = profile.dims.get(dim)
        if r is None:
            raise ProfileError(
                f"{_where(profile, spec, axis)} is dynamic ({dim!r}) but the profile has no "
                f"dims entry {dim!r} (it has {sorted(profile.dims)}); add "
                f"dims.{dim}: {{min, opt, max}} or an explicit shape under inputs.{spec.name}"
            )
        return {"min": r.min, "opt": r.opt, "max": r.max}
    if _is_unknown(dim):
        raise ProfileError(
            f"{_where(profile, spec, axis)} has neither a static size nor a symbolic name "
            f"(size {dim}); give it a name in export.dynamic_axes or an explicit shape "
            f"under build.profiles[{profile.name!r}].inputs.{spec.name}"
        )
    return {"min": dim, "opt": dim, "max": dim}


def _check_unused_dims(profile: Profile, inputs: list[TensorSpec]) -> None:
    in_graph = {d for s in inputs for d in s.shape if isinstance(d, str)}
    from_dims = {d for s in inputs if s.name not in profile.inputs for d in s.shape if isinstance(d, str)}
    for name in profile.dims:
        if name not in in_graph:
            raise ProfileError(
                f"build.profiles[{profile.name!r}].dims: no graph input uses the dim {name!r}; "
                f"the graph's symbolic dims are {sorted(in_graph)}"
            )
        if name not in from_dims:
            users = sorted(s.name for s in inputs if name in s.shape)
            raise ProfileError(
                f"build.profiles[{profile.name!r}].dims: {name!r} has no effect: every input "
                f"using it ({users}) has an explicit shape in profile.inputs; remove one or the other"
            )


def sample_shapes(resolved: ResolvedProfile, n: int = 3) -> list[dict[str, list[int]]]:
    """``n`` shape points spread over a resolved profile, each ``{input: shape}``.

    Points are taken at fractions ``t`` of the range, piecewise linear through
    min (t=0), opt (t=0.5) and max (t=1): n=1 gives opt, n=2 min and max, n=3
    min, opt and max; larger n add points in between, rounded half up. The
    interpolation runs on the *symbolic dims* (``resolved.dims``), so a dim
    name has the same size in every input at a given point; static axes stay
    fixed and explicit per-input axes are interpolated the same way.

    An axis is matched to a dim by its (min, opt, max) range; two dims with
    identical ranges interpolate identically, so the match cannot break
    consistency. Relations *between* dims (``total_sequence = past_sequence +
    sequence``) hold at min/opt/max only if the recipe's ranges satisfy them,
    and are not enforced at interpolated points: that is the caller's concern.

    Raises:
        ValueError: ``n`` is below 1.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ts = [0.5] if n == 1 else [i / (n - 1) for i in range(n)]
    by_range = {(r["min"], r["opt"], r["max"]): name for name, r in resolved.dims.items()}
    points = []
    for t in ts:
        dims = {name: _interpolate(r["min"], r["opt"], r["max"], t) for name, r in resolved.dims.items()}
        points.append({name: _sample_input(s, t, dims, by_range) for name, s in resolved.shapes.items()})
    return points


def _sample_input(
    shape: dict[str, list[int]], t: float, dims: dict[str, int], by_range: dict[tuple[int, int, int], str]
) -> list[int]:
    out = []
    for lo, opt, hi in zip(shape["min"], shape["opt"], shape["max"]):
        dim = by_range.get((lo, opt, hi))
        out.append(dims[dim] if dim is not None else _interpolate(lo, opt, hi, t))
    return out


def _interpolate(lo: int, opt: int, hi: int, t: float) -> int:
    """Piecewise-linear lo (t=0) -> opt (t=0.5) -> hi (t=1), rounded half up."""
    value = lo + (opt - lo) * 2 * t if t <= 0.5 else opt + (hi - opt) * (2 * t - 1)
    return math.floor(value + 0.5)
