"""Recipe schema: the strict, typed description of one pipeline run.

Every section is a pydantic model with ``extra="forbid"``: an unknown key, a
wrong type or an impossible value fails in :func:`pipeline.recipe.load.load_recipe`,
before any work starts, with the file, the key path and what would be valid. The
constraints between sections are :mod:`pipeline.recipe.checks`, which the loader runs.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, ClassVar, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from pipeline.sources.data.schema import DataSource
from pipeline.sources.model import ModelSourceSpec, legacy_problem
from pipeline.recipe.legacy import RENAMED_KINDS, refuse_old_fields
from pipeline.recipe.problems import ConstraintErrors
from pipeline.recipe import precisions
from pipeline.fsutil import user_path

Precision = Literal[precisions.QUANTIZE]  # type: ignore[valid-type]  # the precision table's
CalibrationMethod = Literal["max", "percentile", "entropy", "mse", "kl"]
InstanceKind = Literal["KIND_CPU", "KIND_GPU", "KIND_AUTO"]
#: Model kinds, named after the field's tasks; each has an adapter in pipeline/models/<kind>/
#: (pipeline.models.registry maps kind -> adapter; tests check the two lists agree).
ModelKind = Literal["text-generation", "sentence-embedding", "image-classification", "generic"]
TritonTarget = Literal["auto", "tensorrt", "onnxruntime", "python-onnxruntime"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Grown(Strict):
    """A section that gained fields after recipes were digested: each field of :attr:`ADDED` dumps
    as absent while it holds the default given there, so the recipe digests, stage keys and pins
    (:func:`pipeline.quant.pin.match_fields`) of recipes that do not use it are what they were
    before it existed."""

    ADDED: ClassVar[dict[str, Any]] = {}

    @model_serializer(mode="wrap")
    def _added_fields_as_before(self, handler):
        data = handler(self)
        if isinstance(data, dict):
            for name, default in self.ADDED.items():
                if getattr(self, name) == default:
                    data.pop(name, None)
        return data


class ModelSource(Strict):
    """The model: its task (``kind``) and where it comes from (``source``, one of
    package / path / entry / onnx; see :mod:`pipeline.sources.model`)."""

    kind: ModelKind = Field(description="the task: selects the adapter in pipeline/models/<kind>/")
    source: ModelSourceSpec = Field(
        description="{package: P, file: F} | {path: ./hf-folder-or.gguf} | {entry: ./file.py:fn} | "
        "{onnx: ./model.onnx, tokenizer: ./tok}; relative paths are read from the recipe's folder"
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data):
        """``model.package`` / ``model.path`` of older recipes fail with the ``source:`` form."""
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
    rtol: float = Field(gt=0, description="relative tolerance of ONNX vs torch for the matched outputs")
    atol: float = Field(gt=0, description="absolute tolerance of ONNX vs torch for the matched outputs")


class ExportConfig(Strict):
    opset: int = Field(19, ge=17, le=23, description="ONNX opset the graph is exported at")
    dynamic_axes: dict[str, dict[int, str]] = Field(
        description="input name -> {axis index: symbolic dim name}"
    )
    rtol: float | None = Field(None, gt=0, description="default: the FP32 tolerance in pipeline.checks.tolerance")
    atol: float | None = Field(None, gt=0, description="default: the FP32 tolerance in pipeline.checks.tolerance")
    tolerances: dict[str, Tolerance] = Field(
        default_factory=dict, description="per output name (fnmatch pattern): rtol/atol overrides"
    )
    check_points: list[dict[str, int]] = Field(
        default_factory=list,
        description="shape points (dim name -> size) where ONNX is checked against torch; "
        "default: min/opt/max of the first profile",
    )


class CalibrationConfig(Strict):
    method: CalibrationMethod = Field("max", description="how each activation's amax is taken over the calibration "
                                      "batches (pipeline.quant.calibrate.collect_amax): max (abs-max), percentile, entropy "
                                      "(ONNX Runtime's INT8 KL threshold), mse / kl (the clip search on the target format's "
                                      "grid: squared error or KL divergence, pipeline.quant.clip.clip_amax)")
    percentile: float = Field(99.99, gt=90, le=100, description="method percentile: the percentile of |x| used as amax")
    data: DataSource = Field(description="calibration text (pipeline.sources.data); must not overlap validate.data")
    samples: int = Field(ge=1, description="number of calibration sequences")
    min_samples: int = Field(8, ge=1, description="quantize fails when the data yields fewer calibration windows")
    seq_len: int = Field(128, ge=2, description="tokens per calibration window (text models)")
    batch_size: int = Field(4, ge=1, description="rows per calibration batch fed to the FP32 graph")

    @model_validator(mode="before")
    @classmethod
    def _old_shape(cls, data: object) -> object:
        return refuse_old_fields(data, ("quantize", "calibration"), ("dataset", "split"))

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
    op_types: list[str] = Field(default_factory=list, description="ONNX op types kept in high precision; each must "
                                "occur in the graph")


#: how weight-only (int4) weights are made: ``source`` takes the GGUF file's own blocks; ``rtn`` rounds
#: the FP32 weights to nearest in symmetric absmax blocks; ``awq`` folds activation-aware per-channel
#: scales (searched on quantize.calibration) into the FP32 graph first (pipeline.quant.awq)
WeightMethod = Literal["rtn", "awq", "source"]
#: methods the quantize stage implements
WEIGHT_METHODS_DONE = ("rtn", "awq", "source")
#: methods that read calibration data (quantize.calibration)
WEIGHT_METHODS_CALIBRATED = ("awq",)


class WeightsConfig(Grown):
    """Weight-only quantization (``quantize.precision: int4``): blocked INT4 weights, FP32 activations."""

    method: WeightMethod = Field(description="source: the model file's own GGUF blocks (Q4_0, Q4_1, Q4_K as INT4; "
                                 "Q8_0, Q6_K as INT8), carried without re-rounding (pipeline.quant.int4); rtn: "
                                 "symmetric absmax blocks of the FP32 weights (int4: the tied lm_head INT8 blocks of 32, "
                                 "pipeline.quant.int4.rewrite_rtn; nvfp4: pipeline.quant.nvfp4); awq: per-channel scales "
                                 "searched on quantize.calibration at the fold points and folded into the FP32 graph, then "
                                 "rtn (int4 only; needs a calibration section)")
    block_size: Literal[16, 32, 64, 128] = Field(32, description="weights per scale along the GEMM's input dimension K; "
                                                 "source: the file's (32 for every GGUF 4-bit type); rtn / awq: must "
                                                 "divide every GEMM's K (TensorRT refuses a partial block) unless pad; "
                                                 "nvfp4: 16, the format's own (its default there), and only there")
    pad: bool = Field(False, description="int4 rtn / awq: a GEMM whose K the block size does not divide stores its "
                      "weight zero-padded to whole blocks (K' = ceil(K / block_size) * block_size rows, INT4 zeros) and "
                      "reads its activation through a Pad (zeros appended, K -> K'; shared by the GEMMs on one input); "
                      "exact (the zero rows add 0), costs (K' - K) * N / 2 bytes per padded GEMM (SmolLM2 at block 128: "
                      "K = 576 -> 640). false: such a block size is refused (pipeline.quant.int4.rewrite_rtn)")

    ADDED: ClassVar[dict[str, Any]] = {"pad": False}


class QuantizeConfig(Grown):
    precision: Precision = Field(description="fp8 / int8: Q/DQ on the weight GEMMs (needs calibration); "
                                 "int4: weight-only INT4 blocks (needs weights; calibration only for weights.method awq); "
                                 "nvfp4: weight-only FP4 E2M1 blocks of 16 with FP8 scales (weights: {method: rtn}; "
                                 "TensorRT for sm100+ only); fp16 / fp32: no Q/DQ")
    calibration: CalibrationConfig | None = Field(None, description="activation ranges; required for fp8 and int8, and for int4 with "
                                                 "weights.method awq (its scale search)")
    exclude: ExcludeConfig = Field(ExcludeConfig(), description="nodes kept in high precision by hand")
    per_channel_weights: bool = Field(
        False, description="per output channel weight scales (INT8 default in recipes)"
    )
    reduce_range: bool = Field(
        False, description="int8 only: 7-bit weights (|q| <= 64, ONNX Runtime's reduce_range). ONNX Runtime's full "
        "optimization level computes those exactly on every x86 CPU, so the graph is validated and served at that level "
        "(integer kernels: faster on CPUs with VNNI); full-range INT8 weights run at the basic level (simulated). Costs one "
        "bit of weight precision (pipeline.ort_sessions.optimization_level)")
    weight_clip: Literal["max", "mse", "kl"] = Field(
        "max", description="fp8 / int8: each weight's amax: its max, or the clip search (mse: squared error, kl: KL "
        "divergence of its values after quantization) choosing a clip ratio per tensor "
        "(pipeline.quant.clip.weight_clip_ratio); no op is added")
    quantize_op_types: list[Literal["MatMul", "Gemm", "Conv"]] = Field(
        ["MatMul", "Gemm"], description="op types whose weight input gets Q/DQ (pipeline.quant.qdq.find_targets)")
    rest_precision: Literal[precisions.REST] = Field(  # type: ignore[valid-type]
        precisions.REFERENCE, description="precision written into the graph for everything but the Q/DQ GEMMs and the I/O "
        "(pipeline.quant.autocast); bf16 is validated only through a TensorRT engine")
    smoothquant: SmoothQuantConfig | None = Field(None, description="SmoothQuant before Q/DQ (pipeline.quant.smoothquant)")
    rotate: bool = Field(False, description="fp8 / int8, Llama-style graphs: fold Hadamard rotations into the FP32 "
                         "weights before calibration, R1 on the residual stream (RMSNorm scales folded first; the tied "
                         "embedding stored rotated, one extra 576x576-style MatMul before the lm_head) and R2 per head on "
                         "v -> o (pipeline.quant.rotate); the FP32 function is unchanged, the V cache holds rotated values")
    accuracy_budget: Gate | None = Field(
        None, description="a gate on a tuning-split metric (kld_mean, relative_perplexity_increase, top1_agreement) "
        "that the automatic exclusion search must meet (pipeline.quant.budget)")
    tuning: TuningConfig | None = Field(None, description="tuning split and search bounds for sensitivity/budget")
    sensitivity: SensitivityConfig | None = Field(None, description="per-group sensitivity pass on the tuning split "
                                                  "(pipeline.quant.sensitivity); needs tuning")
    weights: WeightsConfig | None = Field(None, description="weight-only precisions (int4): where the blocked weights "
                                          "come from, {method: source, block_size: 32}; required for int4, refused "
                                          "for the others")

    @model_validator(mode="after")
    def _needs_calibration(self) -> "QuantizeConfig":
        if self.precision in precisions.CALIBRATED and self.calibration is None:
            raise ValueError(f"precision {self.precision!r} needs a calibration section")
        return self

    @model_validator(mode="before")
    @classmethod
    def _format_block(cls, data):
        """A weight-only format with its own block size (the precision table's ``weight_block``: nvfp4's
        16) gets it where ``weights`` names none."""
        if isinstance(data, dict) and isinstance(data.get("weights"), dict) and "block_size" not in data["weights"]:
            row = precisions.PRECISIONS.get(data.get("precision"))  # type: ignore[arg-type]
            if row is not None and row.weight_block is not None:
                data = {**data, "weights": {**data["weights"], "block_size": row.weight_block}}
        return data

    @model_validator(mode="after")
    def _format_block_fits(self) -> "QuantizeConfig":
        if self.weights is None:
            return self
        own = precisions.facts(self.precision).weight_block
        if own is not None and self.weights.block_size != own:
            raise ValueError(f"weights.block_size: {self.weights.block_size}, but {self.precision} blocks are {own} "
                             f"values per scale (the format's own); set block_size: {own} or leave it out")
        fixed = {p.weight_block: p.name for p in precisions.PRECISIONS.values() if p.weight_block is not None}
        if own is None and self.weights.block_size in fixed:
            raise ValueError(f"weights.block_size: {self.weights.block_size} is {fixed[self.weights.block_size]}'s "
                             f"block, not {self.precision}'s; {self.precision} takes 32, 64 or 128")
        return self

    @model_validator(mode="after")
    def _weights_fit(self) -> "QuantizeConfig":
        weight_only = precisions.facts(self.precision).weight_only
        if weight_only and self.weights is None:
            raise ValueError(f"precision {self.precision!r} needs a weights section, e.g. weights: {{method: source, "
                             "block_size: 32} (the GGUF file's own blocks)")
        if not weight_only and self.weights is not None:
            raise ValueError(f"weights (weight-only blocks) need precision {' or '.join(precisions.WEIGHT_ONLY)}, "
                             f"not {self.precision!r}")
        own = precisions.facts(self.precision).weight_methods  # a format with its own quantizer (nvfp4): check
        calibrated = (weight_only and self.weights is not None and self.weights.method in WEIGHT_METHODS_CALIBRATED
                      and (not own or self.weights.method in own))  # names a method it lacks
        if weight_only and self.calibration is not None and not calibrated:
            raise ValueError(f"precision {self.precision!r} is weight-only: its activations stay FP32 and nothing is "
                             f"calibrated with weights.method {self.weights.method if self.weights else None!r}; drop "
                             f"the calibration section (only weights.method {' or '.join(WEIGHT_METHODS_CALIBRATED)} "
                             "reads one)")
        if calibrated and self.calibration is None:
            raise ValueError(f"weights.method {self.weights.method!r} searches its scales on calibration data: add a "
                             "calibration section, e.g. calibration: {data: <source disjoint from validate.data>, "
                             "samples: 16}")
        return self

    ADDED: ClassVar[dict[str, Any]] = {"weights": None, "weight_clip": "max", "rotate": False}

    @model_validator(mode="after")
    def _reduce_range_is_int8(self) -> "QuantizeConfig":
        if self.reduce_range and not precisions.facts(self.precision).integer:
            raise ValueError(f"reduce_range (7-bit INT8 weights) needs precision int8, not {self.precision!r}")
        return self

    @model_validator(mode="after")
    def _tuning_fits(self) -> "QuantizeConfig":
        uses = [k for k in ("smoothquant", "accuracy_budget", "sensitivity") if getattr(self, k) is not None]
        if uses and self.precision not in precisions.CALIBRATED:
            raise ValueError(f"{', '.join(uses)} need precision {' or '.join(precisions.CALIBRATED)}, not {self.precision!r}")
        if (self.accuracy_budget or self.sensitivity) and self.tuning is None:
            raise ValueError("accuracy_budget and sensitivity need a tuning section: tuning: {data: <source disjoint "
                             "from calibration and validate data>}")
        trial = ("kld_mean", "relative_perplexity_increase", "top1_agreement")
        if self.accuracy_budget is not None and self.accuracy_budget.metric not in trial:
            raise ValueError(f"accuracy_budget.metric {self.accuracy_budget.metric!r} is not measured on the tuning "
                             f"split; valid: {list(trial)}")
        if self.accuracy_budget is not None and self.accuracy_budget.statistic != "point":
            raise ValueError(f"accuracy_budget.statistic {self.accuracy_budget.statistic!r}: the budget search compares "
                             "point values (its trials have no standard error); valid: 'point'")
        return self


class SmoothQuantConfig(Grown):
    alpha: float = Field(0.5, ge=0, le=1, description="migration strength (Xiao et al. 2023); mode alpha only")
    mode: Literal["alpha", "search"] = Field(
        "alpha", description="alpha: one global alpha for every fold point; search: per-channel scales searched per fold "
        "point (norm -> q/k/v, norm -> gate/up, v -> o, up -> down) against the W8A8 quantizer's output error "
        "(pipeline.quant.smoothquant)")

    ADDED: ClassVar[dict[str, Any]] = {"mode": "alpha"}


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
    min: int = Field(ge=0, description="smallest size the engine accepts")
    opt: int = Field(ge=0, description="size TensorRT tunes kernels for")
    max: int = Field(ge=1, description="largest size the engine accepts")

    @model_validator(mode="after")
    def _ordered(self) -> "DimRange":
        if not self.min <= self.opt <= self.max:
            raise ValueError(f"need min <= opt <= max, got {self.min}/{self.opt}/{self.max}")
        return self


class ShapeRange(Strict):
    min: list[int] = Field(description="smallest shape, one size per axis")
    opt: list[int] = Field(description="shape TensorRT tunes kernels for")
    max: list[int] = Field(description="largest shape, one size per axis")

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

    name: str = Field(description="profile name, unique within build.profiles")
    dims: dict[str, DimRange] = Field(default_factory=dict, description="symbolic dim name -> min/opt/max")
    inputs: dict[str, ShapeRange] = Field(default_factory=dict, description="input name -> whole-shape min/opt/max")


#: Which builder makes the engine (pipeline.trt.backends): ``auto`` picks datacenter TensorRT
#: where it and a GPU are present, else TensorRT-RTX for ``build.targets``.
BuildBackend = Literal["auto", "tensorrt", "tensorrt-rtx", "none"]
#: A GPU architecture as ``sm<major><minor>`` (compute capability 8.9 -> ``sm89``).
ComputeTarget = Literal["sm75", "sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121"]


class BuildConfig(Grown):
    profiles: list[Profile] = Field(min_length=1, description="TensorRT optimization profiles, at least one")
    backend: BuildBackend = Field(
        "auto", description="auto: datacenter TensorRT where it and a CUDA GPU are present, else TensorRT-RTX for "
        "the declared targets (no GPU needed; a target it lacks, e.g. sm90, gets a parse-and-build check for "
        "sm89); tensorrt: datacenter TensorRT only; tensorrt-rtx: TensorRT-RTX only; none: trtexec.sh only")
    targets: list[ComputeTarget] = Field(
        default_factory=list, description="compute capabilities the engine is for, e.g. [sm89] (L4, L40S, RTX 40xx); "
        "that of triton.serving.gpu is added. TensorRT-RTX builds sm75/80/86/89/120/121, not sm90/sm100/sm103")
    timing_cache: str = Field(".cache/trt/timing.cache", description="datacenter TensorRT's timing cache file "
                              "(TensorRT-RTX ignores timing caches: its calls are deprecated no-ops)")
    workspace_mib: int = Field(4096, ge=64, description="TensorRT workspace memory pool limit, MiB")
    builder_optimization_level: int = Field(3, ge=0, le=5, description="TensorRT builder optimization level "
                                            "(higher: longer build, maybe faster engine)")
    compare_fp16: bool = Field(
        False, description="also build an FP16 engine of the same exported graph (weights and activations cast to "
        "FP16, strongly typed) with the same backend, targets and profiles, and report the engine's bytes against it "
        "(engine_stamp.json fp16_engine_bytes, engine_bytes_vs_fp16); about doubles the build time, so off by default")
    embedding_lookup: Literal["engine", "runtime"] = Field(
        "engine", description="engine: the engine gathers the token embeddings itself (takes the token ids); "
        "runtime: the engine takes inputs_embeds [batch, sequence, hidden] in place of the ids (TensorRT Edge-LLM's "
        "LLM engine interface) and the table is written beside it as embedding.safetensors (INT8 values and FP32 "
        "block scales when the graph's table is block-quantized, else the table) for the runtime's lookup, so a "
        "table tied to the lm_head is stored once in the engine (TensorRT-RTX stores a shared DequantizeLinear "
        "constant once per reader). The ONNX Runtime graph validated and served keeps its lookup; needs a "
        "triton.target that does not serve the engine (python-onnxruntime, onnxruntime) and a build.backend whose "
        "engine validate does not run (tensorrt-rtx, none)")

    ADDED: ClassVar[dict[str, Any]] = {"compare_fp16": False, "embedding_lookup": "engine"}


class GenerationCheck(Strict):
    prompts: int = Field(8, ge=1, description="prompts taken from validate.data for greedy generation")
    new_tokens: int = Field(32, ge=1, description="greedy tokens generated per prompt, compared with FP32")


class Gate(Strict):
    """One accuracy gate: a metric the model kind writes to ``validate/metrics.json``
    and exactly one bound, ``{metric: relative_perplexity_increase, max: 0.015}``.
    The same type serves ``validate.gates`` and accuracy budgets (pipeline.recipe.gates)."""

    metric: str = Field(pattern=r"^[a-z][a-z0-9_]*$",
                        description="a metric of the model kind (pipeline.recipe.gates.kind_metrics lists them)")
    max: float | None = Field(None, allow_inf_nan=False, description="passes when metric <= max")
    min: float | None = Field(None, allow_inf_nan=False, description="passes when metric >= min")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]+$",
                             description="report and junit name; default max_<metric> or min_<metric>")
    statistic: Literal["point", "evidence_of_regression", "evidence_of_meeting"] = Field(
        "point", description="point: compare the value with the bound; evidence_of_regression: fail only when "
        "the value is past the bound by z*stderr (errs toward passing); evidence_of_meeting: pass only when it "
        "is inside the bound by z*stderr (errs toward failing). The metric needs a standard error (pipeline.recipe.gates)")
    confidence: float = Field(0.95, gt=0.5, lt=1.0, description="one-sided confidence of a statistical test: "
                              "z = Phi^-1(confidence), 1.645 at 0.95")

    @model_validator(mode="after")
    def _one_bound(self) -> "Gate":
        if (self.max is None) == (self.min is None):
            got = "both" if self.max is not None else "neither"
            raise ValueError(f"give exactly one bound, max: <x> or min: <x> (got {got})")
        if self.statistic == "point" and "confidence" in self.model_fields_set:
            raise ValueError("confidence applies to a statistical test only; add statistic: evidence_of_regression "
                             "or statistic: evidence_of_meeting, or drop confidence")
        return self

    @model_serializer(mode="wrap")
    def _point_as_before(self, handler):
        """A point gate dumps without ``statistic`` / ``confidence``, so recipe digests and
        stage keys of recipes that do not use a test are what they were before the test existed."""
        data = handler(self)
        if self.statistic == "point" and isinstance(data, dict):
            data.pop("statistic", None)
            data.pop("confidence", None)
        return data

    @property
    def label(self) -> str:
        """The gate's name in the report and junit: ``name``, else ``max_<metric>`` / ``min_<metric>``."""
        return self.name or f"{'max' if self.max is not None else 'min'}_{self.metric}"


