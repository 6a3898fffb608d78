"""Recipe schema: the strict, typed description of one pipeline run.

Every section is a pydantic model with ``extra="forbid"``: an unknown key, a
wrong type or an impossible value fails in :func:`load_recipe`, before any
work starts, with the file, the key path and what would be valid.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import typing
from pathlib import Path
from collections.abc import Sequence
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pipeline.datasets.schema import DataSource
from pipeline.errors import RecipeError
from pipeline.models.sources import SOURCE_KEYS, ModelSourceSpec, legacy_problem

Precision = Literal["fp8", "int8", "fp16", "fp32"]
CalibrationMethod = Literal["max", "percentile", "entropy", "mse"]
InstanceKind = Literal["KIND_CPU", "KIND_GPU", "KIND_AUTO"]
#: Model kinds, named after the field's tasks; each has an adapter in pipeline/models/<kind>/
#: (pipeline.models.registry maps kind -> adapter; tests check the two lists agree).
ModelKind = Literal["text-generation", "sentence-embedding", "image-classification", "generic"]
#: Kind names of older recipes -> their new name (refused, with the new form in the message).
RENAMED_KINDS = {"causal-lm": "text-generation", "encoder": "sentence-embedding"}
TritonTarget = Literal["auto", "tensorrt", "onnxruntime", "python-onnxruntime"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(Strict):
    """The model: its task (``kind``) and where it comes from (``source``, one of
    package / path / entry / onnx; see :mod:`pipeline.models.sources`)."""

    kind: ModelKind = Field(description="the task: selects the adapter in pipeline/models/<kind>/")
    source: ModelSourceSpec = Field(
        description="{package: P, file: F} | {path: ./hf-folder-or.gguf} | {entry: ./file.py:fn} | "
        "{onnx: ./model.onnx, tokenizer: ./tok}; relative paths are read from the recipe's folder"
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data):
        """``model.package`` / ``model.path`` of older recipes fail with the ``source:`` form."""
        from pipeline.recipe_checks import ConstraintErrors

        problem = legacy_problem(data)
        if problem:
            field = "package" if "package" in data else "path"
            raise ConstraintErrors([(("model", field), problem)])
        return data

    @field_validator("kind", mode="before")
    @classmethod
    def _renamed_kind(cls, value):
        """An old kind name fails with the new form (``causal-lm`` -> ``text-generation``)."""
        if isinstance(value, str) and value in RENAMED_KINDS:
            raise PydanticCustomError("renamed_kind", "'{old}' was renamed; use kind: {new}",
                                      {"old": value, "new": RENAMED_KINDS[value]})
        return value


class Tolerance(Strict):
    rtol: float = Field(gt=0)
    atol: float = Field(gt=0)


class ExportConfig(Strict):
    opset: int = Field(19, ge=17, le=23)
    dynamic_axes: dict[str, dict[int, str]] = Field(
        description="input name -> {axis index: symbolic dim name}"
    )
    rtol: float | None = Field(None, gt=0, description="default: the FP32 tolerance in pipeline.compare")
    atol: float | None = Field(None, gt=0)
    tolerances: dict[str, Tolerance] = Field(
        default_factory=dict, description="per output name (fnmatch pattern): rtol/atol overrides"
    )
    check_points: list[dict[str, int]] = Field(
        default_factory=list,
        description="shape points (dim name -> size) where ONNX is checked against torch; "
        "default: min/opt/max of the first profile",
    )


def _flow(value: object) -> str:
    """``value`` as one line of YAML flow style, keys in their given order."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 20).strip()


def _refuse_old_fields(data: object, at: tuple[str, ...], fields: Sequence[str]) -> object:
    """A section mapping of an older recipe shape fails here, each old field with its
    new form (``dataset`` + ``split`` -> ``data``, flat ``gates``, ``metric``).

    Raises:
        ConstraintErrors: (loc, message) per old field found, ``loc`` from the recipe root.
    """
    from pipeline.recipe_checks import ConstraintErrors, Problem

    if not isinstance(data, dict):
        return data
    problems: list[Problem] = []
    old = [k for k in ("dataset", "split") if k in data and k in fields]
    if old:
        new: dict = {"type": "corpus", "name": data.get("dataset", "lee_background")}
        if isinstance(data.get("split"), dict):
            new["split"] = data["split"]
        problems.append(((*at, old[0]), f"{' and '.join(old)} were replaced by a data source (types corpus, text, "
                         f"jsonl, pairs, images, npz); write data: {_flow(new)}"))
    if "metric" in fields and "metric" in data:
        problems.append(((*at, "metric"), "removed: it was never read (the model kind decides what validate "
                         "measures); delete it"))
    if "gates" in fields and isinstance(data.get("gates"), dict):
        problems.append(((*at, "gates"), f"flat gate fields were replaced by a list of {{metric: <name>, max: <x>}} "
                         f"or {{metric: <name>, min: <x>}}; write gates: {_flow(_gate_list(data['gates']))}"))
    if problems:
        raise ConstraintErrors(problems)
    return data


