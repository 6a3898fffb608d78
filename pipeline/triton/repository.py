"""Triton model repository stage: write, check and atomically publish.

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

Publishing: everything is written into a staging folder next to ``out_dir``
(model files are copied or reflinked, never hard-linked to stage outputs);
every config is checked (:func:`~pipeline.triton.config.check_config`) and every
written config.pbtxt re-parsed; only then are the recipe's model folders and
index entries published as one unit (:mod:`pipeline.triton.publish`). A failure
before that leaves a previously published repository untouched.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import onnx

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, ResolvedProfile, TensorSpec, TritonArtifact
from pipeline.errors import TritonConfigError
from pipeline.fsutil import copy_file
from pipeline.models import registry
from pipeline.models.text_generation import kv as _kv  # moves to models/text_generation/ with _stage_generate
from pipeline.models.text_generation.kv import KVLayout
from pipeline.triton import publish
from pipeline.recipe import Recipe
from pipeline.triton.config import (
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    RUNTIMES,
    TOKENIZER_INPUT,
    ModelConfig,
    check_config,
    check_ensemble,
    check_tokenizer_outputs,
    compute_config,
    ensemble_config,
    generate_config,
    graph_io,
    parse_config,
    to_text,
    tokenizer_config,
)

INDEX_FILE = publish.INDEX_FILE
DEFAULT_MAX_TOKENS = 32  # generation default when the recipe has no validate.generation
DEFAULT_MAX_LENGTH = 512  # encoder tokenizer truncation when the profile gives no input_ids max
PAD_TO_MULTIPLE_OF = 16  # encoder tokenizer: row length rounded up to this (shape buckets for batching)
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


def tokenizer_model_name(model_name: str) -> str:
    """Name of an encoder's tokenizer model."""
    return f"{model_name}_tokenizer"


def ensemble_model_name(model_name: str) -> str:
    """Name of an encoder's text -> embedding ensemble."""
    return f"{model_name}_ensemble"


def resolve_target(requested: str, build: BuildArtifact) -> str:
    """``auto`` -> ``tensorrt`` if an engine was built, else ``onnxruntime``.

    Raises:
        TritonConfigError: ``tensorrt`` requested but the build produced no engine.
    """
    has_engine = build.status == "ok" and bool(build.engine_path)
    if requested == "auto":
        return "tensorrt" if has_engine else "onnxruntime"
    if requested == "tensorrt" and not has_engine:
        raise TritonConfigError(
            f"triton.target: 'tensorrt' needs a TensorRT engine, but the build stage produced none "
            f"(status {build.status!r}: {build.reason}); use target 'auto' or 'onnxruntime'"
        )
    return requested


def gpu_available(build: BuildArtifact) -> bool:
    """True when an engine was built, or onnxruntime has the CUDA provider and torch sees a GPU."""
    if build.status == "ok":
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


def write_repository(
    recipe: Recipe,
    *,
    export: ExportArtifact,
    quantized: QuantizedArtifact,
    build: BuildArtifact,
    out_dir: Path,
    compute_only: bool = False,
) -> TritonArtifact:
    """Write, check and publish the Triton model repository for ``recipe``.

    The compute model serves ``quantized.onnx_path`` (or ``build.engine_path``
    for target ``tensorrt``); the kind's adapter adds its own models
    (:meth:`pipeline.models.base.ModelAdapter.triton_models`: text-generation recipes with
    ``triton.generate_model_name`` the decoupled generation model, sentence-embedding
    recipes a tokenizer model and an ensemble). ``compute_only``: the compute
    model alone (bench variants).

    Raises:
        TritonConfigError: target ``tensorrt`` without an engine; a config that
            fails :func:`check_config`; a config.pbtxt that does not parse back
            to the same message; missing tokenizer.json or EOS id; a KV layout
            the compute graph does not match; an encoder graph input the
            tokenizer model cannot make, or no pad token. The published repository (if any)
            is unchanged in all these cases.
    """
    target = resolve_target(recipe.triton.target, build)
    if recipe.triton.generate_model_name == recipe.triton.model_name:
        raise TritonConfigError(
            f"triton.generate_model_name: {recipe.triton.model_name!r} is also triton.model_name; "
            "the two models need different names"
        )
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=publish.staging_prefix(out_dir, recipe.name), dir=out_dir.parent))
    try:
        models = [_stage_compute(recipe, target, quantized, build, staging)]
        if not compute_only:  # the kind's own models: generation, tokenizer + ensemble, ... (its adapter)
            models += registry.adapter(recipe.model).triton_models(recipe, export, models[0], build, staging)
        _verify(models, staging, recipe.triton.version, gpu_available(build) if target == "onnxruntime" else False)
        publish.publish(staging, out_dir, _index_entries(recipe, target, models, staging), recipe.name)
    finally:
        if publish.pending(out_dir) is None:  # else the next run completes the publish from staging
            shutil.rmtree(staging, ignore_errors=True)
    backend = models[0].config.platform or models[0].config.backend
    return TritonArtifact(repository=str(out_dir), models=[m.config.name for m in models], compute_backend=backend)


