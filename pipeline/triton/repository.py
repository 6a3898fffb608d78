"""Triton model repository: stage, check and atomically publish the models of a recipe
(the stage that drives it is :func:`pipeline.stages.triton.write_repository`).

Layout under ``out_dir`` (``<v>`` = ``triton.version``)::

    repository.json                      models, their backend and files' sha256
    <model_name>/config.pbtxt
    <model_name>/<v>/model.onnx          target onnxruntime
    <model_name>/<v>/model.plan          target tensorrt
    <model_name>/<v>/model.py + model.onnx   target python-onnxruntime
    <generate_model_name>/config.pbtxt   text-generation recipes with generate_model_name
    <generate_model_name>/<v>/model.py + every file of export.tokenizer_dir
    <model_name>_tokenizer/config.pbtxt  sentence-embedding recipes: text -> the graph's int64 inputs
    <model_name>_tokenizer/<v>/model.py + every file of export.tokenizer_dir
    <model_name>_ensemble/config.pbtxt   sentence-embedding recipes: text -> tokenizer -> compute model
    <model_name>_ensemble/<v>/           (empty, as Triton wants for ensembles)

Publishing: everything is written into a staging folder on ``out_dir``'s own file
system (:func:`pipeline.triton.publish.new_staging`: beside it, or inside it as a
dot-folder when ``out_dir`` is a mounted volume; model files are copied or
reflinked, never hard-linked to stage outputs);
every config is checked (:func:`~pipeline.triton.config.check_config`) and every
written config.pbtxt re-parsed; only then are the recipe's model folders and
index entries published as one unit (:mod:`pipeline.triton.publish`). A failure
before that leaves a previously published repository untouched.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import onnx

from pipeline.artifacts import BuildArtifact, QuantizedArtifact, ResolvedProfile, TensorSpec
from pipeline.errors import StorageFault, TritonConfigError, storage_fault
from pipeline.fsutil import copy_file
from pipeline.onnx_io import graph_specs
from pipeline.triton import publish
from pipeline.recipe.schema import Recipe
from pipeline.triton.config import (
    RUNTIMES,
    ModelConfig,
    check_config,
    compute_config,
    parse_config,
    to_text,
)

INDEX_FILE = publish.INDEX_FILE
_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


@dataclass
class StagedModel:
    """One model written to staging, with what its config is checked against."""

    config: ModelConfig
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    target: str
    profile_max_batch: int | None
    profile_count: int | None = None  # engine optimization profiles (compute model)
    required_files: tuple[str, ...] = ()  # besides the model file: e.g. tokenizer.json of a tokenizing model


def tokenizer_model_name(model_name: str) -> str:
    """Name of an encoder's tokenizer model."""
    return f"{model_name}_tokenizer"


def ensemble_model_name(model_name: str) -> str:
    """Name of an encoder's text -> embedding ensemble."""
    return f"{model_name}_ensemble"


def repository_runtime(requested: str, build: BuildArtifact) -> str:
    """``auto`` -> ``tensorrt`` if an engine was built, else ``onnxruntime``.

    Raises:
        TritonConfigError: ``tensorrt`` requested but the build produced no engine.
    """
    has_engine = build.plan_path is not None  # a TensorRT-RTX engine is not servable by tensorrt_plan
    if requested == "auto":
        return "tensorrt" if has_engine else "onnxruntime"
    if requested == "tensorrt" and not has_engine:
        raise TritonConfigError(
            f"triton.target: 'tensorrt' needs a TensorRT engine, but the build stage produced none "
            f"(status {build.status!r}: {build.reason}); use target 'auto' or 'onnxruntime'"
        )
    return requested


def gpu_available(build: BuildArtifact) -> bool:
    """True when a datacenter engine was built, or onnxruntime has the CUDA provider and torch sees a GPU."""
    if build.plan_path is not None:
        return True
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        return False
    import torch

    return torch.cuda.is_available()


