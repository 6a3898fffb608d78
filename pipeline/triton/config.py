"""Triton ``config.pbtxt`` files built as Triton's own ``ModelConfig`` protobuf.

Configs are :class:`tritonclient.grpc.model_config_pb2.ModelConfig` messages,
written with :func:`google.protobuf.text_format` (:func:`to_text`) and read
back with :func:`parse_config`. :func:`check_config` refuses a config that
disagrees with the graph it serves before Triton ever sees it.

Targets (the resolved ``triton.target``), their config and version folder:

* ``tensorrt``: platform ``tensorrt_plan``; ``model.plan``.
* ``onnxruntime``: platform ``onnxruntime_onnx``; ``model.onnx``.
* ``python-onnxruntime``: backend ``python``; ``model.py`` + ``model.onnx``.
* ``python``: backend ``python``; ``model.py`` (the generation and tokenizer models).
* ``ensemble``: platform ``ensemble``; an empty version folder (encoder text -> embedding).

Device rule (``instance_group.kind``), checked by :func:`check_config`:

* ``tensorrt`` runs only on a GPU: ``KIND_CPU`` is refused.
* ``python-onnxruntime`` and ``python`` are CPU-only (the template pins
  ``CPUExecutionProvider``): ``KIND_GPU`` is refused.
* ``onnxruntime`` is CPU-only unless the caller says a GPU is available
  (``gpu_available=True``; :mod:`pipeline.triton.repository` sets it when a
  TensorRT engine was built or onnxruntime's CUDA provider sees a device):
  ``KIND_GPU`` is refused otherwise.
* ``KIND_AUTO`` is always accepted (Triton picks the device at load time).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pipeline.artifacts import TensorSpec
from pipeline.errors import TritonConfigError
from pipeline.recipe.schema import TritonConfig
from pipeline.ort_sessions import optimization_level, session_config

if TYPE_CHECKING:  # the generated protobuf module ships no type stubs
    ModelConfig = Any
else:
    ModelConfig = mc.ModelConfig

#: numpy dtype name (as in :class:`TensorSpec`) -> Triton data type.
TRITON_DTYPES: dict[str, int] = {
    "bool": mc.TYPE_BOOL,
    "uint8": mc.TYPE_UINT8,
    "uint16": mc.TYPE_UINT16,
    "uint32": mc.TYPE_UINT32,
    "uint64": mc.TYPE_UINT64,
    "int8": mc.TYPE_INT8,
    "int16": mc.TYPE_INT16,
    "int32": mc.TYPE_INT32,
    "int64": mc.TYPE_INT64,
    "float16": mc.TYPE_FP16,
    "float32": mc.TYPE_FP32,
    "float64": mc.TYPE_FP64,
    "bfloat16": mc.TYPE_BF16,
    "object": mc.TYPE_STRING,
    "bytes": mc.TYPE_STRING,
    "str": mc.TYPE_STRING,
}

#: resolved target -> (platform, backend, default model file).
RUNTIMES: dict[str, tuple[str, str, str]] = {
    "tensorrt": ("tensorrt_plan", "", "model.plan"),
    "onnxruntime": ("onnxruntime_onnx", "", "model.onnx"),
    "python-onnxruntime": ("", "python", "model.py"),
    "python": ("", "python", "model.py"),
    "ensemble": ("ensemble", "", ""),
}

#: I/O of the generation model, checked like a graph's I/O (max_batch_size 0). Every input
#: is optional in the config; model.py needs exactly one of ``text_input`` / ``messages`` /
#: ``input_ids`` (or ``scheduler_stats`` true alone). Sampling: ``temperature`` (0 = greedy),
#: ``top_k`` (0 = off), ``top_p`` (1 = off), ``seed``, ``stop`` (stop strings).
GENERATE_INPUTS = [
    TensorSpec("text_input", "object", [1]),
    TensorSpec("max_tokens", "int32", [1]),
    TensorSpec("input_ids", "int64", ["prompt_tokens"]),
    TensorSpec("ignore_eos", "bool", [1]),
    TensorSpec("messages", "object", [1]),
    TensorSpec("temperature", "float32", [1]),
    TensorSpec("top_k", "int32", [1]),
    TensorSpec("top_p", "float32", [1]),
    TensorSpec("seed", "int64", [1]),
    TensorSpec("stop", "object", ["stop_strings"]),
    TensorSpec("scheduler_stats", "bool", [1]),
    TensorSpec("prompt_logprobs", "int32", [1]),
    TensorSpec("logprobs", "int32", [1]),
]
GENERATE_OUTPUTS = [TensorSpec("text_output", "object", [1]), TensorSpec("token_ids", "int64", [1]),
                    TensorSpec("finish_reason", "object", [1]), TensorSpec("detail", "object", [1]),
                    TensorSpec("scores", "object", [1])]


#: ONNX element type -> numpy dtype name (the float8 types have no Triton type).


def triton_dtype(dtype: str, where: str = "") -> int:
    """numpy dtype name -> ``DataType`` enum value.

    Raises:
        TritonConfigError: Triton has no type for it; the message starts with ``where``.
    """
    if dtype not in TRITON_DTYPES:
        raise TritonConfigError(
            f"{where}dtype {dtype!r} has no Triton data type; valid: {', '.join(sorted(TRITON_DTYPES))}"
        )
    return TRITON_DTYPES[dtype]


def is_dynamic(dim: int | str | None) -> bool:
    """A symbolic (``"batch"``), unknown (``None``) or negative dim is dynamic."""
    return not isinstance(dim, int) or dim < 0


def config_dims(shape: Sequence[int | str], batched: bool) -> list[int]:
    """Graph shape -> Triton ``dims``: drop the batch axis when batched, symbolic -> -1."""
    dims = shape[1:] if batched else shape
    return [-1 if is_dynamic(d) else int(d) for d in dims]


def to_text(cfg: ModelConfig) -> str:
    """Serialise to the text format Triton reads from ``config.pbtxt``."""
    return text_format.MessageToString(cfg)


def parse_config(text: str) -> ModelConfig:
    """Parse ``config.pbtxt`` text; TritonConfigError with the parser's line:column on failure."""
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as e:
        raise TritonConfigError(f"config.pbtxt does not parse as ModelConfig: {e}") from None


