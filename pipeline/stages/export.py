"""Stage 1, export: torch -> ONNX (dynamo exporter, dynamic shapes), then prove
the graph is dynamic by running it at several shapes against torch."""
from __future__ import annotations

import logging
from pathlib import Path

import onnx
import torch

from pipeline import compare, onnx_io, profiles
from pipeline.artifacts import ExportArtifact, TensorSpec
from pipeline.context import StageContext
from pipeline.errors import ExportError
from pipeline.models import registry
from pipeline.runtime import ort_session

log = logging.getLogger(__name__)


def graph_specs(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs and outputs of an ONNX graph as TensorSpecs (symbolic dims as names)."""

    def spec(v: onnx.ValueInfoProto) -> TensorSpec:
        t = v.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        dims: list[int | str] = [d.dim_param or d.dim_value for d in t.shape.dim]
        return TensorSpec(v.name, dtype, dims)

    inits = {i.name for i in model.graph.initializer}
    ins = [spec(v) for v in model.graph.input if v.name not in inits]
    return ins, [spec(v) for v in model.graph.output]


def check_dynamic(inputs: list[TensorSpec], dynamic_axes: dict[str, dict[int, str]]) -> None:
    """Every axis the recipe declares dynamic must be symbolic in the graph.

    Raises:
        ExportError: names the input and the axis that was baked in as a constant.
    """
    by_name = {s.name: s for s in inputs}
    for name, axes in dynamic_axes.items():
        if name not in by_name:
            raise ExportError(f"export.dynamic_axes: graph has no input {name!r}; inputs are {sorted(by_name)}")
        for axis, dim in axes.items():
            got = by_name[name].shape[axis]
            if not isinstance(got, str):
                raise ExportError(
                    f"export: input {name!r} axis {axis} ({dim}) was baked in as the constant {got}; "
                    "the exporter specialised it (an example size of 0/1 or a shape-dependent branch does this)"
                )


def shape_points(ctx: StageContext) -> list[dict[str, int]]:
    """Shape points (symbolic dim -> size) for the export check.

    ``export.check_points`` when given, else min/opt/max of the first profile.
    """
    rec = ctx.recipe
    if rec.export.check_points:
        return [dict(p) for p in rec.export.check_points]
    dims = rec.build.profiles[0].dims
    return [{d: getattr(r, k) for d, r in dims.items()} for k in ("min", "opt", "max")]


def run(ctx: StageContext) -> ExportArtifact:
    """Export the recipe's model and verify it at >= 3 shapes against torch.

    Raises:
        ExportError: export failed, an axis is static, or ORT disagrees with torch.
        EnvironmentFault: the written ONNX file cannot be loaded back.
    """
    adapter = registry.adapter(ctx.recipe.model)
    module, tokenizer = adapter.load(ctx)
    out = ctx.stage_dir / "model.onnx"
    with ctx.progress.step("export: torch.onnx.export(dynamo=True)"):
        with onnx_io.replacing(out) as tmp:  # new files renamed into place, never rewritten
            adapter.export(module, ctx.recipe.export, tmp)
    onnx_io.require_loadable(out, "export")
    model = onnx.load(str(out), load_external_data=False)
    inputs, outputs = graph_specs(model)
    check_dynamic(inputs, adapter.dynamic_axes(ctx.recipe.export))
    # Profiles must fit the graph before any expensive work (checks, calibration).
    profiles.resolve_profiles(list(ctx.recipe.build.profiles), inputs, set(profiles.shape_tensor_inputs(model)))
    checks = verify_shapes(ctx, adapter, module, out, inputs)
    tok_dir = ctx.stage_dir / "tokenizer"
    tokenizer.save_pretrained(str(tok_dir))
    return ExportArtifact(str(out), inputs, outputs, str(tok_dir), checks)


def verify_shapes(ctx: StageContext, adapter, module, onnx_path: Path, inputs: list[TensorSpec]) -> list[dict]:
    """Run ORT and torch on random feeds at each shape point; compare outputs."""


    sess = ort_session(str(onnx_path))
    points = shape_points(ctx)
    if len(points) < 3:
        raise ExportError(f"export.check_points: need at least 3 shape points, got {len(points)}")
    cfg = ctx.recipe.export
    tol = compare.tolerance("fp32", (cfg.rtol, cfg.atol) if cfg.rtol and cfg.atol else None)
    results = []
    for i, point in enumerate(ctx.progress.track(points, "export: shape checks")):
        feeds = adapter.sample_feeds(module, inputs, point, seed=i)
        with torch.no_grad():
            ref = [t.numpy() for t in adapter.torch_outputs(module, feeds)]
        got = sess.run(None, feeds)
        report = compare.outputs(ref, got, [o.name for o in sess.get_outputs()], *tol,
                                 per_output=ctx.recipe.export.tolerances)
        shapes = {k: list(v.shape) for k, v in feeds.items() if k in ("input_ids", "attention_mask")}
        results.append({"point": point, "shapes": shapes, **report})
        if not report["passed"]:
            raise ExportError(f"export: ONNX Runtime disagrees with torch at {point}: {report['worst']}")
    return results

