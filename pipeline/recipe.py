"""Recipe schema: the strict, typed description of one pipeline run.

Every section is a pydantic model with ``extra="forbid"``: an unknown key, a
wrong type or an impossible value fails in :func:`load_recipe`, before any
work starts, with the file, the key path and what would be valid.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.errors import RecipeError

Precision = Literal["fp8", "int8", "fp16", "fp32"]
CalibrationMethod = Literal["max", "percentile", "entropy", "mse"]
InstanceKind = Literal["KIND_CPU", "KIND_GPU", "KIND_AUTO"]
TritonTarget = Literal["auto", "tensorrt", "onnxruntime", "python-onnxruntime"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSource(Strict):
    """Where the weights come from: a file inside an installed Python package."""

    kind: Literal["causal-lm", "encoder"]
    package: str | None = Field(
        description="importable package that ships the weights; null: `path` is a local path"
    )
    path: str = Field(description="file (GGUF) or folder (HF layout) inside the package")


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


class Split(Strict):
    """Half-open range ``[start, stop)`` of documents in the corpus."""

    start: int = Field(ge=0)
    stop: int = Field(gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> "Split":
        if self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be greater than start ({self.start})")
        return self

    def overlaps(self, other: "Split") -> bool:
        return self.start < other.stop and other.start < self.stop


class CalibrationConfig(Strict):
    method: CalibrationMethod = "max"
    percentile: float = Field(99.99, gt=90, le=100)
    dataset: Literal["lee_background"] = "lee_background"
    split: Split
    samples: int = Field(ge=1, description="number of calibration sequences")
    min_samples: int = Field(8, ge=1)
    seq_len: int = Field(128, ge=2)
    batch_size: int = Field(4, ge=1)

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
    quantize_op_types: list[Literal["MatMul", "Gemm"]] = ["MatMul", "Gemm"]

    @model_validator(mode="after")
    def _needs_calibration(self) -> "QuantizeConfig":
        if self.precision in ("fp8", "int8") and self.calibration is None:
            raise ValueError(f"precision {self.precision!r} needs a calibration section")
        return self


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


class BuildConfig(Strict):
    profiles: list[Profile] = Field(min_length=1)
    timing_cache: str = ".cache/trt/timing.cache"
    workspace_mib: int = Field(4096, ge=64)
    builder_optimization_level: int = Field(3, ge=0, le=5)


class GenerationCheck(Strict):
    prompts: int = Field(8, ge=1)
    new_tokens: int = Field(32, ge=1)


class Gates(Strict):
    max_relative_perplexity_increase: float | None = Field(None, ge=0)
    min_token_agreement: float | None = Field(None, ge=0, le=1)
    max_spearman_drop: float | None = Field(None, ge=0)
    min_mean_cosine: float | None = Field(None, ge=-1, le=1)


class ValidateConfig(Strict):
    dataset: Literal["lee_background"] = "lee_background"
    split: Split
    metric: Literal["perplexity", "word_similarity"]
    seq_len: int = Field(256, ge=8)
    max_windows: int = Field(32, ge=1)
    batch_size: int = Field(4, ge=1)
    generation: GenerationCheck | None = None
    gates: Gates


class DynamicBatching(Strict):
    max_queue_delay_microseconds: int = Field(100, ge=0)
    preferred_batch_size: list[int] | None = None


class InstanceGroup(Strict):
    count: int = Field(1, ge=1)
    kind: InstanceKind = "KIND_CPU"


class TritonConfig(Strict):
    target: TritonTarget = "auto"
    model_name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    generate_model_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-]+$")
    max_batch_size: int = Field(ge=0)
    dynamic_batching: DynamicBatching | None = None
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()])
    version: int = Field(1, ge=1)


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
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4], min_length=1)
    requests_per_level: int = Field(8, ge=1, description="requests sent at each concurrency level")
    max_tokens: int = Field(32, ge=1, description="LLM: output tokens per request (EOS ignored)")
    long_max_tokens: int = Field(260, ge=2, description="LLM: output tokens of the TPOT-position request")
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
    def _splits_disjoint(self) -> "Recipe":
        cal = self.quantize.calibration
        if cal is not None and cal.split.overlaps(self.validate_.split):
            raise ValueError(
                "quantize.calibration.split "
                f"[{cal.split.start}, {cal.split.stop}) overlaps validate.split "
                f"[{self.validate_.split.start}, {self.validate_.split.stop}): "
                "calibration and eval documents must not overlap"
            )
        return self

    @model_validator(mode="after")
    def _calibration_in_profile(self) -> "Recipe":
        cal = self.quantize.calibration
        dims = self.build.profiles[0].dims
        for dim, value, field in (("batch", cal and cal.batch_size, "batch_size"), ("sequence", cal and cal.seq_len, "seq_len")):
            r = dims.get(dim)
            if value and r is not None and not r.min <= value <= r.max:
                raise ValueError(
                    f"quantize.calibration.{field}={value} lies outside build.profiles[0] {dim} range "
                    f"[{r.min}, {r.max}]; calibrate on shapes the engine will serve"
                )
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


def _format_errors(path: Path, err: ValidationError) -> str:
    lines = [f"{path}: invalid recipe ({err.error_count()} error(s))"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling"
        got = e.get("input")
        shown = "" if e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def load_recipe(path: str | Path, overrides: dict | None = None) -> Recipe:
    """Read and validate a YAML recipe.

    Raises:
        RecipeError: the file is missing, is not YAML, or breaks the schema; the
            message names the file, each failing key path and what is valid.
    """
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: top level must be a mapping of sections")
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(path, e)) from None


def _set_dotted(data: dict, dotted: str, value: object) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = value
