"""Stage 5, triton: write the Triton model repository (see pipeline.triton)."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, TritonArtifact
from pipeline.context import StageContext
from pipeline.errors import TritonConfigError
from pipeline.recipe import Recipe

if TYPE_CHECKING:
    from pipeline.serving import Target

log = logging.getLogger(__name__)


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, b: BuildArtifact) -> TritonArtifact:
    """Publish ``recipe.output_dir`` atomically; every config is checked against its model.

    Raises:
        TritonConfigError: a config disagrees with its model, or the engine's
            stamp does not match the declared serving runtime and the recipe.
    """
    from pipeline.triton.repository import write_repository

    warnings = check_engine(ctx.recipe, b) if b.status == "ok" else []
    for warning in warnings:
        log.warning("triton: %s", warning)
        ctx.progress.print(f"[yellow]warning[/yellow] triton: engine {b.engine_path}: {warning}")
    with ctx.progress.step(f"triton: write {ctx.recipe.output_dir}/"):
        art = write_repository(ctx.recipe, export=exp, quantized=q, build=b, out_dir=Path(ctx.recipe.output_dir))
    return dataclasses.replace(art, warnings=warnings)


def check_engine(recipe: Recipe, b: BuildArtifact, *, target: Target | None = None) -> list[str]:
    """Refuse to deploy an engine whose stamp (TensorRT version, compute
    capability, GPU model, recipe hash) does not match the DECLARED serving
    target, ``recipe.triton.serving`` (or ``target`` where given), not this
    machine's tensorrt package.

    Returns:
        Warnings, e.g. a different GPU model with the same compute capability.

    Raises:
        TritonConfigError: no stamp, no declared serving runtime, or one line
            per mismatch.
    """
    from pipeline import serving
    from pipeline.stages import build

    if b.stamp_path is None or not Path(b.stamp_path).is_file():
        raise TritonConfigError(f"engine {b.engine_path}: no engine_stamp.json beside it; rebuild the engine")
    if target is None:
        if recipe.triton.serving is None:
            raise TritonConfigError(
                f"engine {b.engine_path}: recipe triton.serving is not declared, so there is no serving runtime to "
                "check the engine stamp against; declare the Triton container (or TensorRT version) and GPU model"
            )
        target = serving.declared_target(recipe.triton.serving)
    stamp = json.loads(Path(b.stamp_path).read_text())
    result = build.check_stamp(stamp, target, recipe.engine_hash)
    if result.errors:
        raise TritonConfigError(
            f"engine {b.engine_path} refused for deployment:\n  " + "\n  ".join(result.errors + result.warnings)
        )
    return result.warnings
