"""What a local tritonserver serves for a recipe.

The pytriton wheel's tritonserver ships only the python backend. A recipe
whose target needs a backend the server lacks (``onnxruntime``: the
``onnxruntime`` backend, ``tensorrt``: the ``tensorrt`` backend) is served from
a python-onnxruntime copy, written by the same generator with the same checks
(:func:`pipeline.stages.triton.write_repository`, target overridden) into
``<work_dir>/<recipe>/serve_repository``; ``recipe.output_dir`` is never
touched. Bench variants of the compute model (dynamic batching off/on x 1/2
instances) go to ``<work_dir>/<recipe>/bench_repository/<variant>``, one
repository each, all loadable by one server.
"""
from __future__ import annotations

import functools

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import GateFailed, PipelineError, RepositoryCorrupt
from pipeline.recipe.schema import DynamicBatching, InstanceGroup, Recipe
from pipeline.stages.triton import write_repository
from pipeline.triton.repository import INDEX_FILE, repository_runtime
from pipeline.recipe.kinds import facts as kind_facts

#: resolved target -> the tritonserver backend folder it needs.
NEEDED_BACKEND = {"tensorrt": "tensorrt", "onnxruntime": "onnxruntime", "python-onnxruntime": "python"}
SERVE_DIR = "serve_repository"
BENCH_DIR = "bench_repository"


@dataclass
class Served:
    """A repository a local tritonserver can load, and the models in it."""

    recipe: Recipe
    artifacts: dict[str, Any]  # stage name -> artifact of the finished run
    repository: Path
    target: str
    note: str  # which repository and why, for people

    @property
    def compute_model(self) -> str:
        return self.recipe.triton.model_name

    @property
    def adapter(self):
        """The recipe's model-kind adapter (:mod:`pipeline.models.registry`)."""
        from pipeline.models import registry

        return registry.adapter(self.recipe.model)

    @property
    def generate_model(self) -> str | None:
        """The streaming generation model, for kinds that generate."""
        return generate_model_of(self.recipe)

    @property
    def ensemble_model(self) -> str | None:
        """The one-response front model (an ensemble), for kinds that do not generate."""
        return None if kind_facts(self.adapter.kind).generates else self.adapter.front_model(self.recipe)

    @functools.cached_property
    def compute_in_process(self) -> bool:
        """The generation model runs the compute graph in its own process (its config's
        ``compute_runtime: onnxruntime``, target python-onnxruntime): Triton's statistics of the
        compute model then never count its steps. False without a generation model."""
        from pipeline.triton.config import parse_config

        if not self.generate_model:
            return False
        config = parse_config((self.repository / self.generate_model / "config.pbtxt").read_text())
        runtime = config.parameters.get("compute_runtime")
        return runtime is not None and runtime.string_value == "onnxruntime"

    @property
    def run_dir(self) -> Path:
        """``<work_dir>/<recipe>``: the run's artifacts, server log and bench results."""
        return Path(self.recipe.work_dir) / self.recipe.name

    @property
    def models(self) -> list[str]:
        """Every model of the repository: compute first, then the kind's (generate / tokenizer + ensemble)."""
        return [self.compute_model, *self.adapter.served_models(self.recipe)]


def generate_model_of(recipe: Recipe) -> str | None:
    """The recipe's streaming generation model (what the OpenAI endpoint serves), None for kinds
    that do not generate or a recipe without one."""
    from pipeline.models import registry

    adapter = registry.adapter(recipe.model)
    return adapter.front_model(recipe) if kind_facts(adapter.kind).generates else None


@dataclass(frozen=True)
class Variant:
    """The compute model with dynamic batching on/off and ``instances`` instances."""

    name: str
    dynamic_batching: bool
    instances: int
    repository: Path


def built_artifacts(recipe: Recipe, recipe_path: Path, *, quiet: bool = False) -> dict[str, Any]:
    """Artifacts of a finished run: :func:`run_pipeline` (finished stages are cache hits).

    Raises:
        GateFailed: an accuracy gate failed, so this run published nothing; the message is
            :func:`refusal`'s.
        PipelineError: a stage failed (from the runner).
    """
    from pipeline.run.runner import run_pipeline

    result = run_pipeline(recipe, recipe_path, quiet=quiet)
    if not result.passed or "triton" not in result.artifacts:
        raise GateFailed(refusal(recipe, result.manifest, result.manifest_path))
    return result.artifacts


def refusal(recipe: Recipe, manifest: dict, manifest_path: Path) -> str:
    """Why ``serve`` / ``bench`` refuse a run whose gate failed: each failed gate's row (metric,
    value ± stderr, bound, margin), where this run's report is, and what ``recipe.output_dir``
    still holds of the recipe (:func:`pipeline.triton.publish.describe_publish`: its last
    verified publish, recipe hash and time), with this run's recipe hash to compare."""
    from pipeline.triton.publish import describe_publish

    rows = [g.get("message", g.get("name", "?")) for g in manifest.get("gates", []) if not g.get("passed", True)]
    return "\n".join([
        f"{recipe.name}: an accuracy gate failed, so this run published nothing and nothing of it is served:",
        *(f"  {r}" for r in rows),
        f"this run's report: {manifest_path.parent / 'report.md'} (recipe hash {recipe.digest[:12]})",
        describe_publish(Path(recipe.output_dir), recipe.name) + " (serve and bench run only a recipe whose "
        "gates pass: serving that publish needs the recipe it was built from)",
    ])


def with_triton(recipe: Recipe, **changes: Any) -> Recipe:
    """A copy of ``recipe`` with ``triton`` fields replaced (e.g. ``target``)."""
    return recipe.model_copy(update={"triton": recipe.triton.model_copy(update=changes)})