def profile_batch(profiles: Sequence[ResolvedProfile]) -> tuple[int | None, int | None]:
    """(max, opt) batch that EVERY optimization profile serves: Triton picks a profile per
    request by its shapes (``instance_group.profile``), so a batch of ``max_batch_size``
    must fit the decode and the prefill profile alike. Per profile the smallest axis-0
    max/opt over its inputs, then the smallest over the profiles; (None, None) when no
    profile gives a shape."""
    maxes, opts = [], []
    for prof in profiles:
        shapes = [s for s in prof.shapes.values() if s["max"]]
        if shapes:
            maxes.append(min(s["max"][0] for s in shapes))
            opts.append(min(s["opt"][0] for s in shapes))
    return (min(maxes), min(opts)) if maxes else (None, None)


@contextlib.contextmanager
def staging_folder(out_dir: Path, recipe_name: str) -> Iterator[Path]:
    """A new staging folder on ``out_dir``'s file system for one recipe's models
    (:func:`pipeline.triton.publish.new_staging`); removed on exit unless a publish
    from it is pending (the next run completes that publish).

    Raises:
        StorageFault: a write into it failed on a full, over-quota, read-only or
            cross-device file system (exit 4); it names ``out_dir`` and the file.
    """
    staging = publish.new_staging(out_dir, recipe_name)
    try:
        yield staging
    except (OSError, StorageFault) as e:
        fault = e if isinstance(e, StorageFault) else storage_fault(e, staging)
        if fault is None:
            raise
        raise StorageFault(f"{out_dir}: staging the models failed, nothing was published: {fault}") from e
    finally:
        journal = publish.pending(out_dir)
        if journal is None or Path(journal["staging"]) != staging.resolve():
            shutil.rmtree(staging, ignore_errors=True)


def check_and_publish(recipe: Recipe, target: str, models: Sequence[StagedModel], build: BuildArtifact,
                      staging: Path, out_dir: Path) -> None:
    """Check every staged model (:func:`check_config`, its config.pbtxt parsed back, its
    files present), then publish them and their ``repository.json`` entries as one unit.

    Raises:
        TritonConfigError: a check fails; nothing is published then.
    """
    _verify(models, staging, recipe.triton.version, gpu_available(build) if target == "onnxruntime" else False)
    publish.publish(staging, out_dir, _index_entries(recipe, target, models, staging), recipe.name)


def stage_compute(
    recipe: Recipe, target: str, quantized: QuantizedArtifact, build: BuildArtifact, staging: Path
) -> StagedModel:
    """Compute model: config from the served ONNX graph, model file(s) into the version folder."""
    source = Path(quantized.ort_path)
    model = onnx.load(str(source), load_external_data=False)
    inputs, outputs = graph_specs(model)
    max_batch, opt_batch = profile_batch(build.profiles)
    qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    cfg = compute_config(recipe.triton, inputs, outputs, target=target, profile_opt_batch=opt_batch, qdq=qdq,
                         profile_count=len(build.profiles), graph=source if target != "tensorrt" else None)
    version_dir = staging / cfg.name / str(recipe.triton.version)
    version_dir.mkdir(parents=True)
    if target == "tensorrt":
        _copy_model_file(Path(str(build.plan_path)), version_dir / "model.plan")
    else:
        _copy_onnx(source, model, version_dir / "model.onnx", rewrite=target == "onnxruntime" and _fit_ir(recipe, model,
                                                                                                         source))
    if target == "python-onnxruntime":
        write_template("onnxruntime_model.py", version_dir / "model.py")
    write_config(staging / cfg.name, cfg)
    return StagedModel(cfg, inputs, outputs, target, max_batch, len(build.profiles))