#: Flat gate fields of older recipes -> (metric, bound) of the gate that replaces each.
OLD_GATE_FIELDS = {
    "max_relative_perplexity_increase": ("relative_perplexity_increase", "max"),
    "min_token_agreement": ("token_agreement", "min"),
    "max_spearman_drop": ("spearman_drop_max", "max"),
    "min_mean_cosine": ("mean_cosine", "min"),
}


def _gate_list(flat: dict) -> list[dict]:
    """The gate list equivalent to an older recipe's flat ``gates`` mapping (unknown fields skipped)."""
    out = []
    for field, value in flat.items():
        if field in OLD_GATE_FIELDS and value is not None:
            metric, bound = OLD_GATE_FIELDS[field]
            out.append({"metric": metric, bound: value})
    return out


class CalibrationConfig(Strict):
    method: CalibrationMethod = "max"
    percentile: float = Field(99.99, gt=90, le=100)
    data: DataSource = Field(description="calibration text (pipeline.datasets); must not overlap validate.data")
    samples: int = Field(ge=1, description="number of calibration sequences")
    min_samples: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=2)
    batch_size: int = Field(4, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _old_shape(cls, data: object) -> object:
        return _refuse_old_fields(data, ("quantize", "calibration"), ("dataset", "split"))

    @model_validator(mode="after")
    def _name_data(self) -> "CalibrationConfig":
        self.data._where = "quantize.calibration.data"  # data errors name the recipe key
        return self

    @model_validator(mode="after")
    def _enough(self) -> "CalibrationConfig":
        if self.samples < self.min_samples:
            raise ValueError(
                f"samples ({self.samples}) is below min_samples ({self.min_samples})"
            )
        return self


class ExcludeConfig(Strict):
    """Nodes kept in high precision. Each pattern must match at least one node."""

    nodes: list[str] = Field(
        default_factory=list,
        description="fnmatch patterns on node names or torch module scopes",
    )
    op_types: list[str] = Field(default_factory=list)


class QuantizeConfig(Strict):
    precision: Precision
    calibration: CalibrationConfig | None = None
    exclude: ExcludeConfig = ExcludeConfig()
    per_channel_weights: bool = Field(
        False, description="per output channel weight scales (INT8 default in recipes)"
    )
    quantize_op_types: list[Literal["MatMul", "Gemm", "Conv"]] = ["MatMul", "Gemm"]
    rest_precision: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="precision written into the graph for everything but the Q/DQ GEMMs and the I/O "
        "(pipeline.quant.autocast); bf16 is validated only through a TensorRT engine")
    smoothquant: SmoothQuantConfig | None = Field(None, description="SmoothQuant before Q/DQ (pipeline.quant.smoothquant)")
    accuracy_budget: Gate | None = Field(
        None, description="a gate on a tuning-split metric (kld_mean, relative_perplexity_increase, top1_agreement) "
        "that the automatic exclusion search must meet (pipeline.quant.budget)")
    tuning: TuningConfig | None = Field(None, description="tuning split and search bounds for sensitivity/budget")
    sensitivity: SensitivityConfig | None = None

    @model_validator(mode="after")
    def _needs_calibration(self) -> "QuantizeConfig":
        if self.precision in ("fp8", "int8") and self.calibration is None:
            raise ValueError(f"precision {self.precision!r} needs a calibration section")
        return self

    @model_validator(mode="after")
    def _tuning_fits(self) -> "QuantizeConfig":
        uses = [k for k in ("smoothquant", "accuracy_budget", "sensitivity") if getattr(self, k) is not None]
        if uses and self.precision not in ("fp8", "int8"):
            raise ValueError(f"{', '.join(uses)} need precision fp8 or int8, not {self.precision!r}")
        if (self.accuracy_budget or self.sensitivity) and self.tuning is None:
            raise ValueError("accuracy_budget and sensitivity need a tuning section: tuning: {data: <source disjoint "
                             "from calibration and validate data>}")
        trial = ("kld_mean", "relative_perplexity_increase", "top1_agreement")
        if self.accuracy_budget is not None and self.accuracy_budget.metric not in trial:
            raise ValueError(f"accuracy_budget.metric {self.accuracy_budget.metric!r} is not measured on the tuning "
                             f"split; valid: {list(trial)}")
        return self