def prepare(recipe: Recipe, artifacts: dict[str, Any], backends: list[str], *,
            recipe_path: Path | None = None, use_pin: bool = True) -> Served:
    """Pick what to serve with a server that has ``backends``; write the serve copy if needed.

    With ``recipe_path`` the serving pin beside it (:mod:`pipeline.triton.pin`) is looked up for
    the serve copy: where it matches (hardware class, graphs, and the copy's runtime) its chosen
    values go into the copy's configs, and the note says so; a pin that does not match is named
    in the note, never applied. ``use_pin`` False (``tune-serving``): the recipe's own values.
    ``Served.recipe`` carries the values the configs were written with (:func:`pipeline.triton.pin.apply`),
    so bench's variants and tables describe what is served.

    Raises:
        TritonConfigError: the serve copy fails the generator's checks.
        RecipeError: the serving pin file is not valid.
        PipelineError: the target is loadable but ``recipe.output_dir`` no
            longer holds this recipe's models (recipes share output_dir).
    """
    target = repository_runtime(recipe.triton.target, artifacts["build"])
    needed = NEEDED_BACKEND[target]
    from pipeline.triton import pin

    if needed in backends:
        _check_published(recipe, artifacts["triton"])
        pinned, said = _pin_for(recipe, artifacts, recipe_path if use_pin else None, target)
        note = f"serving {recipe.output_dir}/ (target {target}; backend {needed} present){said}"
        shown = pin.apply(recipe, pinned) if pinned else recipe  # the build wrote these values
        return _verified(Served(shown, artifacts, Path(recipe.output_dir), target, note))
    out = Path(recipe.work_dir) / recipe.name / SERVE_DIR
    serve_recipe = with_triton(recipe, target="python-onnxruntime")
    pinned, said = _pin_for(recipe, artifacts, recipe_path if use_pin else None, "python-onnxruntime")
    write_repository(serve_recipe, export=artifacts["export"], quantized=artifacts["quantize"],
                     build=artifacts["build"], out_dir=out, pinned=pinned)
    note = (f"target {target!r} needs tritonserver's {needed!r} backend; this server has only {backends}. "
            f"Serving the same models as target 'python-onnxruntime' (ONNX Runtime in the python backend) "
            f"from {out}/; {recipe.output_dir}/ is unchanged{said}")
    shown = pin.apply(serve_recipe, pinned) if pinned else serve_recipe
    return _verified(Served(shown, artifacts, out, "python-onnxruntime", note))


def _pin_for(recipe: Recipe, artifacts: dict[str, Any], recipe_path: Path | None, target: str) -> tuple[dict | None, str]:
    """The serving pin's ``chosen`` when it matches a repository of ``target``, and a note clause
    (empty without a pin file)."""
    if recipe_path is None:
        return None, ""
    from pipeline.stages.triton import serving_pin

    found = serving_pin(recipe, recipe_path, artifacts["quantize"], artifacts["build"], target)
    pinned = found.pinned["chosen"] if found.applies and found.pinned else None
    return pinned, (f"; {found.describe()}" if found.pinned is not None else "")


def _verified(served: Served) -> Served:
    """``served`` once its models re-hash to their repository.json entries (``verify-repo``).

    Raises:
        RepositoryCorrupt: a file differs, is missing or extra, or a publish is half done.
    """
    from pipeline.triton.publish import verify_repository

    problems = verify_repository(served.repository, served.models)
    if problems:
        raise RepositoryCorrupt(f"{served.repository}: refusing to serve a repository that fails verification:\n  "
                                + "\n  ".join(problems))
    return served


def _check_published(recipe: Recipe, triton_artifact) -> None:
    """Every model of this recipe's triton stage is in ``recipe.output_dir`` and listed as this recipe's."""
    index = Path(recipe.output_dir) / INDEX_FILE
    data = json.loads(index.read_text()) if index.is_file() else {}
    models = data.get("models", {})
    missing = [m for m in triton_artifact.models
               if m not in models or models[m].get("recipe", data.get("recipe")) != recipe.name]
    if missing:
        raise PipelineError(
            f"{recipe.output_dir}/ does not hold recipe {recipe.name!r}'s models {missing} any more (another build "
            f"published over them). Re-publish: rm -r {Path(recipe.work_dir) / recipe.name / 'triton'} "
            f"and build {recipe.name} again"
        )


def write_variants(served: Served) -> list[Variant]:
    """The compute model with dynamic batching off/on x 1/2 instances, one repository each.

    "On" uses the recipe's ``triton.dynamic_batching`` (default settings when it
    has none); the instance kind is the recipe's first instance group's.
    Returns [] when ``max_batch_size`` is 0 (Triton cannot batch such a model).

    Raises:
        TritonConfigError: a variant fails the generator's checks.
    """
    triton = served.recipe.triton
    if triton.max_batch_size == 0:
        return []
    kind = triton.instance_group[0].kind
    root = Path(served.recipe.work_dir) / served.recipe.name / BENCH_DIR
    variants = []
    for batching in (False, True):
        for count in (1, 2):
            name = f"{triton.model_name}__db_{'on' if batching else 'off'}_i{count}"
            recipe = with_triton(
                served.recipe, model_name=name, generate_model_name=None, target=served.target,
                dynamic_batching=(triton.dynamic_batching or DynamicBatching()) if batching else None,
                instance_group=[InstanceGroup(count=count, kind=kind)],
            )
            a = served.artifacts
            write_repository(recipe, export=a["export"], quantized=a["quantize"], build=a["build"],
                             out_dir=root / name, compute_only=True)
            variants.append(Variant(name, batching, count, root / name))
    return variants