def compute_config(
    triton: TritonConfig,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    *,
    target: str,
    profile_opt_batch: int | None = None,
    qdq: bool = False,
    profile_count: int = 1,
    graph: str | Path | onnx.ModelProto | None = None,
) -> ModelConfig:
    """Config of the compute model named ``triton.model_name``.

    Args:
        triton: the recipe's triton section (max_batch_size, dynamic_batching,
            instance_group).
        inputs, outputs: the served graph's I/O; dims exclude the batch axis
            when ``max_batch_size > 0``; symbolic dims become -1.
        target: ``tensorrt`` | ``onnxruntime`` | ``python-onnxruntime``.
        profile_opt_batch: opt batch the optimization profiles share (see
            :func:`pipeline.triton.repository.profile_batch`), used as
            ``preferred_batch_size`` when the recipe gives none (and it fits).
        profile_count: optimization profiles in the engine. With more than
            one and target ``tensorrt``, every instance group lists them all
            in ``profile`` (Triton's ``ModelInstanceGroup.profile``: indices as
            strings; unset, the TensorRT backend uses profile 0 only) and
            Triton picks one per request by its shapes.
        graph: the served ONNX graph: its path (preferred: INT8 weights are read
            from its folder), or a ModelProto with its weights. Its ONNX Runtime
            optimization level is :func:`pipeline.ort_sessions.optimization_level`, the
            one validate ran it at: ``basic`` for FP8 Q/DQ graphs (ORT's level-2+
            QDQ fusions build an invalid MatMulIntegerToFloat for FP8 on CPU,
            onnxruntime 1.31) and for INT8 Q/DQ graphs whose weights exceed +-64
            (int16 saturation in ORT's non-VNNI integer kernels), ``all`` otherwise.
            ``onnxruntime``: ``optimization.graph.level: -1`` (the Triton backend's
            ORT_ENABLE_BASIC) for ``basic``, unset (all) otherwise;
            ``python-onnxruntime``: parameter ``graph_optimization_level`` and, at
            ``basic``, ``dequantize_weights`` ``once`` (constant weight
            DequantizeLinear run once at load; bit-identical outputs, see the template);
            for a graph of weight-only blocks (int4) also ``session_config``, the JSON of
            :func:`pipeline.ort_sessions.session_config` (MatMulNBits at accuracy level 1),
            which Triton's stock ``onnxruntime`` backend has no parameter for (``check``
            refuses that target for such recipes).
        qdq: used only without ``graph`` (older callers): the graph holds
            Q/DQ nodes, taken as ``basic``.

    Raises:
        TritonConfigError: unknown target or a dtype Triton has no type for.
    """
    cfg = ModelConfig(name=triton.model_name, max_batch_size=triton.max_batch_size)
    _set_runtime(cfg, target)
    level = optimization_level(graph) if graph is not None else ("basic" if qdq else "all")
    if target == "onnxruntime" and level == "basic":
        cfg.optimization.graph.level = -1
    if target == "python-onnxruntime":
        cfg.parameters["graph_optimization_level"].string_value = level
        if level == "basic":
            cfg.parameters["dequantize_weights"].string_value = "once"
        entries = session_config(graph) if graph is not None else {}
        if entries:
            cfg.parameters["session_config"].string_value = json.dumps(entries, sort_keys=True)
    threads = getattr(triton, "intra_op_threads", 0)
    if threads and target in THREADS_PARAMETER:  # 0: derived at load (python-onnxruntime) / ORT's default
        cfg.parameters[THREADS_PARAMETER[target]].string_value = str(threads)
    batched = triton.max_batch_size > 0
    for kind, entries, specs in (("input", cfg.input, inputs), ("output", cfg.output, outputs)):
        for spec in specs:
            dtype = triton_dtype(spec.dtype, f"model '{cfg.name}': {kind} '{spec.name}': ")
            entries.add(name=spec.name, data_type=dtype, dims=config_dims(spec.shape, batched))
    if triton.dynamic_batching is not None:
        db = cfg.dynamic_batching
        db.max_queue_delay_microseconds = triton.dynamic_batching.max_queue_delay_microseconds
        preferred = triton.dynamic_batching.preferred_batch_size
        if preferred is None and profile_opt_batch and 1 <= profile_opt_batch <= triton.max_batch_size:
            preferred = [profile_opt_batch]
        db.preferred_batch_size.extend(preferred or [])
    profiles = [str(i) for i in range(profile_count)] if target == "tensorrt" and profile_count > 1 else []
    for group in triton.instance_group:
        cfg.instance_group.add(count=group.count, kind=mc.ModelInstanceGroup.Kind.Value(group.kind), profile=profiles)
    return cfg


