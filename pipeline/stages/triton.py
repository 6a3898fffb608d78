"""Stage 5, triton: write the Triton model repository (see pipeline.triton)."""
from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, TritonArtifact
from pipeline.context import StageContext


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, b: BuildArtifact) -> TritonArtifact:
    """Publish ``recipe.output_dir`` atomically; every config is checked against its model."""
    from pipeline.triton.repository import write_repository

    with ctx.progress.step(f"triton: write {ctx.recipe.output_dir}/"):
        return write_repository(ctx.recipe, export=exp, quantized=q, build=b, out_dir=Path(ctx.recipe.output_dir))