def _stage_compute(
    recipe: Recipe, target: str, quantized: QuantizedArtifact, build: BuildArtifact, staging: Path
) -> StagedModel:
    """Compute model: config from the served ONNX graph, model file(s) into the version folder."""
    source = Path(quantized.onnx_path)
    model = onnx.load(str(source), load_external_data=False)
    inputs, outputs = graph_io(model)
    max_batch, opt_batch = profile_batch(build.profiles)
    qdq = any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)
    cfg = compute_config(recipe.triton, inputs, outputs, target=target, profile_opt_batch=opt_batch, qdq=qdq,
                         profile_count=len(build.profiles))
    version_dir = staging / cfg.name / str(recipe.triton.version)
    version_dir.mkdir(parents=True)
    if target == "tensorrt":
        _copy_model_file(Path(str(build.engine_path)), version_dir / "model.plan")
    else:
        _copy_onnx(source, model, version_dir / "model.onnx")
    if target == "python-onnxruntime":
        _write_template("onnxruntime_model.py", version_dir / "model.py")
    _write_config(staging / cfg.name, cfg)
    if any(_PAST.match(s.name) for s in inputs):  # a KV-cache graph: size its shared memory
        write_deploy_notes(recipe, inputs, outputs, build.profiles)
    return StagedModel(cfg, inputs, outputs, target, max_batch, len(build.profiles))


