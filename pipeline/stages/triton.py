"""Stage 5, triton: write the Triton model repository (see pipeline.triton)."""
from __future__ import annotations

import json
from pathlib import Path

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, TritonArtifact
from pipeline.context import StageContext
from pipeline.errors import TritonConfigError
from pipeline.recipe import Recipe


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, b: BuildArtifact) -> TritonArtifact:
    """Publish ``recipe.output_dir`` atomically; every config is checked against its model.

    Raises:
        TritonConfigError: a config disagrees with its model, or the engine's
            stamp does not match this machine and recipe.
    """
    from pipeline.triton.repository import write_repository

    if b.status == "ok":
        check_engine(ctx.recipe, b)
    with ctx.progress.step(f"triton: write {ctx.recipe.output_dir}/"):
        return write_repository(ctx.recipe, export=exp, quantized=q, build=b, out_dir=Path(ctx.recipe.output_dir))


def check_engine(recipe: Recipe, b: BuildArtifact, *, tensorrt_version: str | None = None,
                 compute_capability: str | None = None) -> None:
    """Refuse to deploy an engine whose stamp (TensorRT version, compute
    capability, recipe hash) does not match the target. The target defaults to
    this machine's TensorRT and GPU 0.

    Raises:
        TritonConfigError: one line per mismatch.
    """
    from pipeline.stages import build

    if b.stamp_path is None or not Path(b.stamp_path).is_file():
        raise TritonConfigError(f"engine {b.engine_path}: no engine_stamp.json beside it; rebuild the engine")
    stamp = json.loads(Path(b.stamp_path).read_text())
    problems = build.check_stamp(
        stamp,
        tensorrt_version=tensorrt_version or build.tensorrt_version(),
        compute_capability=compute_capability or build.gpu_info()[0],
        recipe_hash=recipe.engine_hash,
    )
    if problems:
        raise TritonConfigError(f"engine {b.engine_path} refused for deployment:\n  " + "\n  ".join(problems))