#: ``validate.gates``: every gate must pass for anything to be published.
Gates = list[Gate]


class ValidateConfig(Strict):
    data: DataSource = Field(description="held-out eval data (pipeline.sources.data); must not overlap calibration")
    seq_len: int = Field(256, ge=8, description="tokens per evaluation window (text generation)")
    max_windows: int = Field(32, ge=1, description="at most this many windows / sentences / samples are evaluated")
    batch_size: int = Field(4, ge=1, description="rows per evaluation batch")
    generation: GenerationCheck | None = Field(None, description="greedy-generation agreement check (text generation); "
                                               "needed by its gates")
    gates: Gates = Field(description="list of {metric: <name>, max: <x>} / {metric: <name>, min: <x>}")

    @model_validator(mode="before")
    @classmethod
    def _old_shape(cls, data: object) -> object:
        return refuse_old_fields(data, ("validate",), ("dataset", "split", "metric", "gates"))

    @model_validator(mode="after")
    def _name_data(self) -> "ValidateConfig":
        self.data._where = "validate.data"  # data errors name the recipe key
        return self


class DynamicBatching(Strict):
    max_queue_delay_microseconds: int = Field(100, ge=0, description="how long Triton may hold a request to batch it, us")
    preferred_batch_size: list[int] | None = Field(None, description="batch sizes Triton aims for; each <= "
                                                   "max_batch_size; default: chosen in pipeline.triton.config")