class SmoothQuantConfig(Strict):
    alpha: float = Field(0.5, ge=0, le=1, description="migration strength (Xiao et al. 2023)")


class TuningConfig(Strict):
    data: DataSource = Field(description="tuning data: disjoint from quantize.calibration.data and validate.data")
    max_windows: int = Field(8, ge=1, description="windows of calibration.seq_len tokens (reference kept in memory)")
    max_trials: int = Field(100, ge=1, description="budget-search trials after the sensitivity pass")
    time_limit_s: float = Field(540.0, gt=0, description="wall-clock bound of the budget search")
    min_quantized_fraction: float = Field(0.0, ge=0, le=1, description="floor on quantized / all weight GEMMs")

    @model_validator(mode="after")
    def _name_data(self) -> "TuningConfig":
        self.data._where = "quantize.tuning.data"
        return self


class SensitivityConfig(Strict):
    groups: Literal["per_block", "per_projection", "per_gemm"] = Field(
        "per_block", description="GEMM groups measured and reverted together (pipeline.quant.sensitivity.group_of)")
    refine: bool = Field(False, description="after the budget search, split the groups it keeps in high precision "
                         "into single GEMMs and re-quantize what the budget allows (pipeline.quant.budget)")


class DimRange(Strict):
    min: int = Field(ge=0)
    opt: int = Field(ge=0)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "DimRange":
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}/{self.opt}/{self.max}")
        return self


class ShapeRange(Strict):
    min: list[int]
    opt: list[int]
    max: list[int]

    @model_validator(mode="after")
    def _consistent(self) -> "ShapeRange":
        if not len(self.min) == len(self.opt) == len(self.max):
            raise ValueError(
                f"min/opt/max must have the same rank, got {len(self.min)}/{len(self.opt)}/{len(self.max)}"
            )
        for i, (a, b, c) in enumerate(zip(self.min, self.opt, self.max)):
            if not 0 <= a <= b <= c:
                raise ValueError(f"axis {i}: need 0 <= min <= opt <= max, got {a}/{b}/{c}")
        return self


class Profile(Strict):
    """One TensorRT optimization profile.

    ``dims`` gives min/opt/max per symbolic dimension name (from
    ``export.dynamic_axes``); ``inputs`` overrides whole shapes per input.
    """

    name: str
    dims: dict[str, DimRange] = Field(default_factory=dict)
    inputs: dict[str, ShapeRange] = Field(default_factory=dict)


#: Which builder makes the engine (pipeline.engine_backends): ``auto`` picks datacenter TensorRT
#: where it and a GPU are present, else TensorRT-RTX for ``build.targets``.
BuildBackend = Literal["auto", "tensorrt", "tensorrt-rtx", "none"]
#: A GPU architecture as ``sm<major><minor>`` (compute capability 8.9 -> ``sm89``).
ComputeTarget = Literal["sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm120", "sm121"]


class BuildConfig(Strict):
    profiles: list[Profile] = Field(min_length=1)
    backend: BuildBackend = Field(
        "auto", description="auto: datacenter TensorRT where it and a CUDA GPU are present, else TensorRT-RTX for "
        "the declared targets (no GPU needed; a target it lacks, e.g. sm90, gets a parse-and-build check for "
        "sm89); tensorrt: datacenter TensorRT only; tensorrt-rtx: TensorRT-RTX only; none: trtexec.sh only")
    targets: list[ComputeTarget] = Field(
        default_factory=list, description="compute capabilities the engine is for, e.g. [sm89] (L4, L40S, RTX 40xx); "
        "that of triton.serving.gpu is added. TensorRT-RTX builds sm75/80/86/89/120/121, not sm90/sm100")
    timing_cache: str = Field(".cache/trt/timing.cache", description="datacenter TensorRT's timing cache file "
                              "(TensorRT-RTX ignores timing caches: its calls are deprecated no-ops)")
    workspace_mib: int = Field(4096, ge=64)
    builder_optimization_level: int = Field(3, ge=0, le=5)


