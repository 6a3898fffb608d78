"""Typed inputs and outputs passed between stages.

Each stage is a function ``run(recipe, ctx, <upstream artifacts>) -> <its artifact>``;
artifacts are plain dataclasses that serialise to JSON for the manifest and
the stage cache.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator

#: A float that strict JSON stored as null (NaN / inf) reads back as NaN.
NullableFloat = Annotated[float, BeforeValidator(lambda v: math.nan if v is None else v)]


@dataclass
class TensorSpec:
    """One graph input or output. ``shape`` holds ints or symbolic dim names."""

    name: str
    dtype: str  # numpy dtype name: "int64", "float32", ...
    shape: list[int | str]


@dataclass
class ExportArtifact:
    onnx_path: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    tokenizer_dir: str
    shape_checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def summary(self) -> str:
        return f"ONNX matches torch at {len(self.shape_checks)} shape points"


@dataclass
class QuantizedArtifact:
    onnx_path: str
    precision: str
    quantized_nodes: list[str]
    excluded_nodes: list[str]
    calibration: dict[str, Any] = field(default_factory=dict)
    #: the calibration batches (``.npz``, :mod:`pipeline.quant.feeds`), handed forward; None for fp32 / fp16
    calibration_feeds_path: str | None = None
    #: the same graph with UINT8 activations for ONNX Runtime on CPU (:func:`pipeline.quant.qdq.uint8_activations`,
    #: 7-bit INT8 weights only); None: ``onnx_path`` is what ONNX Runtime runs too
    cpu_onnx_path: str | None = None

    @property
    def ort_path(self) -> str:
        """The graph ONNX Runtime validates and serves: :attr:`cpu_onnx_path`, else :attr:`onnx_path`
        (which TensorRT builds from)."""
        return self.cpu_onnx_path or self.onnx_path

    @property
    def summary(self) -> str:
        if not self.quantized_nodes:
            return f"{self.precision}: no Q/DQ"
        formats = self.calibration.get("gemm_formats")
        if formats:  # weight-only: {"Q4_1 -> INT4 block 32 + offsets": 210, ...}
            shown = ", ".join(f"{n} {form}" for form, n in formats.items())
            return (f"{self.precision}: {len(self.quantized_nodes)} GEMMs weight-only ({shown}), "
                    f"{len(self.excluded_nodes)} left FP32, weights from {self.calibration.get('method')}")
        text = (f"{self.precision}: {len(self.quantized_nodes)} GEMMs quantized, "
                f"{len(self.excluded_nodes)} excluded, calibration {self.calibration.get('method')}")
        shortfall = self.calibration.get("shortfall")
        return f"{text}; WARNING: {shortfall}" if shortfall else text


@dataclass
class ResolvedProfile:
    """Per-input min/opt/max shapes of one optimization profile."""

    name: str
    shapes: dict[str, dict[str, list[int]]]  # input -> {"min"|"opt"|"max": shape}
    dims: dict[str, dict[str, int]] = field(default_factory=dict)  # symbolic dim -> {"min"|"opt"|"max": size}


@dataclass
class BuildArtifact:
    status: str  # "ok" | "skipped"
    reason: str
    engine_path: str | None
    stamp_path: str | None
    trtexec_cmd_path: str
    profiles: list[ResolvedProfile]
    #: who built ``engine_path`` (pipeline.trt.backends): "tensorrt" (a datacenter plan, which
    #: validate runs and Triton serves) or "tensorrt-rtx" (a build artifact: Triton cannot load it)
    backend: str = "tensorrt"
    #: the stamp's headline numbers (backend_label, tensorrt_version, targets, check_only,
    #: engine_bytes, build_wall_s, builder_peak_rss_mib; embedding_table_bytes with
    #: build.embedding_lookup: runtime), for the manifest; {} when skipped
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        """One line for the manifest: what was built, its size, build time and memory."""
        e = self.engine
        if not e:
            return self.reason
        what = "parse-and-build check" if e["check_only"] else "engine"
        table = (f" (the embedding table beside it: {e['embedding_table_bytes']:,} bytes)"
                 if e.get("embedding_table_bytes") else "")
        return (f"{e['backend_label']} {e['tensorrt_version']} {what} for {', '.join(e['targets'])}: "
                f"{e['engine_bytes']:,} bytes{table}, built in {e['build_wall_s']:.2f} s, builder peak RSS "
                f"{e['builder_peak_rss_mib']:.0f} MiB")

    @property
    def plan_path(self) -> str | None:
        """The datacenter TensorRT plan Triton can serve, or None (skipped, or a TensorRT-RTX engine)."""
        ok = self.status == "ok" and self.backend == "tensorrt"
        return self.engine_path if ok and self.engine_path else None


@dataclass
class GateResult:
    """One gate's verdict (:func:`pipeline.recipe.gates.evaluate`), as the manifest's ``gates``
    list, ``report.md`` and ``junit.xml`` carry it.

    ``value``, ``stderr`` and ``bound`` are in the metric's unit. ``bound`` is the
    recipe's bound (less the timing margin of a speedup gate); ``threshold`` is what
    ``value`` was compared with: ``bound`` for a point comparison, ``bound ± z·stderr``
    for a statistical test (``statistic``, ``confidence``). Where the metric has a
    standard error: ``margin_se`` = (bound - value) / stderr for a max bound,
    (value - bound) / stderr for a min bound (positive on the passing side);
    ``within_noise`` when |margin_se| < 2; ``n`` eval tokens or items (``n_unit``)
    the metric rests on, ``n_needed`` the count that would put the bound 2 standard
    errors away (:func:`pipeline.recipe.gates.n_needed`), ``stderr_method`` how it was computed;
    ``unit`` the value's unit where it has one (:data:`pipeline.recipe.gates.UNITS`).
    """

    name: str
    metric: str
    value: NullableFloat
    bound: float
    op: str  # "<=" or ">="
    passed: bool
    stderr: float | None = None
    margin_se: float | None = None
    within_noise: bool | None = None
    n: int | None = None
    n_unit: str | None = None
    n_needed: int | None = None
    stderr_method: str | None = None
    statistic: str = "point"
    confidence: float | None = None
    threshold: float | None = None
    unit: str | None = None
    #: why a metric that has a standard error elsewhere has none here (e.g. one eval sample)
    no_stderr: str | None = None

    @property
    def message(self) -> str:
        """One line: verdict, value (± stderr), bound, margin in SE; "within noise" with
        the eval count that would resolve it; the test and its threshold when not a point
        comparison. Without a stderr: ``<name> passed: <metric> = <v> (bound <= <b>)``. A
        ``fraction`` adds its percentage as the first note; another unit follows the value."""
        verdict = "passed" if self.passed else "FAILED"
        value = f"{self.value:.6g}" + (f" ± {self.stderr:.2g}" if self.stderr is not None else "")
        short = f"{self.bound:.6g}"
        notes = [f"bound {self.op} {short if float(short) == self.bound else repr(self.bound)}"]  # 0.9999999, not 1
        if self.unit == "fraction":
            if math.isfinite(self.value):
                spread = f" ± {100 * self.stderr:.2f} %" if self.stderr is not None else ""
                notes.insert(0, f"{100 * self.value:+.2f} %{spread}")
        elif self.unit:
            value += f" {self.unit}"
        if self.statistic != "point" and self.threshold is not None:
            notes.append(f"{self.statistic} at {self.confidence:.0%}: threshold {self.threshold:.6g}")
        if self.margin_se is not None:
            notes.append(f"margin {self.margin_se:+.2f} SE")
        if self.no_stderr:
            notes.append(f"no standard error: {self.no_stderr}")
        text = f"{self.name} {verdict}: {self.metric} = {value} ({'; '.join(notes)})"
        return text + (f"; {self.noise_note}" if self.within_noise else "")

    @property
    def noise_note(self) -> str:
        """``within noise: ~N eval tokens would resolve it`` (empty when not within noise)."""
        if not self.within_noise:
            return ""
        unit = f"eval {self.n_unit}" if self.n_unit else "eval units"
        need = f"~{self.n_needed:,} {unit} (now {self.n:,}) would resolve it" if self.n_needed else (
            "the value sits on the bound: no eval size resolves it")
        return f"within noise (|margin| < 2 SE): {need}"


@dataclass
class ValidationArtifact:
    metrics: dict[str, Any]
    gates: list[GateResult]
    greedy_tokens: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(g.passed for g in self.gates)

    @property
    def summary(self) -> str:
        """The report's note: how many gates pass, and the sample measured where the kind counts it."""
        sizes = [f"{self.metrics[k]} {label}" for k, label in (("eval_windows", "windows"), ("eval_tokens", "tokens"))
                 if isinstance(self.metrics.get(k), int)]
        passing = f"{sum(g.passed for g in self.gates)} of {len(self.gates)} gates pass"
        return passing + (f" on {', '.join(sizes)}" if sizes else "")


@dataclass
class TritonArtifact:
    repository: str
    models: list[str]
    compute_backend: str
    warnings: list[str] = field(default_factory=list)  # e.g. engine built on another GPU model, same compute capability

    @property
    def summary(self) -> str:
        text = f"{self.repository}/: {', '.join(self.models)} (compute model: {self.compute_backend})"
        return text + "".join(f"; warning: {w}" for w in self.warnings)


def to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        return asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj
