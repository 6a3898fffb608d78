"""The pre-flight: everything a command checks before its first stage, in one place.

* :func:`preflight`: the recipe (schema and cross-section rules), its paths (UTF-8, writable
  ``work_dir`` / ``output_dir`` apart from each other), the data uses (disjoint records), the
  model names already published into ``output_dir``, and the model's files (present, and not
  contradicting each other or the recipe).
* :func:`refuse_matched_sets`, :func:`check_pin_folder`: what ``tune`` checks before it calibrates.

Every refusal is raised before any stage writes a file; the CLI maps it to its exit code.
"""
from __future__ import annotations

import sys
from pathlib import Path

from pipeline.errors import RecipeError
from pipeline.recipe.load import load_from_args, parse_set

__all__ = ["preflight", "check_utf8_path", "check_output_folders", "check_disjoint_data", "refuse_matched_sets",
           "check_pin_folder"]


def preflight(args):
    """Everything the build checks before its first stage: the recipe (schema and
    cross-section constraints) and the model weights' presence. Returns (recipe, weights path).

    Raises:
        RecipeError: the recipe or a ``--set`` value is invalid.
        PipelineError: the model's files are missing or truncated (names the model.source key),
            a file a later stage reads from the source is missing (text-generation: the tokenizer,
            an EOS id; names the folder and the files), its files contradict each other or the
            recipe (text-generation: tokenizer ids past config.json vocab_size, a profile past a
            learned position table), or a model name is published in ``output_dir`` by another recipe.
        DataError: two data uses overlap (names both) or a data file is missing.
    """
    from pipeline.sources.model import package_file

    check_utf8_path(Path(args.recipe).absolute())
    recipe = load_from_args(args)
    check_output_folders(recipe)
    check_disjoint_data(recipe, args)
    from pipeline.stages.triton import check_names_free

    check_names_free(recipe)  # a model name another recipe published into output_dir
    recipe.model.source.files()  # every model file present (external data long enough)
    weights = package_file(recipe.model)  # raises, naming the model.source key, when missing
    from pipeline.models import registry

    adapter = registry.adapter(recipe.model)
    adapter.check_files()  # what later stages read from the source (tokenizer, EOS, its ids against the embedding)
    for warning in adapter.check_recipe(recipe):  # the source against the recipe (positions against the profiles)
        print(f"warning: {warning}", file=sys.stderr)
    return recipe, weights


def check_utf8_path(path: Path) -> None:
    """Refuse a path that is not UTF-8 (its bytes decode to lone surrogates): torch's exporter
    and TensorRT's parser take paths as UTF-8 strings and fail on it with unrelated errors.

    Raises:
        RecipeError: names the path, its bad bytes escaped.
    """
    from pipeline.errors import RecipeError

    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise RecipeError(f"{shown}: the path is not UTF-8; valid: a recipe folder whose name is UTF-8") from None


def check_output_folders(recipe) -> None:
    """``work_dir`` and ``output_dir`` must be folders this process can write (checked with a
    probe folder it removes), so a bad path fails before the first stage, not at the last.

    Raises:
        RecipeError: names the key, the path and why (a file in the way, or the OS's refusal;
            a read-only or full file system under it is exit 4, as any storage fault).
    """
    from pipeline.errors import RecipeError
    from pipeline.fsutil import folder_problem

    for key in ("work_dir", "output_dir"):
        check_utf8_path(Path(getattr(recipe, key)).absolute())
        problem = folder_problem(getattr(recipe, key))
        if problem is not None:
            raise RecipeError(f"{key}: {getattr(recipe, key)} cannot be written ({problem}); valid: a folder "
                              "this user can create files in") from (problem if isinstance(problem, OSError) else None)
    repo, work = Path(recipe.output_dir).resolve(), Path(recipe.work_dir).resolve()
    run = work / recipe.name
    if repo == work or repo.is_relative_to(run) or run.is_relative_to(repo):
        raise RecipeError(f"output_dir: {recipe.output_dir} overlaps the run folder {run} (work_dir/name): stage "
                          "files would sit among the published model folders; valid: a folder apart from it, "
                          "e.g. model_repository")


def check_disjoint_data(recipe, args) -> None:
    """Calibration vs tuning vs eval data (datasets.check_disjoint); an overlap a ``--set``
    made is tagged ``[from --set KEY]``, as a schema error from one is."""
    from pipeline.sources import data as datasets
    from pipeline.run import report as manifest

    uses = manifest.data_uses(recipe, Path(args.recipe).parent)
    try:
        datasets.check_disjoint(uses)
    except datasets.DataError as e:
        named = [u for u in uses if u in str(e)]
        setters = [o for o in parse_set(getattr(args, "set", None) or [])
                   if any(o == u or o.startswith(u + ".") or u.startswith(o + ".") for u in named)]
        if not setters:
            raise
        raise datasets.DataError(f"{e} [from --set {setters[-1]}]") from None


def refuse_matched_sets(args, recipe, dest: Path) -> None:
    """``tune --set`` may change only what the pin does not match (:func:`pipeline.quant.pin.match_fields`):
    a pin tuned under a ``--set`` of the quantize section or the model would match that command
    line alone, and ``build`` of the recipe file would find it stale.

    Raises:
        RecipeError: (exit 2) names the ``--set`` keys, why, and what to do instead.
    """
    from pipeline.quant import pin
    from pipeline.recipe.load import load_recipe

    sets = list(parse_set(args.set))
    if not sets:
        return
    try:
        as_filed = load_recipe(args.recipe)
    except RecipeError:
        as_filed = None

    def matched(r) -> tuple:  # of what the pin matches, what a --set can change: the model file's hash follows model
        return pin.match_fields(r, {})["quantize"], r.model.model_dump(mode="json")

    if as_filed is not None and matched(as_filed) == matched(recipe):
        return
    keys = [k for k in sets if k.split(".")[0] in ("quantize", "model")] or sets
    raise RecipeError(
        f"tune: --set {', '.join(keys)} changes what the pin matches (the quantize section or the model): {dest} "
        f"would then match only this command line, and `build` of {args.recipe} would find it stale (exit 2 "
        f"under --locked). Edit {args.recipe} and run tune without these --set, or copy the recipe under another "
        "name and tune the copy (its pin is tuned/<name>.json); --set of quantize.exclude.nodes, "
        "quantize.tuning.max_trials, quantize.tuning.time_limit_s or outside quantize and model is allowed")


def check_pin_folder(dest: Path) -> None:
    """The folder ``tune`` writes its pin into must be writable before it calibrates and searches
    (as ``work_dir`` is for ``build``), checked with a probe folder it removes.

    Raises:
        RecipeError: names the folder and why (exit 2: a file in the way, permission denied;
            exit 4 when the OS error is a storage fault such as a read-only file system).
    """
    from pipeline.fsutil import folder_problem

    problem = folder_problem(dest.parent)
    if problem is not None:
        raise RecipeError(f"{dest.parent}: the pin folder cannot be written ({problem}); tune writes {dest.name} "
                          "there after calibrating and searching; valid: a folder this user can create files in "
                          "(a writable checkout of the recipe's folder)") from (problem if isinstance(problem, OSError)
                                                                                else None)