class GenerationCheck(Strict):
    prompts: int = Field(8, ge=1)
    new_tokens: int = Field(32, ge=1)


class Gate(Strict):
    """One accuracy gate: a metric the model kind writes to ``validate/metrics.json``
    and exactly one bound, ``{metric: relative_perplexity_increase, max: 0.015}``.
    The same type serves ``validate.gates`` and accuracy budgets (pipeline.gates)."""

    metric: str = Field(pattern=r"^[a-z][a-z0-9_]*$",
                        description="a metric of the model kind (pipeline.gates.kind_metrics lists them)")
    max: float | None = Field(None, allow_inf_nan=False, description="passes when metric <= max")
    min: float | None = Field(None, allow_inf_nan=False, description="passes when metric >= min")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]+$",
                             description="report and junit name; default max_<metric> or min_<metric>")

    @model_validator(mode="after")
    def _one_bound(self) -> "Gate":
        if (self.max is None) == (self.min is None):
            got = "both" if self.max is not None else "neither"
            raise ValueError(f"give exactly one bound, max: <x> or min: <x> (got {got})")
        return self

    @property
    def label(self) -> str:
        """The gate's name in the report and junit: ``name``, else ``max_<metric>`` / ``min_<metric>``."""
        return self.name or f"{'max' if self.max is not None else 'min'}_{self.metric}"


#: ``validate.gates``: every gate must pass for anything to be published.
Gates = list[Gate]


class ValidateConfig(Strict):
    data: DataSource = Field(description="held-out eval data (pipeline.datasets); must not overlap calibration")
    seq_len: int = Field(256, ge=8)
    max_windows: int = Field(32, ge=1)
    batch_size: int = Field(4, ge=1)
    generation: GenerationCheck | None = None
    gates: Gates = Field(description="list of {metric: <name>, max: <x>} / {metric: <name>, min: <x>}")

    @model_validator(mode="before")
    @classmethod
    def _old_shape(cls, data: object) -> object:
        return _refuse_old_fields(data, ("validate",), ("dataset", "split", "metric", "gates"))

    @model_validator(mode="after")
    def _name_data(self) -> "ValidateConfig":
        self.data._where = "validate.data"  # data errors name the recipe key
        return self


class DynamicBatching(Strict):
    max_queue_delay_microseconds: int = Field(100, ge=0)
    preferred_batch_size: list[int] | None = None


class InstanceGroup(Strict):
    """Triton instances of the compute model. ``KIND_AUTO`` (default) lets Triton pick the
    device at load time, so one recipe serves a TensorRT engine (GPU) or ONNX Runtime (CPU)."""

    count: int = Field(1, ge=1)
    kind: InstanceKind = "KIND_AUTO"


class ServingRuntime(Strict):
    """The Triton runtime an engine is built for (see pipeline.serving): a container
    tag or a TensorRT version, plus the GPU model. Checked only when an engine is built."""

    container: str | None = Field(None, pattern=r"^\d{2}\.\d{2}(-[a-z0-9\-]+)?$",
                                  description="Triton tag, e.g. '25.01-trtllm-python-py3' or '25.01' (-py3)")
    tensorrt: str | None = Field(None, pattern=r"^\d+\.\d+\.\d+(\.\d+)?$", description="e.g. '10.8.0.43'")
    gpu: str = Field(min_length=1, description="GPU model, e.g. 'H100' or 'NVIDIA L40S'")
    compute_capability: str | None = Field(None, pattern=r"^\d+\.\d+$", description="default: from the GPU model")

    @model_validator(mode="after")
    def _resolvable(self) -> "ServingRuntime":
        from pipeline import serving

        if self.container is None and self.tensorrt is None:
            raise ValueError("give a Triton container tag (container: '25.01-trtllm-python-py3') or a TensorRT "
                             f"version (tensorrt: '10.8.0'); known containers: {', '.join(serving.TRITON_TENSORRT)}")
        if self.tensorrt is None:
            serving.container_tensorrt(self.container or "")  # raises for an unknown tag
        elif self.container in serving.TRITON_TENSORRT and not serving.same_tensorrt(
                self.tensorrt, serving.TRITON_TENSORRT[self.container]):
            raise ValueError(f"tensorrt {self.tensorrt!r} contradicts container {self.container!r}, which ships "
                             f"TensorRT {serving.TRITON_TENSORRT[self.container]}; drop one of them")
        if self.compute_capability is None and serving.gpu_capability(self.gpu) is None:
            raise ValueError(f"gpu {self.gpu!r}: compute capability unknown to this pipeline; add "
                             f"compute_capability (e.g. '9.0'); known models: {', '.join(serving.GPU_CAPABILITY)}")
        return self


