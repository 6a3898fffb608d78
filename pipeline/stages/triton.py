"""Stage 5, triton: write the Triton model repository (see pipeline.triton)."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, TritonArtifact
from pipeline.context import RunStart, StageContext
from pipeline.errors import TritonConfigError
from pipeline.recipe.schema import Recipe

if TYPE_CHECKING:
    from pipeline.targets import Target

log = logging.getLogger(__name__)

NAME = "triton"
NEEDS = ("export", "quantize", "build")
#: reads no manifest input of its own (its files come from the stages it needs)
KEY_INPUTS: tuple[str, ...] = ()
ARTIFACT = TritonArtifact
#: runs only when every earlier verdict passed: a failed accuracy gate publishes nothing
GATED = True


def key_sections(r: Recipe) -> list:
    """What of the recipe the repository reads: the triton section, the kind and the generation
    settings the served model uses. ``output_dir`` is no key part: a cached stage counts only
    where it published into the recipe's output_dir (:func:`cached_problems`)."""
    return [r.triton.model_dump(mode="json"), r.model.kind,
            r.validate_.generation and r.validate_.generation.model_dump()]


def key_extra(ctx: StageContext) -> dict:
    """The serving pin beside the recipe (:mod:`pipeline.triton.pin`), by its bytes' digest: a new
    pin republishes (whether it applies is decided when the stage runs, and reported)."""
    from pipeline.triton import pin

    return {"serving_pin": pin.file_key(ctx.recipe_path, ctx.recipe.name)}


def serving_pin(recipe: Recipe, recipe_path, q: QuantizedArtifact, b: BuildArtifact, target: str):
    """:func:`pipeline.triton.pin.lookup` for the repository of ``target`` about to be written.

    Raises:
        RecipeError: (exit 2) the pin file is not a valid serving pin.
    """
    from pipeline.models import registry
    from pipeline.recipe.kinds import facts as kind_facts
    from pipeline.triton import pin

    adapter = registry.adapter(recipe.model)
    generate = adapter.front_model(recipe) if kind_facts(adapter.kind).generates else None
    return pin.lookup(recipe, recipe_path, pin.served_graphs(recipe, q, b, target),
                      pin.runtimes_of(recipe, target, generate))


def cached_problems(art: TritonArtifact, recipe: Recipe) -> list[str]:
    """Why a cached repository no longer counts (empty: it does): it must be the recipe's
    output_dir, and its models still assigned to this recipe in repository.json and
    byte-identical to what it published."""
    from pipeline.triton import publish

    if Path(art.repository).resolve() != Path(recipe.output_dir).resolve():
        return [f"published into {art.repository}, but output_dir is now {recipe.output_dir}"]
    return publish.verify_repository(Path(art.repository), art.models, recipe=recipe.name)


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, b: BuildArtifact) -> TritonArtifact:
    """Publish ``recipe.output_dir`` atomically; every config is checked against its model.

    Raises:
        ModelOwnedElsewhere: ``repository.json`` in ``output_dir`` assigns one of the
            recipe's model names to another recipe (checked before anything is written).
        TritonConfigError: a config disagrees with its model, or the engine's
            stamp does not match the declared serving runtime and the recipe.
    """
    from pipeline.triton.repository import repository_runtime

    check_names_free(ctx.recipe)
    warnings = check_engine(ctx.recipe, b) if b.plan_path is not None else []
    found = serving_pin(ctx.recipe, ctx.recipe_path, q, b, repository_runtime(ctx.recipe.triton.target, b))
    if found.pinned is not None or found.applies:
        ctx.progress.print(f"  triton: {found.describe()}")
    if found.pinned is not None and not found.applies and not found.serve_only:
        warnings.append(found.reason)  # a pin for other graphs or another hardware class: named, never applied
    for warning in warnings:
        log.warning("triton: %s", warning)
        ctx.progress.print(f"[yellow]warning[/yellow] triton: engine {b.engine_path}: {warning}")
    with ctx.progress.step(f"triton: write {ctx.recipe.output_dir}/"):
        art = write_repository(ctx.recipe, export=exp, quantized=q, build=b, out_dir=Path(ctx.recipe.output_dir),
                               pinned=found.pinned["chosen"] if found.applies and found.pinned else None)
    return dataclasses.replace(art, warnings=warnings)