#: target -> the config parameter that sets ONNX Runtime's intra-op threads per instance: the
#: python-onnxruntime template's own, and the stock onnxruntime backend's (its README's
#: ``intra_op_thread_count``). TensorRT has none.
THREADS_PARAMETER = {"python-onnxruntime": "intra_op_threads", "onnxruntime": "intra_op_thread_count"}


def _set_runtime(cfg: ModelConfig, target: str) -> None:
    if target not in RUNTIMES:
        raise TritonConfigError(
            f"model '{cfg.name}': target {target!r} is not one of {', '.join(RUNTIMES)}"
        )
    platform, backend, filename = RUNTIMES[target]
    if platform:
        cfg.platform = platform
        cfg.default_model_filename = filename
    else:
        cfg.backend = backend
    if target == "python-onnxruntime":
        cfg.parameters["onnx_file"].string_value = "model.onnx"


def set_cc_model_filenames(cfg: ModelConfig, files: dict[str, str]) -> None:
    """One repository for several GPU architectures: ``cc_model_filenames`` maps each compute
    capability ("8.9") to its engine file in the version folder (Triton's ``ModelConfig``; the
    TensorRT backend loads the file of the GPU's capability). ``default_model_filename`` becomes the
    first file: a GPU of an unlisted capability falls back to it and fails to deserialize it, which is
    why ``deploy`` gives the pods node affinity to the listed GPUs.

    Raises:
        TritonConfigError: not a ``tensorrt_plan`` config, no file, a capability not "major.minor",
            or one file for two capabilities.
    """
    import re

    if cfg.platform != "tensorrt_plan":
        raise TritonConfigError(f"model '{cfg.name}': cc_model_filenames is for tensorrt_plan, not {cfg.platform!r}")
    if not files:
        raise TritonConfigError(f"model '{cfg.name}': cc_model_filenames needs at least one engine")
    bad = [c for c in files if not re.fullmatch(r"\d+\.\d+", c)]
    if bad or len(set(files.values())) != len(files):
        raise TritonConfigError(f"model '{cfg.name}': cc_model_filenames {files}: capabilities are 'major.minor' "
                                "and each has its own file")
    for cap, name in files.items():
        cfg.cc_model_filenames[cap] = name
    cfg.default_model_filename = next(iter(files.values()))