class TritonConfig(Strict):
    target: TritonTarget = "auto"
    model_name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    generate_model_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-]+$")
    max_batch_size: int = Field(ge=0)
    dynamic_batching: DynamicBatching | None = None
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    version: int = Field(1, ge=1)
    serving: ServingRuntime | None = Field(
        None, description="Triton runtime + GPU an engine is built for; required only when an engine is built")
    continuous_batching: bool = Field(
        True, description="generation model: one scheduler loop batches every active request's step "
        "(in-flight batching); false: each request decodes on its own thread")
    kv_cache_budget_mib: float = Field(
        0.0, ge=0, description="generation model: KV cache the scheduler may hold, MiB (2 x tokens x layers x "
        "kv_heads x head_dim x bytes); 0: max_batch_size full-context sequences")


class ServeSLO(Strict):
    """Per-request service-level objective; goodput counts the requests that meet it."""

    ttft_ms: float = Field(1000.0, gt=0, description="LLM: time to first token, ms")
    tpot_ms: float = Field(250.0, gt=0, description="LLM: mean time per output token after the first, ms")
    latency_ms: float = Field(1000.0, gt=0, description="non-LLM: request latency, ms")


class ServeConfig(Strict):
    """Serving on a local tritonserver and the ``bench`` load (``python -m pipeline bench``).

    Not part of :attr:`Recipe.digest`: it shapes no build artifact, so changing an
    SLO invalidates no stage and no engine; bench results record the values used.
    """

    slo: ServeSLO = ServeSLO()
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1)
    requests_per_level: int = Field(8, ge=1, description="requests sent at each concurrency level")
    max_tokens: int = Field(32, ge=1, description="LLM: output tokens per request (EOS ignored)")
    long_max_tokens: int = Field(260, ge=2, description="LLM: output tokens of each TPOT-position request")
    long_requests: int = Field(3, ge=1, description="LLM: TPOT-position requests, one after another; TPOT at a "
                               "position is the median over them")
    tpot_positions: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [16, 256], min_length=2, max_length=2,
        description="LLM: output positions whose TPOT is compared (ratio second / first)",
    )
    bucket_tokens: int = Field(64, ge=1, description="sequence length of every request in the batching comparison")
    batching_concurrency: int = Field(16, ge=1, description="concurrency of the batching / instances comparison")
    batching_requests: int = Field(32, ge=1, description="requests per variant in that comparison")
    ready_timeout_s: float = Field(300.0, gt=0, description="how long the server may take to load, s")

    @model_validator(mode="after")
    def _long_enough(self) -> "ServeConfig":
        first, second = self.tpot_positions
        if not first < second:
            raise ValueError(f"tpot_positions: need the first below the second, got {first}, {second}")
        if self.long_max_tokens < second + 4:
            raise ValueError(f"long_max_tokens ({self.long_max_tokens}) must reach tpot_positions[1] + 4 "
                             f"({second + 4}): TPOT there is the median gap of positions {second - 4}..{second + 3}")
        return self