class InstanceGroup(Strict):
    """Triton instances of the compute model. ``KIND_AUTO`` (default) lets Triton pick the
    device at load time, so one recipe serves a TensorRT engine (GPU) or ONNX Runtime (CPU)."""

    count: int = Field(1, ge=1, description="model instances of this group")
    kind: InstanceKind = Field("KIND_AUTO", description="device of the instances; KIND_AUTO: Triton decides at load")


class ServingRuntime(Strict):
    """The Triton runtime an engine is built for (see pipeline.targets): a container
    tag or a TensorRT version, plus the GPU model. Checked only when an engine is built."""

    container: str | None = Field(None, pattern=r"^\d{2}\.\d{2}(-[a-z0-9\-]+)?$",
                                  description="Triton tag, e.g. '25.01-trtllm-python-py3' or '25.01' (-py3)")
    tensorrt: str | None = Field(None, pattern=r"^\d+\.\d+\.\d+(\.\d+)?$", description="e.g. '10.8.0.43'")
    gpu: str = Field(min_length=1, description="GPU model, e.g. 'H100' or 'NVIDIA L40S'")
    compute_capability: str | None = Field(None, pattern=r"^\d+\.\d+$", description="default: from the GPU model")
    gpus: list[str] = Field(
        default_factory=list, description="every datacenter GPU model one repository serves with this container "
        "(python -m pipeline plan-build: one engine each, listed in the compute model's cc_model_filenames; "
        "deploy gives the pods node affinity to them); at most one per compute capability, and gpu among them. "
        "Empty: gpu alone")

    @model_serializer(mode="wrap")
    def _gpus_only_when_set(self, handler):
        """``gpus`` dumps only when given, so recipe digests and stage keys of recipes without it stay."""
        data = handler(self)
        if isinstance(data, dict) and not data.get("gpus"):
            data.pop("gpus", None)
        return data

    @model_validator(mode="after")
    def _resolvable(self) -> "ServingRuntime":
        from pipeline import targets as serving_targets

        if self.gpus:
            caps: dict[str, str] = {}
            for gpu in self.gpus:
                cap = serving_targets.gpu_capability(gpu)
                if cap is None:
                    raise ValueError(f"gpus: {gpu!r}: compute capability unknown to this pipeline; known models: "
                                     f"{', '.join(serving_targets.GPU_CAPABILITY)}")
                if cap in caps:
                    raise ValueError(f"gpus: {caps[cap]!r} and {gpu!r} share compute capability {cap}; Triton's "
                                     "cc_model_filenames holds one engine per compute capability, so one repository "
                                     "serves one of them (give the other its own container's repository)")
                caps[cap] = gpu
            if not any(serving_targets.same_gpu_model(g, self.gpu) for g in self.gpus):
                raise ValueError(f"gpu {self.gpu!r} is not one of gpus {self.gpus}; add it to them")

        if self.container is None and self.tensorrt is None:
            raise ValueError("give a Triton container tag (container: '25.01-trtllm-python-py3') or a TensorRT "
                             f"version (tensorrt: '10.8.0'); known containers: {', '.join(serving_targets.TRITON_TENSORRT)}")
        if self.tensorrt is None:
            serving_targets.container_tensorrt(self.container or "")  # raises for an unknown tag
        elif self.container in serving_targets.TRITON_TENSORRT and not serving_targets.same_tensorrt(
                self.tensorrt, serving_targets.TRITON_TENSORRT[self.container]):
            raise ValueError(f"tensorrt {self.tensorrt!r} contradicts container {self.container!r}, which ships "
                             f"TensorRT {serving_targets.TRITON_TENSORRT[self.container]}; drop one of them")
        if self.compute_capability is None and serving_targets.gpu_capability(self.gpu) is None:
            raise ValueError(f"gpu {self.gpu!r}: compute capability unknown to this pipeline; add "
                             f"compute_capability (e.g. '9.0'); known models: {', '.join(serving_targets.GPU_CAPABILITY)}")
        return self


