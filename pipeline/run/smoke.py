"""``build --test``: run a recipe end to end on a randomly initialised 2-layer copy of
its model, as a quick smoke test of the recipe and the stages (Olive's ``--test``).

The copy is made from the model's Hugging Face config (``AutoConfig`` of the
folder, or the config transformers derives from a GGUF file) with
``num_hidden_layers = 2`` and random weights (seed 0), saved with the tokenizer into
``<work_dir>/<name>-test/random-2-layer/``. The run is the recipe renamed
``<name>-test`` with ``model.source`` pointing at the copy and ``output_dir``
inside ``<work_dir>/<name>-test/``: nothing is published, and the real run's
stage cache is untouched. Gates are evaluated and reported but not enforced:
the exit code is 0 when every stage ran. ``entry:`` and ``onnx:`` sources have no
config to copy from and are refused (exit 2), and so is ``quantize.weights.method:
source`` (a random copy has no GGUF blocks to take).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.sources.model import load_tokenizer

TEST_LAYERS = 2
COPY_DIR = "random-2-layer"


def test_area(recipe) -> Path:
    """``<work_dir>/<name>-test``: the test run's folder (run dir, model copy, repository)."""
    return Path(recipe.work_dir) / f"{recipe.name}-test"


def hf_location(recipe) -> Path:
    """The Hugging Face folder or GGUF file behind ``recipe.model``.

    Raises:
        PipelineError: an ``entry:`` or ``onnx:`` source (no copy can be made), or a missing model.
    """
    from pipeline.sources.model import package_file

    source = recipe.model.source
    if not source.hf_loadable:
        raise PipelineError(f"build --test: model.source is {source.describe()}; a randomly initialised 2-layer "
                            "copy can only be made of a Hugging Face folder or GGUF file (package: or path: "
                            "sources), so no copy can be made of it. Run `build` without --test")
    weights = recipe.quantize.weights
    if weights is not None and weights.method == "source":
        raise PipelineError("build --test: quantize.weights.method: source takes the weights' blocks from the GGUF "
                            f"file, and the randomly initialised copy of {source.describe()} has none; run `build` "
                            "without --test")
    return package_file(recipe.model)


def random_copy(location: Path, dest: Path, layers: int = TEST_LAYERS) -> dict:
    """Save a randomly initialised ``layers``-layer model with the source's config and tokenizer
    into ``dest``.

    Args:
        location: an HF folder (``config.json``) or a ``.gguf`` file.

    Returns:
        ``{"source": str, "architecture": str, "layers": [original, layers]}``.

    Raises:
        PipelineError: transformers cannot read a config or tokenizer there, or the
            config has no ``num_hidden_layers``.
    """
    import torch
    import transformers

    kw: dict = {"local_files_only": True}
    folder = location
    if location.suffix == ".gguf":
        folder, kw["gguf_file"] = location.parent, location.name
    try:
        cfg = transformers.AutoConfig.from_pretrained(str(folder), **kw)
        tok = load_tokenizer(location)
    except (OSError, ValueError) as e:
        raise PipelineError(f"build --test: transformers cannot read a config and tokenizer at {location}: {e}") from None
    original = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(original, int):
        raise PipelineError(f"build --test: the {type(cfg).__name__} of {location} has no num_hidden_layers; "
                            "no 2-layer copy can be made")
    cfg.num_hidden_layers = min(layers, original)
    for key, value in list(vars(cfg).items()):  # per-layer lists (e.g. layer_types) follow the new depth
        if isinstance(value, list) and len(value) == original and key != "architectures":
            setattr(cfg, key, value[: cfg.num_hidden_layers])
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:  # GGUF configs name no architecture; transformers reads only decoder LMs from GGUF
        cls = transformers.AutoModelForCausalLM if "gguf_file" in kw else transformers.AutoModel
    torch.manual_seed(0)
    model: Any = cls.from_config(cfg) if cls.__name__.startswith("Auto") else cls(cfg)
    dest.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    return {"source": str(location), "architecture": type(model).__name__, "layers": [original, cfg.num_hidden_layers]}


def overrides(recipe, copy: Path) -> dict[str, object]:
    """The ``--set`` style overrides of the test run: new name, the copy as the model,
    ``output_dir`` inside the test area."""
    area = test_area(recipe)
    out: dict[str, object] = {"name": f"{recipe.name}-test", "output_dir": str(area / "model_repository")}
    out["model.source"] = {"path": str(copy.resolve())}
    return out


def run_test(recipe_path: Path, recipe, user_overrides: dict, quiet: bool = False) -> int:
    """Make the copy, run every stage on it, print the gates as not enforced; 0 when every stage ran.

    Raises:
        PipelineError: the source cannot be copied, or a stage failed (its own exit code).
    """
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    location = hf_location(recipe)
    area = test_area(recipe)
    info = random_copy(location, area / COPY_DIR)
    test_recipe = load_recipe(recipe_path, {**user_overrides, **overrides(recipe, area / COPY_DIR)})
    print(f"build --test: {info['architecture']} with {info['layers'][1]} of {info['layers'][0]} layers, random "
          f"weights, from {location}; output_dir {test_recipe.output_dir} (nothing is published)")
    result = run_pipeline(test_recipe, recipe_path, quiet=quiet,
                          unpinned="build --test: a random copy is never pinned; calibration and the search run on it")
    run_dir = result.manifest_path.parent
    note = {"test": True, **info, "copy": str(area / COPY_DIR), "gates_enforced": False,
            "output_dir": test_recipe.output_dir,
            "stages": {k: v["status"] for k, v in result.manifest["stages"].items()}}
    (run_dir / "test_run.json").write_text(json.dumps(note, indent=2) + "\n")
    for g in result.manifest["gates"]:
        print(f"{g['message']} (not enforced: --test)")
    for name, rec in result.manifest["stages"].items():
        print(f"  {name}: {rec['status']}" + (f" ({rec['reason']})" if rec.get("reason") else ""))
    print(f"manifest: {result.manifest_path}\nreport:   {run_dir / 'report.md'}\ntest run: {run_dir / 'test_run.json'}")
    return 0