def write_repository(
    recipe: Recipe,
    *,
    export: ExportArtifact,
    quantized: QuantizedArtifact,
    build: BuildArtifact,
    out_dir: Path,
    compute_only: bool = False,
    pinned: dict | None = None,
) -> TritonArtifact:
    """Write, check and publish the Triton model repository for ``recipe``.

    The compute model serves ``quantized.onnx_path`` (or ``build.engine_path``
    for target ``tensorrt``); the kind's adapter adds its own models
    (:meth:`pipeline.models.base.ModelAdapter.triton_models`: text-generation recipes with
    ``triton.generate_model_name`` the decoupled generation model, sentence-embedding
    recipes a tokenizer model and an ensemble). ``compute_only``: the compute
    model alone (bench variants). ``pinned``: a serving pin's ``chosen`` values
    (:func:`pipeline.triton.pin.apply`), written into the configs; repository.json keeps the
    recipe's own hash.

    Raises:
        TritonConfigError: target ``tensorrt`` without an engine; a config that
            fails :func:`pipeline.triton.config.check_config`; a config.pbtxt that does not parse back
            to the same message; missing tokenizer.json or EOS id; a KV layout
            the compute graph does not match; an encoder graph input the
            tokenizer model cannot make, or no pad token. The published repository (if any)
            is unchanged in all these cases.
    """
    from pipeline.triton.repository import repository_runtime

    target = repository_runtime(recipe.triton.target, build)
    if recipe.triton.generate_model_name == recipe.triton.model_name:
        raise TritonConfigError(
            f"triton.generate_model_name: {recipe.triton.model_name!r} is also triton.model_name; "
            "the two models need different names"
        )
    from pipeline.models import registry
    from pipeline.triton import repository

    from pipeline.triton import pin

    out_dir = Path(out_dir)
    configured = pin.apply(recipe, pinned) if pinned else recipe
    with repository.staging_folder(out_dir, recipe.name) as staging:
        models = [repository.stage_compute(configured, target, quantized, build, staging)]
        if not compute_only:  # the kind's own models: generation, tokenizer + ensemble, ... (its adapter)
            models += registry.adapter(recipe.model).triton_models(configured, export, models[0], build, staging)
        repository.check_and_publish(recipe, target, models, build, staging, out_dir)
    backend = models[0].config.platform or models[0].config.backend
    return TritonArtifact(repository=str(out_dir), models=[m.config.name for m in models], compute_backend=backend)


def model_names(recipe: Recipe) -> dict[str, str]:
    """The model names ``recipe`` publishes -> the recipe field that sets each: the
    compute model, then its kind's own models (:meth:`ModelAdapter.served_models`)."""
    from pipeline.models import registry

    names = {recipe.triton.model_name: "triton.model_name"}
    for name in registry.adapter(recipe.model).served_models(recipe):
        field = "triton.generate_model_name" if name == recipe.triton.generate_model_name else \
            f"triton.model_name (which names {name!r})"
        names.setdefault(name, field)
    return names


def check_names_free(recipe: Recipe) -> None:
    """Refuse, before any work, a recipe whose model names ``repository.json`` in
    ``recipe.output_dir`` assigns to another recipe (cheap: reads the index only).

    Raises:
        ModelOwnedElsewhere: names each model, its owner and how to proceed.
    """
    from pipeline.triton.publish import check_ownership

    check_ownership(Path(recipe.output_dir), recipe.name, model_names(recipe))


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
    from pipeline import targets as serving_targets
    from pipeline.trt import stamp as engine_stamp

    if b.stamp_path is None or not Path(b.stamp_path).is_file():
        raise TritonConfigError(f"engine {b.engine_path}: no engine_stamp.json beside it; rebuild the engine")
    if target is None:
        if recipe.triton.serving is None:
            raise TritonConfigError(
                f"engine {b.engine_path}: recipe triton.serving is not declared, so there is no serving runtime to "
                "check the engine stamp against; declare the Triton container (or TensorRT version) and GPU model"
            )
        target = serving_targets.declared_target(recipe.triton.serving)
    stamp = json.loads(Path(b.stamp_path).read_text())
    result = engine_stamp.check_stamp(stamp, target, recipe.engine_hash)
    if result.errors:
        raise TritonConfigError(
            f"engine {b.engine_path} refused for deployment:\n  " + "\n  ".join(result.errors + result.warnings)
        )
    return result.warnings


def before_run(start: RunStart) -> dict:
    """Before any stage: complete a publish into ``output_dir`` that a crash interrupted
    (:func:`pipeline.triton.publish.recover`), so a run whose gate then fails still leaves the last
    published repository whole, and remove a failed publish's leftovers."""
    from pipeline.triton import publish

    note = publish.recover(Path(start.recipe.output_dir))
    if note:
        start.progress.print(f"[yellow]{note}[/yellow]")
    publish.remove_leftovers(Path(start.recipe.output_dir), start.recipe.name)
    return {}