class TritonConfig(Grown):
    target: TritonTarget = Field("auto", description="runtime of the compute model; auto: tensorrt when an engine "
                                 "was built, else onnxruntime (pipeline.triton.repository.repository_runtime)")
    model_name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$", description="Triton name of the compute model")
    generate_model_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-]+$",
                                            description="text generation: name of the decoupled generation model; "
                                            "must differ from model_name")
    max_batch_size: int = Field(ge=0, description="Triton max_batch_size of the compute model; 0: no batch axis")
    dynamic_batching: DynamicBatching | None = Field(None, description="Triton dynamic batcher; none: off")
    instance_group: list[InstanceGroup] = Field(default_factory=lambda: [InstanceGroup()],
                                                description="Triton instance groups of the compute model")
    version: int = Field(1, ge=1, description="Triton model version folder the models are written to")
    serving: ServingRuntime | None = Field(
        None, description="Triton runtime + GPU an engine is built for; required only when an engine is built")
    continuous_batching: bool = Field(
        True, description="generation model: one scheduler loop batches every active request's step "
        "(in-flight batching); false: each request decodes on its own thread")
    kv_cache_budget_mib: float = Field(
        0.0, ge=0, description="generation model: KV cache the scheduler may hold, MiB (2 x tokens x layers x "
        "kv_heads x head_dim x bytes); 0: max_batch_size full-context sequences")
    intra_op_threads: int = Field(
        0, ge=0, description="python-onnxruntime compute model: ONNX Runtime intra-op threads per instance; 0: "
        "derived at load (the CPUs divided among the instances, ONNX Runtime's default with one); set by the "
        "serving pin (tune-serving) so config.pbtxt is the same on every CPU")
    max_concurrent_generations: int | None = Field(
        None, ge=1, description="generation model: the scheduler's limit, sequences per step (continuous "
        "batching) or request threads (off), per instance; none: triton.max_batch_size (at least 1)")
    generate_instances: int = Field(1, ge=1, description="generation model: Triton instances (KIND_CPU), each "
                                    "with its own scheduler and, for python-onnxruntime, its own ONNX Runtime session")
    generate_threads: int = Field(
        0, ge=0, description="generation model running the graph in its own process (python-onnxruntime): ONNX "
        "Runtime intra-op threads per instance; 0: ONNX Runtime's default")
    allow_context_beyond_max_positions: bool = Field(
        False, description="generation model: serve the build profiles' whole context even past the model's "
        "rotary max_position_embeddings (positions it was not trained on; quality unknown); false: its context "
        "is min(profile context, max_position_embeddings). Learned position tables (GPT-2, OPT) are never "
        "served past: check refuses such profiles")

    ADDED: ClassVar[dict[str, Any]] = {"allow_context_beyond_max_positions": False, "intra_op_threads": 0,
                                       "max_concurrent_generations": None, "generate_instances": 1,
                                       "generate_threads": 0}