def context_limits(profiles: Sequence[ResolvedProfile]) -> dict[str, int]:
    """``max_prompt_tokens`` and ``max_context`` (tokens) over every optimization profile;
    0 (unlimited) where no profile gives a shape.

    A prompt is a prefill (empty past), so ``max_prompt_tokens`` is the largest
    input_ids axis-1 max of the profiles that admit a zero-length past. Decoding
    feeds one token with a past of ``context - 1``, so ``max_context`` is the
    largest, over the profiles that admit sequence 1, of min(attention_mask axis-1
    max, past axis-2 max + 1). With one profile: that profile's limits."""
    prompts, contexts = [], []
    for prof in profiles:
        shapes = prof.shapes
        past = [s for n, s in shapes.items() if _PAST.match(n)]
        ids = shapes.get("input_ids")
        if ids and all(s["min"][2] == 0 for s in past):
            prompts.append(ids["max"][1])
        context = [shapes["attention_mask"]["max"][1]] if "attention_mask" in shapes else []
        context += [s["max"][2] + 1 for s in past]
        if context and (ids is None or ids["min"][1] <= 1):
            contexts.append(min(context))
    if not prompts and profiles and "input_ids" in profiles[0].shapes:  # no profile takes an empty past
        prompts.append(profiles[0].shapes["input_ids"]["max"][1])
    return {"max_prompt_tokens": max(prompts, default=0), "max_context": max(contexts, default=0)}


#: tokenizer_config.json keys that name a chat template's end-of-turn token, where a tokenizer declares one
END_OF_TURN_KEYS = ("eot_token", "end_of_turn_token")


def eos_token_ids(tokenizer_dir: Path) -> list[int]:
    """The EOS set, the one place it is decided: the union of generation_config.json's
    ``eos_token_id`` (an int or a list), the tokenizer's ``eos_token`` (tokenizer_config.json /
    special_tokens_map.json, looked up in tokenizer.json) and the chat template's end-of-turn
    token where the tokenizer declares one (:data:`END_OF_TURN_KEYS`); config.json's
    ``eos_token_id`` only when none of these names one. Ordered: generation config, tokenizer,
    end of turn; no repeats.

    Raises:
        TritonConfigError: none of these files names an EOS token, or a named
            token is not in tokenizer.json's vocabulary.
    """
    found: list = []
    for ids in (json_field(tokenizer_dir / "generation_config.json", "eos_token_id"),
                _eos_from_token(tokenizer_dir),
                *(special_token_id(tokenizer_dir, key) for key in END_OF_TURN_KEYS)):
        found += ids if isinstance(ids, list) else [] if ids is None else [ids]
    if not found:
        ids = json_field(tokenizer_dir / "config.json", "eos_token_id")
        found = ids if isinstance(ids, list) else [] if ids is None else [ids]
    if not found:
        raise TritonConfigError(
            f"{tokenizer_dir}: no EOS token in generation_config.json, tokenizer_config.json, "
            "special_tokens_map.json or config.json; the generation model needs one to stop"
        )
    return list(dict.fromkeys(int(i) for i in found))


def _eos_from_token(tokenizer_dir: Path) -> int | None:
    return special_token_id(tokenizer_dir, "eos_token")


def special_token_id(tokenizer_dir: Path, key: str) -> int | None:
    """Id of the special token ``key`` ("eos_token", "pad_token") named in the
    tokenizer's config files, or None when none names it.

    Raises:
        TritonConfigError: the named token is not in tokenizer.json.
    """
    from tokenizers import Tokenizer

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = json_field(tokenizer_dir / name, key)
        token = token.get("content") if isinstance(token, dict) else token
        if token:
            token_id = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(token)
            if token_id is None:
                raise TritonConfigError(f"{tokenizer_dir / name}: {key} {token!r} is not in tokenizer.json")
            return token_id
    return None


def json_field(path: Path, key: str):
    return json.loads(path.read_text()).get(key) if path.is_file() else None


def copy_tokenizer(tokenizer_dir: Path, version_dir: Path) -> None:
    """Copy every file of the tokenizer folder; tokenizer.json is required."""
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise TritonConfigError(
            f"{tokenizer_dir}: no tokenizer.json; the generation model loads it with the tokenizers library"
        )
    if (tokenizer_dir / "model.py").exists():
        raise TritonConfigError(f"{tokenizer_dir}: holds a model.py, which would replace the generation model's")
    shutil.copytree(tokenizer_dir, version_dir, dirs_exist_ok=True)


def _copy_model_file(source: Path, dest: Path) -> None:
    """Copy (or reflink) ``source`` to ``dest``: never a hard link, so no later stage
    run can change a published file.

    Raises:
        TritonConfigError: ``source`` does not exist.
    """
    if not source.is_file():
        raise TritonConfigError(f"{source}: model file not found")
    try:
        copy_file(source, dest)
    except OSError as e:
        fault = storage_fault(e, dest.parent, needed_bytes=source.stat().st_size)
        if fault is None:
            raise
        raise fault from e