class Recipe(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    model: ModelSource
    export: ExportConfig
    quantize: QuantizeConfig
    build: BuildConfig
    validate_: ValidateConfig = Field(alias="validate")
    triton: TritonConfig
    serve: ServeConfig = Field(default_factory=ServeConfig, exclude=True)
    output_dir: str = "model_repository"
    work_dir: str = "artifacts"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _preflight(self) -> "Recipe":
        """Every constraint between sections that the recipe alone decides, so that
        ``check`` and the start of ``build`` catch it before any stage runs
        (:func:`pipeline.recipe_checks.constraint_problems`)."""
        from pipeline.recipe_checks import ConstraintErrors, constraint_problems

        problems = constraint_problems(self)
        if problems:
            raise ConstraintErrors(problems)
        return self

    def section_hash(self, *sections: str) -> str:
        """sha256 of the named top-level sections (``"validate"`` for validation)."""
        data = self.model_dump(mode="json", by_alias=True)
        picked = {s: data[s] for s in sections}
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()

    @property
    def engine_hash(self) -> str:
        """sha256 of the sections that shape a TensorRT engine (stamped into it)."""
        return self.section_hash("model", "export", "quantize", "build")

    @property
    def digest(self) -> str:
        data = self.model_dump(mode="json", by_alias=True)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


class _RecipeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        _refuse_duplicates(self, node, (), recurse=False)
        return super().construct_mapping(node, deep=deep)


def _key_value(loader: yaml.SafeLoader, key_node: yaml.Node) -> object:
    """The key as the mapping will hold it (``0`` and ``00`` are both int 0)."""
    try:
        value = loader.construct_object(key_node, deep=True)
        hash(value)
        return value
    except (yaml.YAMLError, TypeError):
        return (key_node.tag, str(key_node.value))


def _refuse_duplicates(loader: yaml.SafeLoader, node: yaml.Node, path: tuple, recurse: bool = True) -> None:
    """Raise RecipeError for a key listed twice in one mapping (anywhere under ``node``
    when ``recurse``); ``path`` is the key path of ``node``, for the message."""
    if isinstance(node, yaml.SequenceNode) and recurse:
        for i, item in enumerate(node.value):
            _refuse_duplicates(loader, item, (*path, i))
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[object, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = _key_value(loader, key_node)
        line = key_node.start_mark.line + 1
        if key in seen:
            where = ".".join(str(p) for p in (*path, key_node.value))
            raise RecipeError(f"key {where!r} is given twice, at lines {seen[key]} and {line}; "
                              "keep one (YAML would silently keep the last)")
        seen[key] = line
        if recurse:
            _refuse_duplicates(loader, value_node, (*path, key_node.value))


def parse_yaml(text: str, source: str) -> tuple[object, yaml.Node | None]:
    """Parse one YAML document; returns (data, node tree for line lookups).

    Raises:
        RecipeError: not YAML, or a key given twice in one mapping (naming the
            key path and both lines); the message starts with ``source``.
    """
    try:
        loader = _RecipeLoader(text)  # the reader refuses control characters here
    except yaml.YAMLError as e:
        raise RecipeError(f"{source}: not valid YAML: {e}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _refuse_duplicates(loader, node, ())
        return loader.construct_document(node), node
    except yaml.YAMLError as e:
        raise RecipeError(f"{source}: not valid YAML: {e}") from None
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    finally:
        loader.dispose()


def yaml_line(node: yaml.Node | None, loc: Sequence[str | int]) -> int | None:
    """1-based line of the key at ``loc`` in the node tree (of its deepest existing
    parent when the key itself is absent); None without a tree."""
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if str(k.value) == str(part)), None)
            if match is None:
                break
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


#: Union fields whose error locations carry the chosen member's tag (``model.source.entry.entry``).
_UNION_TAGS = {"source": set(SOURCE_KEYS),
               "data": {"corpus", "text", "jsonl", "pairs", "images", "npz"}}


def _untagged(loc: tuple) -> tuple:
    """``loc`` without the tag pydantic inserts after a discriminated union field."""
    return tuple(part for i, part in enumerate(loc)
                 if not (i and isinstance(loc[i - 1], str) and part in _UNION_TAGS.get(loc[i - 1], ())
                         and i + 1 < len(loc)))


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic model that holds the key at ``loc`` (a validation error's location), or None
    where the path goes through something other than plain nested models and lists."""
    model: type[BaseModel] = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # a list item: its model is the list's item type, resolved below
        field = model.model_fields.get(part)
        if field is None:
            return None
        target = field.annotation
        while typing.get_origin(target) is not None:  # Optional[...] / list[...] / Annotated[...]
            args = [a for a in typing.get_args(target) if a is not type(None)]
            if len(args) != 1:
                return None
            target = args[0]
        if not (isinstance(target, type) and issubclass(target, BaseModel)):
            return None
        model = target
    return model


def _unknown_key_message(loc: tuple) -> str:
    """``unknown key`` with the closest valid key and the valid keys, where they can be found."""
    model = _model_at(loc)
    if model is None or not isinstance(loc[-1], str):
        return "unknown key; remove it or check its spelling"
    valid = sorted(f.alias or name for name, f in model.model_fields.items())
    close = difflib.get_close_matches(loc[-1], valid, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown key; {hint}valid keys here: {', '.join(valid)}"


def _format_errors(path: Path, err: ValidationError, node: yaml.Node | None, overrides: Sequence[str]) -> str:
    """One line per failing key: ``file:line: key.path: what is wrong (got ...)``."""
    from pipeline.recipe_checks import ConstraintErrors, dotted

    items: list[tuple[tuple, str]] = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, ConstraintErrors):
            items += cause.problems
            continue
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = _unknown_key_message(tuple(e["loc"]))
        got = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        items.append((_untagged(tuple(e["loc"])), msg + shown))
    lines = [f"{path}: invalid recipe ({len(items)} error(s))"]
    for loc, msg in items:
        key = dotted(loc)
        setters = [o for o in overrides if key == o or key.startswith(o + ".") or o.startswith(key + ".")]
        line = yaml_line(node, loc)
        if setters:
            lines.append(f"  {key}: {msg} [from --set {setters[-1]}]")
        elif line is not None:
            lines.append(f"  {path}:{line}: {key}: {msg}")
        else:
            lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def load_recipe(path: str | Path, overrides: dict | None = None) -> Recipe:
    """Read and validate a YAML recipe. Its data sources are bound to the recipe's
    folder: relative data paths are read from there.

    Args:
        path: the recipe file.
        overrides: dotted key path (list indices allowed, ``build.profiles.0.dims.batch.max``)
            -> value, applied before validation (the CLI's ``--set``).

    Raises:
        RecipeError: the file is missing, is not YAML, gives a key twice in one
            mapping, an override path does not fit the recipe, or the recipe breaks
            the schema; the message names the file, each failing key path with its
            YAML line (or the ``--set`` that set it) and what is valid.
    """
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: cannot read the recipe: {e}") from None
    data, node = parse_yaml(text, str(path))
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: top level must be a mapping of sections")
    for dotted_key, value in (overrides or {}).items():
        _refuse_old_set(dotted_key)
        set_dotted(data, dotted_key, value)
    try:
        return Recipe.model_validate(data, context={"base_dir": path.parent})
    except ValidationError as e:
        raise RecipeError(_format_errors(path, e, node, list(overrides or {}))) from None


def _refuse_old_set(dotted_key: str) -> None:
    """A ``--set`` of a field of the older recipe shape fails with the key to set now.

    Raises:
        RecipeError: the key is a flat gate field, ``dataset``/``split`` of calibration
            or validate, or ``validate.metric``.
    """
    parts = dotted_key.split(".")
    if parts[:2] == ["validate", "gates"] and len(parts) == 3 and parts[2] in OLD_GATE_FIELDS:
        metric, bound = OLD_GATE_FIELDS[parts[2]]
        raise RecipeError(f"--set {dotted_key}: validate.gates is now a list; set the bound of the gate on "
                          f"{metric} by index (--set validate.gates.<i>.{bound}=<x>) or give the whole list "
                          f"(--set 'validate.gates=[{{metric: {metric}, {bound}: <x>}}]')")
    for section in (["validate"], ["quantize", "calibration"]):
        n = len(section)
        if parts[:n] == section and len(parts) > n and parts[n] in ("dataset", "split"):
            rest = ".".join(["split", *parts[n + 1:]] if parts[n] == "split" else ["name"])
            raise RecipeError(f"--set {dotted_key}: {parts[n]} moved into the data source; "
                              f"set {'.'.join(section)}.data.{rest}")
    if parts == ["validate", "metric"]:
        raise RecipeError("--set validate.metric: removed (it was never read); drop this --set")


def set_dotted(data: dict, dotted_key: str, value: object) -> None:
    """Set ``data[k1][k2]...`` = ``value`` for ``dotted_key`` "k1.k2...": a part that
    indexes a list must be an index in range; missing mapping keys are created.

    Raises:
        RecipeError: an empty part, an index that is not an int or out of range, or a
            path through a scalar; the message names ``--set KEY``.
    """
    parts = dotted_key.split(".")
    if not all(parts):
        raise RecipeError(f"--set {dotted_key}: empty key part; write a dotted path like validate.gates.0.max")
    node: object = data
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        here = ".".join(parts[:depth]) or "the recipe"
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"--set {dotted_key}: {here} is a list of {len(node)} item(s); "
                                  f"{part!r} is not an index in 0..{len(node) - 1}; to add or remove items, "
                                  f"set the whole list: --set '{here}=[...]'")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            raise RecipeError(f"--set {dotted_key}: {here} is {node!r}, not a section or list, so it has no {part!r}")