class ServeSLO(Strict):
    """Per-request service-level objective; goodput counts the requests that meet it."""

    ttft_ms: float = Field(1000.0, gt=0, description="LLM: time to first token, ms")
    tpot_ms: float = Field(250.0, gt=0, description="LLM: mean time per output token after the first, ms")
    latency_ms: float = Field(1000.0, gt=0, description="non-LLM: request latency, ms")
    gate: bool = Field(False, description="bench exits 1 when, at any serve.concurrency level, fewer than min_met "
                       "of the requests meet this SLO (goodput below min_met x throughput); false: goodput is "
                       "reported only")
    min_met: float = Field(0.9, gt=0, le=1, description="with gate: true, the fraction of requests that must meet "
                           "the SLO at every concurrency level")

    @model_validator(mode="after")
    def _min_met_with_gate(self) -> "ServeSLO":
        if not self.gate and "min_met" in self.model_fields_set:
            raise ValueError("min_met applies to the SLO gate only; add gate: true, or drop min_met")
        return self


class ServeTune(Strict):
    """``tune-serving``: the search for the Triton config (:mod:`pipeline.serve.tune`)."""

    concurrency: int | None = Field(None, ge=1, description="the operating point: concurrent requests (closed "
                                    "loop) every candidate is measured at; none: the largest of serve.concurrency "
                                    "(unless rate is given)")
    rate: float | None = Field(None, gt=0, description="the operating point as an offered load instead: requests/s "
                               "sent at fixed intervals (open loop), whatever the answers' latency")
    measure_s: float = Field(10.0, gt=0, description="one measurement: the closed loop runs at least this long, s")
    min_requests: int = Field(16, ge=1, description="one measurement: at least this many requests (and at least "
                              "the concurrency)")
    time_limit_s: float = Field(600.0, gt=0, description="the whole search, repeats included, s; it stops "
                                "early when a pass over every dimension improves nothing")
    repeats: int = Field(3, ge=1, description="the best two candidates are measured again this many times each, "
                         "interleaved, and decided within their spread")
    max_instances: int = Field(4, ge=1, description="largest instance count tried (and at most the cores)")

    @model_validator(mode="after")
    def _time_for_one(self) -> "ServeTune":
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give one operating point: concurrency (closed loop) or rate (open loop), not both")
        if self.time_limit_s < self.measure_s:
            raise ValueError(f"time_limit_s ({self.time_limit_s:g}) is below one measurement (measure_s "
                             f"{self.measure_s:g}): the search could not measure even the recipe's config; raise "
                             f"time_limit_s to at least {(2 * self.repeats + 2) * self.measure_s:g} (the default, "
                             "one candidate more and the repeats) or lower measure_s")
        return self