DEPLOY_NOTES = "deploy_notes.md"
DOCKER_DEFAULT_SHM = 64 << 20  # bytes of /dev/shm under a plain `docker run`
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def shm_bytes(kv: KVLayout, batch: int, context: int, vocab: int) -> dict[str, int]:
    """Shared memory (bytes) the python backend needs at the worst generation step.

    The KV cache of ``batch`` sequences of ``context`` tokens is
    ``2 (K, V) x B x S x L x H_kv x D x bytes``; one step holds it twice (the
    past it sends, the present it receives), plus ``last_logits`` float32
    ``[B, V]``. ``total`` adds 25 % headroom for Triton's own tensors.
    """
    cache = 2 * batch * context * kv.num_layers * kv.kv_heads * kv.head_dim * _DTYPE_BYTES.get(kv.dtype, 4)
    logits = batch * vocab * 4
    need = 2 * cache + logits
    return {"kv_cache": cache, "last_logits": logits, "step": need, "total": need + need // 4}


def write_deploy_notes(recipe: Recipe, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                       profiles: Sequence[ResolvedProfile]) -> Path:
    """``<work_dir>/<recipe>/triton/deploy_notes.md``: the ``--shm-size`` the repository needs
    (:func:`shm_bytes` at max_batch_size sequences of the max context). Outside the
    model folders, so it is not part of their published hashes. Returns its path."""
    kv = kv_layout(inputs)
    vocab = next((int(s.shape[-1]) for s in outputs if s.name == "logits" and isinstance(s.shape[-1], int)), 0)
    batch = max(1, recipe.triton.max_batch_size)
    context = context_limits(profiles)["max_context"] or DEFAULT_SHM_CONTEXT
    need = shm_bytes(kv, batch, context, vocab)
    shm_mib = max(64, -(-need["total"] // (1 << 20)))
    mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
    text = (
        f"# Deploying {recipe.name}\n\n"
        f"Run Triton with `--shm-size={shm_mib}m` (e.g. `docker run --gpus all --shm-size={shm_mib}m ...`).\n\n"
        "The python-backend generation model moves the KV cache through /dev/shm at every step:\n\n"
        f"- KV cache: 2 x B {batch} x S {context} x L {kv.num_layers} x H_kv {kv.kv_heads} x D {kv.head_dim} "
        f"x {_DTYPE_BYTES.get(kv.dtype, 4)} bytes ({kv.dtype}) = {mib(need['kv_cache'])}\n"
        f"- one step holds it twice (past in, present out), plus `last_logits` [B {batch}, V {vocab}] float32 "
        f"= {mib(need['last_logits'])}: {mib(need['step'])}\n"
        f"- with 25 % headroom: {mib(need['total'])}; Docker's default /dev/shm is 64 MiB"
        + (" (too small)" if need["total"] > DOCKER_DEFAULT_SHM else "") + ".\n\n"
        f"B is triton.max_batch_size (concurrent generations), S the max context of the optimization profiles. "
        f"Request `last_logits` ([batch, vocab]) rather than `logits` ([batch, sequence, vocab]) per step: a "
        f"{context}-token prefill's full logits alone are {mib(batch * context * vocab * 4)}.\n"
    )
    path = Path(recipe.work_dir) / recipe.name / "triton" / DEPLOY_NOTES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


DEFAULT_SHM_CONTEXT = 2048  # tokens assumed when no profile bounds the context


def _stage_generate(
    recipe: Recipe, export: ExportArtifact, graph_inputs: list[TensorSpec], build: BuildArtifact, staging: Path
) -> StagedModel:
    """Generation model: model.py template, tokenizer files and KV numbers in parameters."""
    kv = kv_layout(export.inputs)
    _check_kv(recipe.triton.model_name, kv, graph_inputs)
    name = str(recipe.triton.generate_model_name)
    version_dir = staging / name / str(recipe.triton.version)
    _copy_tokenizer(Path(export.tokenizer_dir), version_dir)
    _write_template("generate_model.py", version_dir / "model.py")
    generation = recipe.validate_.generation
    cfg = generate_config(
        name,
        compute_model=recipe.triton.model_name,
        num_layers=kv.num_layers,
        kv_heads=kv.kv_heads,
        head_dim=kv.head_dim,
        kv_dtype=kv.dtype,
        eos_token_ids=eos_token_ids(version_dir),
        default_max_tokens=generation.new_tokens if generation else DEFAULT_MAX_TOKENS,
        max_concurrent_generations=max(1, recipe.triton.max_batch_size),
        continuous_batching=recipe.triton.continuous_batching,
        kv_cache_budget_mib=recipe.triton.kv_cache_budget_mib,
        **_generate_compute_runtime(recipe, staging, last_logits=any(s.name == "last_logits" for s in export.outputs)),
        **context_limits(build.profiles),
    )
    _write_config(staging / name, cfg)
    return StagedModel(cfg, list(GENERATE_INPUTS), list(GENERATE_OUTPUTS), "python", None)


def _generate_compute_runtime(recipe: Recipe, staging: Path, *, last_logits: bool) -> dict:
    """How the generation model runs the compute graph: in its own process with ONNX Runtime when
    the staged compute model is the python-onnxruntime one (it ships model.py + model.onnx), else
    through BLS (``tensorrt_plan`` / ``onnxruntime_onnx``). ``last_logits``: the graph has that
    output ([batch, vocab]), which each step then requests instead of ``logits``."""
    version = str(recipe.triton.version)
    compute_dir = staging / recipe.triton.model_name
    logits = {"logits_output": "last_logits"} if last_logits else {}
    if not (compute_dir / version / "model.py").is_file():
        return {"compute_runtime": "bls", "compute_parameters": logits}
    params = parse_config((compute_dir / "config.pbtxt").read_text()).parameters
    onnx_file = params["onnx_file"].string_value if "onnx_file" in params else "model.onnx"
    forwarded = {k: params[k].string_value for k in ("graph_optimization_level", "dequantize_weights") if k in params}
    return {"compute_runtime": "onnxruntime",
            "compute_parameters": {"compute_onnx": f"{recipe.triton.model_name}/{version}/{onnx_file}", **forwarded,
                                   **logits}}


def _stage_encoder_text(
    recipe: Recipe, export: ExportArtifact, compute: StagedModel, build: BuildArtifact, staging: Path
) -> list[StagedModel]:
    """Tokenizer model (template + tokenizer files) and the text -> embedding ensemble."""
    name = recipe.triton.model_name
    version = str(recipe.triton.version)
    tok_dir = staging / tokenizer_model_name(name) / version
    check_tokenizer_outputs(tokenizer_model_name(name), [s.name for s in compute.inputs], recipe.triton.max_batch_size)
    _copy_tokenizer(Path(export.tokenizer_dir), tok_dir)
    _write_template("tokenizer_model.py", tok_dir / "model.py")
    tokenizer = tokenizer_config(
        tokenizer_model_name(name), max_batch_size=recipe.triton.max_batch_size, outputs=[s.name for s in compute.inputs],
        max_length=context_limits(build.profiles)["max_prompt_tokens"] or DEFAULT_MAX_LENGTH,
        pad_id=pad_token_id(tok_dir), pad_to_multiple_of=PAD_TO_MULTIPLE_OF,
    )
    ensemble = ensemble_config(ensemble_model_name(name), tokenizer, compute.config)
    check_ensemble(ensemble, {m.name: m for m in (tokenizer, compute.config)})
    (staging / ensemble.name / version).mkdir(parents=True)
    for cfg in (tokenizer, ensemble):
        _write_config(staging / cfg.name, cfg)
    text = [TensorSpec(TOKENIZER_INPUT, "object", ["batch", 1])]
    ids = [TensorSpec(s.name, "int64", ["batch", "sequence"]) for s in compute.inputs]
    return [StagedModel(tokenizer, text, ids, "python", None), StagedModel(ensemble, text, compute.outputs, "ensemble", None)]


def pad_token_id(tokenizer_dir: Path) -> int:
    """Pad id: ``pad_token`` of tokenizer_config.json / special_tokens_map.json looked up in
    tokenizer.json, else tokenizer.json's ``padding.pad_id``.

    Raises:
        TritonConfigError: no pad token named, or the named one is not in the vocabulary.
    """
    token_id = _special_token_id(tokenizer_dir, "pad_token")
    if token_id is not None:
        return token_id
    padding = _json_field(tokenizer_dir / "tokenizer.json", "padding")
    if isinstance(padding, dict) and "pad_id" in padding:
        return int(padding["pad_id"])
    raise TritonConfigError(f"{tokenizer_dir}: no pad_token in tokenizer_config.json or special_tokens_map.json and "
                            "no padding in tokenizer.json; the encoder tokenizer model pads batches with it")


def kv_layout(inputs: Sequence[TensorSpec]) -> KVLayout:
    """:func:`pipeline.models.text_generation.kv.kv_layout` of the export's inputs (the one KV layout).

    Raises:
        TritonConfigError: no past inputs, layers not numbered 0..L-1 with a key
            and a value each, non-rank-4 or symbolic kv_heads/head_dim, or
            layers that disagree.
    """
    return _kv.kv_layout(inputs, error=TritonConfigError)


def _check_kv(model_name: str, kv: KVLayout, graph_inputs: Sequence[TensorSpec]) -> None:
    """The served graph must take the past tensors the generation model will send."""
    graph = {s.name: s for s in graph_inputs}
    for i in range(kv.num_layers):
        for kind in ("key", "value"):
            spec = graph.get(f"past_key_values.{i}.{kind}")
            if spec is None or len(spec.shape) != 4 or spec.shape[1] != kv.kv_heads or spec.shape[3] != kv.head_dim:
                raise TritonConfigError(
                    f"model '{model_name}': input past_key_values.{i}.{kind}: the served graph has "
                    f"{spec.shape if spec else 'no such input'}, the export has [batch, {kv.kv_heads}, "
                    f"past_sequence, {kv.head_dim}]"
                )


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


def eos_token_ids(tokenizer_dir: Path) -> list[int]:
    """EOS id(s): ``eos_token_id`` of generation_config.json, else the ``eos_token`` of
    tokenizer_config.json / special_tokens_map.json looked up in tokenizer.json, else
    config.json's ``eos_token_id``.

    Raises:
        TritonConfigError: none of these files names an EOS token, or the named
            token is not in tokenizer.json's vocabulary.
    """
    ids = _json_field(tokenizer_dir / "generation_config.json", "eos_token_id")
    if ids is None:
        ids = _eos_from_token(tokenizer_dir)
    if ids is None:
        ids = _json_field(tokenizer_dir / "config.json", "eos_token_id")
    if ids is None:
        raise TritonConfigError(
            f"{tokenizer_dir}: no EOS token in generation_config.json, tokenizer_config.json, "
            "special_tokens_map.json or config.json; the generation model needs one to stop"
        )
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]


def _eos_from_token(tokenizer_dir: Path) -> int | None:
    return _special_token_id(tokenizer_dir, "eos_token")


def _special_token_id(tokenizer_dir: Path, key: str) -> int | None:
    """Id of the special token ``key`` ("eos_token", "pad_token") named in the
    tokenizer's config files, or None when none names it.

    Raises:
        TritonConfigError: the named token is not in tokenizer.json.
    """
    from tokenizers import Tokenizer

    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        token = _json_field(tokenizer_dir / name, key)
        token = token.get("content") if isinstance(token, dict) else token
        if token:
            token_id = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).token_to_id(token)
            if token_id is None:
                raise TritonConfigError(f"{tokenizer_dir / name}: {key} {token!r} is not in tokenizer.json")
            return token_id
    return None


def _json_field(path: Path, key: str):
    return json.loads(path.read_text()).get(key) if path.is_file() else None


def _copy_tokenizer(tokenizer_dir: Path, version_dir: Path) -> None:
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
    copy_file(source, dest)


def _copy_onnx(source: Path, model: onnx.ModelProto, dest: Path) -> None:
    """Place the ONNX file as ``dest`` and its external-data files (same relative names) beside it."""
    _copy_model_file(source, dest)
    for location in sorted(_external_files(model)):
        rel = Path(location)
        if rel.is_absolute() or ".." in rel.parts:
            raise TritonConfigError(f"{source}: external data location {location!r} leaves the model folder")
        (dest.parent / rel).parent.mkdir(parents=True, exist_ok=True)
        _copy_model_file(source.parent / rel, dest.parent / rel)


def _external_files(model: onnx.ModelProto) -> set[str]:
    return {
        entry.value
        for tensor in _tensors(model.graph)
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }


def _tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and attribute tensors of ``graph`` and its subgraphs."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for sub in attr.graphs:
                yield from _tensors(sub)


def _write_template(name: str, dest: Path) -> None:
    dest.write_text((resources.files("pipeline.triton") / "templates" / name).read_text())


def _write_config(model_dir: Path, cfg: ModelConfig) -> None:
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
    """Files the version folder must hold: the model file, the python model's ONNX, the tokenizer."""
    names = [RUNTIMES[m.target][2]] if RUNTIMES[m.target][2] else []
    if "onnx_file" in m.config.parameters:
        names.append(m.config.parameters["onnx_file"].string_value)
    if m.target == "python":
        names.append("tokenizer.json")
    return names


def _index_entries(recipe: Recipe, target: str, models: Sequence[StagedModel], staging: Path) -> dict[str, dict]:
    """repository.json entries of this recipe: per model its recipe, target, platform/backend and files' sha256."""
    return {
        m.config.name: {
            "recipe": recipe.name,
            "target": target,
            "backend": m.config.platform or m.config.backend,
            "files": publish.tree_hashes(staging / m.config.name),
        }
        for m in models
    }
