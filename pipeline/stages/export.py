"""Stage 1, export: torch -> ONNX (dynamo exporter, dynamic shapes), then prove
the graph is dynamic by running it at several shapes against torch."""
from __future__ import annotations

import logging
from pathlib import Path

import onnx
import torch

from pipeline import onnx_io
from pipeline.checks import tolerance as compare
from pipeline.checks import export as export_checks
from pipeline.trt import profiles
from pipeline.artifacts import ExportArtifact, TensorSpec
from pipeline.context import StageContext
from pipeline.errors import ExportError
from pipeline.models import registry
from pipeline.recipe.schema import Recipe
from pipeline.ort_sessions import load_session
from pipeline.recipe import precisions

log = logging.getLogger(__name__)

NAME = "export"
NEEDS: tuple[str, ...] = ()
#: the manifest inputs it reads (stage keys): the model file
KEY_INPUTS = ("model_file",)
ARTIFACT = ExportArtifact
#: no TensorRT version in the key: CPU and GPU runners share this stage (remote cache)
ENGINE_FREE = True


def key_sections(r: Recipe) -> list:
    """What of the recipe the export reads: the model, the export section and its check points."""
    points = r.export.check_points or r.build.profiles[0].model_dump(mode="json")
    return [r.model.model_dump(mode="json"), r.export.model_dump(mode="json"), points]


#: The one graph I/O reader (pipeline.onnx_io): kept under this name for callers.
graph_specs = onnx_io.graph_specs


def check_dynamic(inputs: list[TensorSpec], dynamic_axes: dict[str, dict[int, str]]) -> None:
    """Every axis the recipe declares dynamic must be symbolic in the graph.

    Raises:
        ExportError: names the input and the axis that was baked in as a constant.
    """
    by_name = {s.name: s for s in inputs}
    for name, axes in dynamic_axes.items():  # kept for callers holding only TensorSpecs
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

    ``export.check_points`` when given, else min/opt/max of the first profile; then every
    profile's minimum shapes not already among them (the smallest inputs are where index
    arithmetic such as relative-position buckets breaks first).
    """
    rec = ctx.recipe
    dims = rec.build.profiles[0].dims
    points = ([dict(p) for p in rec.export.check_points] if rec.export.check_points
              else [{d: getattr(r, k) for d, r in dims.items()} for k in ("min", "opt", "max")])
    for profile in rec.build.profiles:
        low = {d: r.min for d, r in profile.dims.items()}
        if not any(all(p.get(d) == v for d, v in low.items()) for p in points):
            points.append(low)
    return points


def run(ctx: StageContext) -> ExportArtifact:
    """Export the recipe's model and verify it at >= 3 shapes against torch.

    Raises:
        ExportError: export failed, an axis is static, or ORT disagrees with torch.
        EnvironmentFault: the written ONNX file cannot be loaded back.
    """
    adapter = registry.adapter(ctx.recipe.model)
    loaded = adapter.load(ctx)
    module = loaded.module
    out = ctx.stage_dir / "model.onnx"
    how = "torch.onnx.export(dynamo=True)" if module is not None else f"copy {ctx.recipe.model.source.describe()}"
    with ctx.progress.step(f"export: {how}"):
        with onnx_io.replacing(out) as tmp:  # new files renamed into place, never rewritten
            adapter.export(module, ctx.recipe.export, tmp)
    onnx_io.require_loadable(out, "export")
    model = onnx.load(str(out), load_external_data=False)
    inputs, outputs = graph_specs(model)
    # Static axes, baked Reshapes and unrolled per-sample loops, named (export_checks).
    axes = adapter.dynamic_axes(ctx.recipe.export)
    sizes = export_checks.example_sizes(loaded.example_feeds, axes) if loaded.example_feeds else None
    export_checks.check_symbolic(model, axes, sizes, source=onnx_source(adapter))
    # Profiles must fit the graph before any expensive work (checks, calibration).
    profiles.resolve_profiles(list(ctx.recipe.build.profiles), inputs, set(profiles.shape_tensor_inputs(model)))
    checks = verify_shapes(ctx, adapter, module, out, inputs, model)
    tok_dir = ctx.stage_dir / "tokenizer"
    if loaded.processor is not None:  # a tokenizer or image processor; a generic model may have none
        adapter.save_processor(loaded, tok_dir)
    return ExportArtifact(str(out), inputs, outputs, str(tok_dir), checks)


def verify_shapes(ctx: StageContext, adapter, module, onnx_path: Path, inputs: list[TensorSpec],
                  model: onnx.ModelProto | None = None) -> list[dict]:
    """Run ORT and torch on random feeds at each shape point; compare outputs.

    An ORT failure or a wrong output size is named by input, axis and cause
    (export_checks.run_point). The first point with batch >= 2 is also run with
    a fully masked row in every mask-like input (export_checks.compare_masked_row).

    Returns:
        One report per point; the masked-row report is that point's ``"masked_row"``.

    Raises:
        ExportError: fewer than 3 points, or any fault at a point.
    """
    model = model if model is not None else onnx.load(str(onnx_path), load_external_data=False)
    axes = adapter.dynamic_axes(ctx.recipe.export)
    sess = load_session(onnx_path, onnx_source(adapter))
    points = shape_points(ctx)
    if len(points) < 3:
        raise ExportError(f"export.check_points: need at least 3 shape points, got {len(points)}")
    cfg = ctx.recipe.export
    tol = compare.tolerance(precisions.REFERENCE, (cfg.rtol, cfg.atol) if cfg.rtol and cfg.atol else None)
    per_output = ctx.recipe.export.tolerances
    check_tolerance_patterns(per_output, [o.name for o in model.graph.output])
    results, masked_done = [], False
    for i, point in enumerate(ctx.progress.track(points, "export: shape checks")):
        feeds = adapter.sample_feeds(module, inputs, point, seed=i)
        report = export_checks.run_point(model, sess, axes, feeds, _torch(adapter, module, feeds), tol,
                                         per_output=per_output)
        shapes = {k: list(v.shape) for k, v in feeds.items() if k in ("input_ids", "attention_mask")}
        results.append({"point": point, "shapes": shapes, **report})
        masked, row = export_checks.with_masked_row(feeds)
        if row is not None and not masked_done:
            got = sess.run(None, masked)
            rep = export_checks.compare_masked_row(model, axes, masked, row, _torch(adapter, module, masked), got,
                                                   tol, per_output)
            results[-1]["masked_row"] = rep  # same entry: one report per shape point
            masked_done = True
    return results


def check_tolerance_patterns(patterns, outputs: list[str]) -> None:
    """Every ``export.tolerances`` key (an fnmatch pattern) must match a graph output:
    a misspelt one would leave that output at the default tolerance without a word.

    Raises:
        ExportError: names the patterns that match nothing and the graph's outputs.
    """
    import fnmatch

    unmatched = [p for p in patterns if not fnmatch.filter(outputs, p)]
    if unmatched:
        raise ExportError(f"export.tolerances: {unmatched} match no graph output; the outputs are {outputs} "
                          "(keys are output names or fnmatch patterns such as 'present.*')")


def onnx_source(adapter) -> Path | None:
    """The graph file of an ``onnx:`` model source (verified, not exported), else None."""
    from pipeline.sources.model import OnnxSource

    source = getattr(adapter, "source", None)
    return source.location() if isinstance(source, OnnxSource) else None


def _torch(adapter, module, feeds: dict) -> list:
    """The adapter's torch outputs on ``feeds``, as numpy arrays."""
    with torch.no_grad():
        return [t.numpy() for t in adapter.torch_outputs(module, feeds)]