class ServeConfig(Strict):
    """Serving on a local tritonserver and the ``bench`` load (``python -m pipeline bench``).

    Not part of :attr:`Recipe.digest`: it shapes no build artifact, so changing an
    SLO invalidates no stage and no engine; bench results record the values used.
    """

    slo: ServeSLO = Field(ServeSLO(), description="per-request objective goodput is counted against")
    concurrency: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 2, 4, 8, 16], min_length=1,
                                                           description="concurrency levels bench measures")
    requests_per_level: int = Field(16, ge=1, description="requests sent at each concurrency level; at least the "
                                    "largest concurrency (a level of c concurrent requests needs c requests)")
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
    tune: ServeTune = Field(ServeTune(), description="tune-serving: the operating point and the search's bounds")
    cpu_cores: int | None = Field(None, ge=1, description="CPU cores of the declared serving host: the hardware "
                                  "class a serving pin matches when triton.serving declares no GPU (tune-serving "
                                  "needs one of the two; never taken from the build machine)")

    @model_validator(mode="after")
    def _long_enough(self) -> "ServeConfig":
        if self.requests_per_level < max(self.concurrency):
            raise ValueError(f"requests_per_level ({self.requests_per_level}) is below the largest concurrency "
                             f"({max(self.concurrency)}): a level of c concurrent requests needs at least c requests "
                             f"(AIPerf refuses fewer); set requests_per_level >= {max(self.concurrency)} or drop "
                             "the larger levels")
        first, second = self.tpot_positions
        if not first < second:
            raise ValueError(f"tpot_positions: need the first below the second, got {first}, {second}")
        if self.long_max_tokens < second + 4:
            raise ValueError(f"long_max_tokens ({self.long_max_tokens}) must reach tpot_positions[1] + 4 "
                             f"({second + 4}): TPOT there is the median gap of positions {second - 4}..{second + 3}")
        return self