def generate_config(
    name: str,
    *,
    compute_model: str,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    kv_dtype: str,
    eos_token_ids: Sequence[int],
    default_max_tokens: int,
    max_context: int = 0,
    max_prompt_tokens: int = 0,
    max_concurrent_generations: int = 1,
    continuous_batching: bool = True,
    kv_cache_budget_mib: float = 0.0,
    compute_runtime: str = "bls",
    compute_parameters: dict[str, str] | None = None,
    instances: int = 1,
    intra_op_threads: int = 0,
) -> ModelConfig:
    """Config of the decoupled python-backend generation model.

    I/O (max_batch_size 0), all inputs optional: ``text_input`` TYPE_STRING [1]
    (a prompt) or ``input_ids`` TYPE_INT64 [-1] (prompt token ids, no
    tokenizer round trip), ``max_tokens`` TYPE_INT32 [1], ``ignore_eos``
    TYPE_BOOL [1] (generate exactly ``max_tokens``, for benchmarks) ->
    ``text_output`` TYPE_STRING [1] and ``token_ids`` TYPE_INT64 [1], one
    token per streamed response; the final one adds ``finish_reason``
    TYPE_STRING [1] (``stop`` / ``length``) and ``detail`` TYPE_STRING [1]. Every number
    model.py needs travels in ``parameters`` as strings; ``max_context`` /
    ``max_prompt_tokens`` of 0 mean unlimited (prompts longer than
    ``max_prompt_tokens`` are prefilled in chunks of that many tokens).

    Scheduling: ``continuous_batching`` true: one scheduler loop batches the steps
    of up to ``max_concurrent_generations`` requests (in-flight batching), within
    ``kv_cache_budget_mib`` MiB of KV cache (0: that many full-context
    sequences); false: each request decodes alone on one of
    ``max_concurrent_generations`` threads. ``compute_runtime``: ``bls`` (the
    compute model through BLS) or ``onnxruntime`` (the compute model's ONNX run in
    this process; ``compute_parameters`` then carry ``compute_onnx``, the path
    relative to the repository root, and the compute model's
    ``graph_optimization_level`` / ``dequantize_weights``).

    ``instances``: KIND_CPU instances, each with its own scheduler (and in-process session);
    ``intra_op_threads`` (> 0): that session's ONNX Runtime intra-op threads, parameter
    ``intra_op_threads`` (absent at 0: ONNX Runtime's default).

    Raises:
        ValueError: ``compute_runtime`` is neither ``bls`` nor ``onnxruntime``.
    """
    if compute_runtime not in ("bls", "onnxruntime"):
        raise ValueError(f"compute_runtime {compute_runtime!r}: use 'bls' or 'onnxruntime'")
    cfg = ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for spec in GENERATE_INPUTS:
        cfg.input.add(name=spec.name, data_type=triton_dtype(spec.dtype), dims=config_dims(spec.shape, False),
                      optional=True)
    for spec in GENERATE_OUTPUTS:
        cfg.output.add(name=spec.name, data_type=triton_dtype(spec.dtype), dims=config_dims(spec.shape, False))
    cfg.instance_group.add(count=instances, kind=mc.ModelInstanceGroup.KIND_CPU)
    params = {
        "compute_model": compute_model,
        "num_layers": num_layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_dtype": kv_dtype,
        "eos_token_ids": ",".join(str(t) for t in eos_token_ids),
        "default_max_tokens": default_max_tokens,
        "max_context": max_context,
        "max_prompt_tokens": max_prompt_tokens,
        "max_concurrent_generations": max_concurrent_generations,
        "continuous_batching": int(continuous_batching),
        "kv_cache_budget_mib": kv_cache_budget_mib,
        "compute_runtime": compute_runtime,
        **(compute_parameters or {}),
        **({"intra_op_threads": intra_op_threads} if intra_op_threads else {}),
    }
    for key, value in params.items():
        cfg.parameters[key].string_value = str(value)
    return cfg