def _fit_ir(recipe: Recipe, model: onnx.ModelProto, source: Path) -> bool:
    """Fit ``model`` (in place) to the IR version the declared container's onnxruntime backend
    reads (:func:`pipeline.triton.ir_version.fit_to_reader`; ``triton.serving.container``, else
    :data:`pipeline.targets.DEFAULT_RELEASE`); True when it changed. A container missing from the
    runtime tables is not checked.

    Raises:
        TritonConfigError: the graph cannot be read there (names both versions).
    """
    from pipeline import targets as serving_targets
    from pipeline.triton.ir_version import fit_to_reader

    reader = serving_targets.onnxruntime_reader(recipe.triton.serving.container if recipe.triton.serving else None)
    return reader is not None and fit_to_reader(model, reader, str(source))


def _copy_onnx(source: Path, model: onnx.ModelProto, dest: Path, *, rewrite: bool = False) -> None:
    """Place the ONNX file as ``dest`` (``rewrite``: ``model`` as changed in memory, else
    ``source``'s bytes) and its external-data files (same relative names) beside it."""
    if rewrite:
        from pipeline.onnx_io import save_graph

        save_graph(model, dest)
    else:
        _copy_model_file(source, dest)
    for location in sorted(_external_files(model)):
        rel = Path(location)
        if rel.is_absolute() or ".." in rel.parts:
            raise TritonConfigError(f"{source}: external data location {location!r} leaves the model folder")
        (dest.parent / rel).parent.mkdir(parents=True, exist_ok=True)
        _copy_model_file(source.parent / rel, dest.parent / rel)


def _external_files(model: onnx.ModelProto) -> set[str]:
    from pipeline.onnx_io import tensors

    return {
        entry.value
        for tensor in tensors(model)
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }


def write_template(name: str, dest: Path) -> None:
    dest.write_text((resources.files("pipeline.triton") / "templates" / name).read_text())


def write_config(model_dir: Path, cfg: ModelConfig) -> None:
    (model_dir / "config.pbtxt").write_text(to_text(cfg))


def _verify(models: Sequence[StagedModel], staging: Path, version: int, gpu: bool) -> None:
    """check_config every model, re-parse its written config.pbtxt, require its files.

    Raises:
        TritonConfigError: a check fails, the file does not parse back to the
            same config, or the version folder lacks the model file.
    """
    for m in models:
        model_dir = staging / m.config.name
        check_config(
            m.config, m.inputs, m.outputs, profile_max_batch=m.profile_max_batch,
            target=m.target, version_dirs=sorted(os.listdir(model_dir)), gpu_available=gpu,
            profile_count=m.profile_count,
        )
        if parse_config((model_dir / "config.pbtxt").read_text()) != m.config:
            raise TritonConfigError(f"model '{m.config.name}': config.pbtxt does not parse back to the written config")
        for name in _required_files(m):
            if not (model_dir / str(version) / name).is_file():
                raise TritonConfigError(f"model '{m.config.name}': version folder {version}/ lacks {name}")


def _required_files(m: StagedModel) -> list[str]:
    """Files the version folder must hold: the model file, the python model's ONNX, what the kind requires."""
    names = [RUNTIMES[m.target][2]] if RUNTIMES[m.target][2] else []
    if "onnx_file" in m.config.parameters:
        names.append(m.config.parameters["onnx_file"].string_value)
    names += list(m.required_files)
    return names


def _index_entries(recipe: Recipe, target: str, models: Sequence[StagedModel], staging: Path) -> dict[str, dict]:
    """repository.json entries of this recipe: per model its recipe, the recipe's hash (``recipe_hash``),
    target, platform/backend and files' sha256 (:func:`publish.publish` adds ``published_at``)."""
    return {
        m.config.name: {
            "recipe": recipe.name,
            "recipe_hash": recipe.digest,
            "target": target,
            "backend": m.config.platform or m.config.backend,
            "files": publish.tree_hashes(staging / m.config.name),
        }
        for m in models
    }