class Recipe(Strict):
    """One pipeline run. Validating it checks each section on its own; the constraints
    between sections (:func:`pipeline.recipe.checks.constraint_problems`) are checked by
    :func:`pipeline.recipe.load.load_recipe`, so ``check`` and ``build`` refuse them before
    any stage runs."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]+$", description="run name: artifacts go to <work_dir>/<name>/")
    model: ModelSource = Field(description="the model kind and its source")
    export: ExportConfig = Field(description="ONNX export and its check against torch")
    quantize: QuantizeConfig = Field(description="precision, calibration, exclusions and the accuracy budget")
    build: BuildConfig = Field(description="TensorRT profiles, backend and targets")
    validate_: ValidateConfig = Field(alias="validate", description="held-out data and the accuracy gates")
    triton: TritonConfig = Field(description="the Triton model repository")
    serve: ServeConfig = Field(default_factory=ServeConfig, exclude=True,
                               description="local serving and bench load; not part of the digest")
    output_dir: str = Field("model_repository", description="Triton model repository validated models are published to")
    work_dir: str = Field("artifacts", description="folder of the stage artifacts, manifest and logs")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("output_dir", "work_dir")
    @classmethod
    def _home(cls, value: str) -> str:
        """A leading ``~`` is the home folder, as for model and data paths (:func:`pipeline.fsutil.user_path`)."""
        return user_path(value)

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