#: Encoder tokenizer model: sentence in, the encoder graph's int64 inputs out.
TOKENIZER_INPUT = "text"
TOKENIZER_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids")


def tokenizer_config(
    name: str, *, max_batch_size: int, outputs: Sequence[str], max_length: int, pad_id: int, pad_to_multiple_of: int
) -> ModelConfig:
    """Config of the python-backend tokenizer model of an encoder.

    I/O (batched, ``max_batch_size`` > 0): ``text`` TYPE_STRING [1] per row ->
    each of ``outputs`` (a subset of :data:`TOKENIZER_OUTPUTS`) TYPE_INT64 [-1].
    Parameters (strings): ``max_length`` (truncation, tokens), ``pad_id`` and
    ``pad_to_multiple_of`` (a request's rows are padded to its longest row,
    rounded up to this multiple, so requests of similar length get one shape
    and the compute model can batch them).

    Raises:
        TritonConfigError: an output the tokenizer cannot produce, or
            ``max_batch_size`` < 1.
    """
    check_tokenizer_outputs(name, outputs, max_batch_size)
    cfg = ModelConfig(name=name, backend="python", max_batch_size=max_batch_size)
    cfg.input.add(name=TOKENIZER_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    for out in outputs:
        cfg.output.add(name=out, data_type=mc.TYPE_INT64, dims=[-1])
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    for key, value in (("max_length", max_length), ("pad_id", pad_id), ("pad_to_multiple_of", pad_to_multiple_of)):
        cfg.parameters[key].string_value = str(value)
    return cfg


def check_tokenizer_outputs(name: str, outputs: Sequence[str], max_batch_size: int) -> None:
    """Raises TritonConfigError unless the tokenizer model can make ``outputs`` (the encoder
    graph's inputs) and ``max_batch_size`` >= 1."""
    unknown = sorted(set(outputs) - set(TOKENIZER_OUTPUTS))
    if unknown or max_batch_size < 1:
        raise TritonConfigError(
            f"model '{name}': the tokenizer model makes {list(TOKENIZER_OUTPUTS)} with max_batch_size >= 1; "
            f"the encoder graph needs {unknown or list(outputs)} (max_batch_size {max_batch_size})"
        )


def ensemble_config(name: str, tokenizer: ModelConfig, compute: ModelConfig) -> ModelConfig:
    """Ensemble ``text`` -> ``tokenizer`` -> ``compute`` -> the compute model's outputs.

    Every tokenizer output feeds the compute input of the same name; the
    ensemble's outputs are the compute model's, with the same names, types and dims.
    """
    cfg = ModelConfig(name=name, platform="ensemble", max_batch_size=compute.max_batch_size)
    cfg.input.add(name=TOKENIZER_INPUT, data_type=mc.TYPE_STRING, dims=[1])
    for out in compute.output:
        cfg.output.add(name=out.name, data_type=out.data_type, dims=list(out.dims))
    first = cfg.ensemble_scheduling.step.add(model_name=tokenizer.name, model_version=-1)
    first.input_map[TOKENIZER_INPUT] = TOKENIZER_INPUT
    second = cfg.ensemble_scheduling.step.add(model_name=compute.name, model_version=-1)
    for out in tokenizer.output:
        first.output_map[out.name] = out.name
        second.input_map[out.name] = out.name
    for out in compute.output:
        second.output_map[out.name] = out.name
    return cfg


def check_ensemble(cfg: ModelConfig, models: dict[str, ModelConfig]) -> None:
    """Refuse an ensemble whose steps do not connect.

    Raises:
        TritonConfigError: a step names a model not in ``models`` or a tensor
            that model does not have; a step reads a tensor no earlier step
            (or the ensemble input) makes, with another data type; an ensemble
            output no step makes.
    """
    available = {t.name: t.data_type for t in cfg.input}
    for i, step in enumerate(cfg.ensemble_scheduling.step):
        model = models.get(step.model_name)
        if model is None:
            _fail(cfg, f"ensemble_scheduling.step[{i}]", f"model '{step.model_name}' is not in the repository")
        ins = {t.name: t.data_type for t in model.input}
        outs = {t.name: t.data_type for t in model.output}
        for model_input, tensor in step.input_map.items():
            if model_input not in ins or available.get(tensor) != ins[model_input]:
                _fail(cfg, f"ensemble_scheduling.step[{i}].input_map['{model_input}']", f"tensor '{tensor}' "
                      f"({_type_name(available.get(tensor))}) does not feed input '{model_input}' of "
                      f"'{step.model_name}' ({_type_name(ins.get(model_input))})")
        for model_output, tensor in step.output_map.items():
            if model_output not in outs:
                _fail(cfg, f"ensemble_scheduling.step[{i}].output_map['{model_output}']",
                      f"'{step.model_name}' has no output '{model_output}'; it has {sorted(outs)}")
            available[tensor] = outs[model_output]
    for out in cfg.output:
        if available.get(out.name) != out.data_type:
            _fail(cfg, f"output '{out.name}'", "no ensemble step makes it with this data type")


def _type_name(dtype: int | None) -> str:
    return "missing" if dtype is None else mc.DataType.Name(dtype)


def check_config(
    cfg: ModelConfig,
    onnx_inputs: Sequence[TensorSpec],
    onnx_outputs: Sequence[TensorSpec],
    *,
    profile_max_batch: int | None,
    target: str,
    version_dirs: Sequence[str],
    gpu_available: bool = False,
    profile_count: int | None = None,
) -> None:
    """Refuse a config that Triton would reject or that would serve the graph wrongly.

    Args:
        cfg: the config to check.
        onnx_inputs, onnx_outputs: the graph's I/O (full shapes, batch axis
            first); for the generation model, :data:`GENERATE_INPUTS` /
            :data:`GENERATE_OUTPUTS`.
        profile_max_batch: the max batch every optimization profile serves, or None.
        target: resolved target, a key of :data:`RUNTIMES`.
        version_dirs: names of the entries in the model folder.
        gpu_available: whether a GPU can run an ``onnxruntime`` model (see the
            module's device rule).
        profile_count: optimization profiles in the engine (target
            ``tensorrt``); None: not checked.

    Raises:
        TritonConfigError: naming the model and field, for: an unknown target
            or platform/backend that does not match it; an instance kind the
            target cannot run on; no numeric version folder (or a missing
            ``version_policy.specific`` version); batching on a graph with a
            fixed batch axis; max_batch_size above the profile's max batch; a
            preferred_batch_size outside 1..max_batch_size; an
            ``instance_group.profile`` on a non-TensorRT target, or one that is
            not an index in 0..profile_count-1, or an engine with several
            profiles whose instance groups do not list them; an input/output
            name that is not in the graph, listed twice or (inputs) missing;
            a data type, rank or fixed dim that differs from the graph; dims
            that include the batch axis while max_batch_size > 0; a reshape
            whose element count differs from dims.
    """
    _check_runtime(cfg, target, gpu_available)
    _check_profiles(cfg, target, profile_count)
    _check_versions(cfg, version_dirs)
    _check_batching(cfg, [*onnx_inputs, *onnx_outputs], profile_max_batch)
    _check_tensors(cfg, "input", cfg.input, onnx_inputs)
    _check_tensors(cfg, "output", cfg.output, onnx_outputs)


def _fail(cfg: ModelConfig, field: str, message: str) -> None:
    raise TritonConfigError(f"model '{cfg.name}': {field}: {message}")


def _check_runtime(cfg: ModelConfig, target: str, gpu_available: bool) -> None:
    if target not in RUNTIMES:
        _fail(cfg, "target", f"{target!r} is not one of {', '.join(RUNTIMES)}")
    platform, backend, _ = RUNTIMES[target]
    if (cfg.platform, cfg.backend) != (platform, backend):
        _fail(cfg, "platform/backend", f"platform {cfg.platform!r} backend {cfg.backend!r} does not "
              f"serve target {target!r} (needs platform {platform!r} backend {backend!r})")
    cpu_only = target in ("python-onnxruntime", "python") or (target == "onnxruntime" and not gpu_available)
    for i, group in enumerate(cfg.instance_group):
        kind = mc.ModelInstanceGroup.Kind.Name(group.kind)
        if target == "tensorrt" and group.kind == mc.ModelInstanceGroup.KIND_CPU:
            _fail(cfg, f"instance_group[{i}].kind", "KIND_CPU cannot run a tensorrt_plan (TensorRT "
                  "engines run only on GPU); use KIND_GPU or KIND_AUTO")
        if cpu_only and group.kind == mc.ModelInstanceGroup.KIND_GPU:
            why = "no GPU was found for onnxruntime" if target == "onnxruntime" else "it runs ONNX Runtime's CPU provider"
            _fail(cfg, f"instance_group[{i}].kind", f"{kind} on CPU-only target {target!r} ({why}); "
                  "use KIND_CPU or KIND_AUTO")


def _check_profiles(cfg: ModelConfig, target: str, profile_count: int | None) -> None:
    for i, group in enumerate(cfg.instance_group):
        field = f"instance_group[{i}].profile"
        if group.profile and target != "tensorrt":
            _fail(cfg, field, f"{list(group.profile)}: optimization profiles exist only for target 'tensorrt', "
                  f"not {target!r}; remove it")
        if profile_count is None or target != "tensorrt":
            continue
        valid = [str(p) for p in range(profile_count)]
        bad = [p for p in group.profile if p not in valid]
        if bad:
            _fail(cfg, field, f"{bad} are not profile indices of the engine, which has {profile_count} "
                  f"(valid: {valid})")
        if profile_count > 1 and not group.profile:
            _fail(cfg, field, f"empty, so Triton uses only profile 0 of the engine's {profile_count}; "
                  f"list them, e.g. {valid}")


def _check_versions(cfg: ModelConfig, version_dirs: Sequence[str]) -> None:
    versions = {int(d) for d in version_dirs if d.isdigit() and (d == "0" or not d.startswith("0"))}
    if not versions:
        _fail(cfg, "version folder", f"no numeric version folder (like '1/') next to config.pbtxt; "
              f"found {sorted(version_dirs)}")
    if cfg.version_policy.HasField("specific"):
        missing = sorted(set(cfg.version_policy.specific.versions) - versions)
        if missing:
            _fail(cfg, "version_policy.specific.versions", f"version folder(s) {missing} do not exist; "
                  f"found {sorted(versions)}")


def _check_batching(cfg: ModelConfig, specs: Sequence[TensorSpec], profile_max_batch: int | None) -> None:
    mbs = cfg.max_batch_size
    if mbs > 0 or cfg.HasField("dynamic_batching"):
        field = "max_batch_size" if mbs > 0 else "dynamic_batching"
        for spec in specs:
            if not spec.shape or not is_dynamic(spec.shape[0]):
                _fail(cfg, field, f"batching is enabled but '{spec.name}' has a fixed batch axis in the "
                      f"graph (shape {spec.shape}); set max_batch_size: 0 without dynamic_batching, "
                      "or export with a dynamic first axis")
    if profile_max_batch is not None and mbs > profile_max_batch:
        _fail(cfg, "max_batch_size", f"{mbs} is greater than the optimization profile's max batch "
              f"{profile_max_batch} (the smallest over all profiles: each must serve it); lower it or raise "
              "the profile's batch max")
    for size in cfg.dynamic_batching.preferred_batch_size:
        if not 1 <= size <= max(mbs, 1):
            _fail(cfg, "dynamic_batching.preferred_batch_size", f"{size} is outside 1..max_batch_size ({mbs})")


def _check_tensors(cfg: ModelConfig, kind: str, entries: Sequence, specs: Sequence[TensorSpec]) -> None:
    graph = {s.name: s for s in specs}
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        field = f"{kind}[{i}] '{entry.name}'"
        if entry.name in seen:
            _fail(cfg, field, f"listed twice in {kind}")
        seen.add(entry.name)
        if entry.name not in graph:
            _fail(cfg, field, f"not a model {kind}; the model's {kind}s are {sorted(graph)}")
        spec = graph[entry.name]
        expected = triton_dtype(spec.dtype, f"model '{cfg.name}': {field}: ")
        if entry.data_type != expected:
            _fail(cfg, f"{field}.data_type", f"{mc.DataType.Name(entry.data_type)} does not match the "
                  f"model's {spec.dtype} ({mc.DataType.Name(expected)})")
        _check_dims(cfg, field, entry, spec)
    missing = sorted(set(graph) - seen)
    if kind == "input" and missing:
        _fail(cfg, "input", f"model input(s) {missing} are missing from the config")


def _check_dims(cfg: ModelConfig, field: str, entry, spec: TensorSpec) -> None:
    batched = cfg.max_batch_size > 0
    dims = list(entry.dims)
    model_dims = list(entry.reshape.shape) if entry.HasField("reshape") else dims
    expected = config_dims(spec.shape, batched)
    if entry.HasField("reshape"):
        _check_reshape(cfg, field, dims, model_dims)
    if batched and len(model_dims) == len(spec.shape):
        _fail(cfg, f"{field}.dims", f"{model_dims} include the batch axis; with max_batch_size "
              f"{cfg.max_batch_size} > 0 dims exclude it (expected {expected})")
    if len(model_dims) != len(expected):
        _fail(cfg, f"{field}.dims", f"rank {len(model_dims)} ({model_dims}) does not match the model's "
              f"rank {len(expected)} (graph shape {spec.shape}, expected dims {expected})")
    for axis, (got, want) in enumerate(zip(model_dims, expected)):
        if got == 0 or got < -1 or (want != -1 and got != want):
            _fail(cfg, f"{field}.dims[{axis}]", f"{got} does not fit the model's dim "
                  f"{'variable (-1 or > 0)' if want == -1 else want} (expected dims {expected})")


def _check_reshape(cfg: ModelConfig, field: str, dims: list[int], shape: list[int]) -> None:
    def fixed_count(values: list[int]) -> int:
        count = 1
        for v in values:
            count *= v if v >= 0 else 1
        return count

    same_variable = dims.count(-1) == shape.count(-1)
    if not same_variable or fixed_count(dims) != fixed_count(shape):
        _fail(cfg, f"{field}.reshape", f"shape {shape} does not hold the same number of elements as "
              f"dims {dims}")
