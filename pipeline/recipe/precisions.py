"""One row per numeric precision: what each name in ``quantize.precision`` and
``quantize.rest_precision`` means to every stage.

The rest of the package asks this table (``facts(name).calibrated``, :func:`names`) instead of
comparing precision names; adding a precision is a row here plus its numerics in the quantizer
(:mod:`pipeline.quant.qdq`). Torch-free and import-light: the recipe schema builds its
``Literal`` types from it.

Sources of the numbers:

* minimum opset: ONNX's ``QuantizeLinear`` / ``DequantizeLinear`` gained FLOAT8E4M3FN in opset 19
  (onnx/docs/Changelog.md); INT8 Q/DQ exists since opset 10 (per-channel scales since 13).
* minimum compute capability of the GEMM kernels: FP8 tensor cores start at sm89 (Ada), BF16 at
  sm80 (Ampere) (NVIDIA CUDA C Programming Guide, "Compute Capabilities").
* export tolerances: (rtol, atol) of :func:`pipeline.checks.tolerance.tolerance`, measured on this
  project's models (docs/recipes-and-gates.md).
* weight bytes: the bytes one weight takes in the engine, for the capacity plan.
* INT4 (weight-only): ONNX's blocked ``DequantizeLinear`` (``block_size``) and the INT4 type came
  with opset 21; TensorRT-RTX 1.7 builds INT4 blocks for sm86, sm89 and sm120 and refuses sm75
  ("HW-specific datatypes: int4", measured: tests/unit/quant/test_gguf_blocks.py).
* NVFP4 (weight-only): FLOAT4E2M1 came with opset 23 (IR 11); FP4 tensor cores start at sm100
  (Blackwell). TensorRT-RTX 1.7.1 builds it for sm120 and refuses sm89 ("HW-specific datatypes:
  fp4_e2m1"), sm86 and sm75 (measured: tests/unit/quant/test_nvfp4.py); sm100 / sm103 need datacenter
  TensorRT on such a GPU. Weight bytes: 4 bits + one FP8 scale per 16 (4.5 bits).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PrecisionFacts", "PRECISIONS", "REFERENCE", "facts", "names", "QUANTIZE", "REST", "CALIBRATED", "CAST",
           "WEIGHT_ONLY", "capability_problem", "runs_on"]


@dataclass(frozen=True)
class PrecisionFacts:
    """What one precision is.

    Attributes:
        name: the recipe's spelling (``fp8``) and the name used in metrics (``perplexity_fp8``).
        quantize: allowed as ``quantize.precision``.
        rest: allowed as ``quantize.rest_precision`` (what is not quantized).
        calibrated: activation scales (amax) come from calibration data.
        qdq: written as explicit QuantizeLinear/DequantizeLinear pairs on weight GEMMs.
        cast: written by casting the whole graph's floats (FP16 / BF16), keeping FP32 I/O.
        min_opset: the lowest ONNX opset whose Q/DQ (or cast) carries this type.
        min_compute_capability: (major, minor) of the first GPU with kernels for it; None for all.
        export_tolerance: default (rtol, atol) when a run in this precision is compared with FP32.
        weight_bytes: bytes per GEMM weight in the engine (the capacity plan's size).
        integer: quantized onto an integer grid (INT8): CPUs with VNNI run it as integer GEMMs, and 7-bit
            weights (``quantize.reduce_range``) apply.
        cpu_simulated: ONNX Runtime's CPU provider runs its Q/DQ as quantize, dequantize and an FP32 GEMM,
            so CPU timings say nothing of GPU speed (FP8).
        ort_cpu: ONNX Runtime's CPU provider runs a graph in this precision (BF16 is validated only
            through a TensorRT engine).
        fp8_tensor_cores: its GEMMs run on FP8 tensor cores where the GPU has them (the capacity plan then
            uses the GPU table's FP8 peak, else its FP16 peak).
        weight_only: only the GEMM weights are quantized (blocked DequantizeLinear on the weight, no
            QuantizeLinear on the activation, which stays FP32): no calibration; the weights come from
            ``quantize.weights`` (:mod:`pipeline.quant.int4`); ONNX Runtime fuses each into a
            ``MatMulNBits`` run at accuracy level 1 (:data:`pipeline.ort_sessions.MATMULNBITS_FP32`),
            which Triton's stock onnxruntime backend cannot set.
        cpu_decoded: ONNX Runtime's CPU provider has no kernel for its DequantizeLinear (FP4 in ONNX
            Runtime 1.31): validate and the Triton repository run a twin graph with the weights decoded
            exactly to FP32 (``QuantizedArtifact.cpu_onnx_path``), the TensorRT build the real one.
        cpu_simulation: how ONNX Runtime on a CPU runs it where ``cpu_simulated`` (a sentence for reports).
        weight_methods: ``quantize.weights.method`` values its quantizer implements (empty: the INT4
            list, :data:`pipeline.recipe.schema.WEIGHT_METHODS_DONE`).
        weight_block: the format's own block size (``quantize.weights.block_size`` must be it); None:
            chosen in the recipe.
    """

    name: str
    quantize: bool
    rest: bool
    calibrated: bool
    qdq: bool
    cast: bool
    min_opset: int
    min_compute_capability: tuple[int, int] | None
    export_tolerance: tuple[float, float]
    weight_bytes: float
    integer: bool = False
    cpu_simulated: bool = False
    ort_cpu: bool = True
    fp8_tensor_cores: bool = False
    weight_only: bool = False
    cpu_decoded: bool = False
    cpu_simulation: str = ""
    weight_methods: tuple[str, ...] = ()
    weight_block: int | None = None


PRECISIONS: dict[str, PrecisionFacts] = {p.name: p for p in (
    PrecisionFacts("fp8", quantize=True, rest=False, calibrated=True, qdq=True, cast=False, min_opset=19,
                   min_compute_capability=(8, 9), export_tolerance=(1.5e-1, 1e-1), weight_bytes=1.0,
                   cpu_simulated=True, fp8_tensor_cores=True,
                   cpu_simulation="FP8 Q/DQ is only simulated on CPU (quantize, dequantize, FP32 GEMM)"),
    PrecisionFacts("int8", quantize=True, rest=False, calibrated=True, qdq=True, cast=False, min_opset=10,
                   min_compute_capability=None, export_tolerance=(1e-1, 1e-1), weight_bytes=1.0, integer=True),
    PrecisionFacts("fp16", quantize=True, rest=True, calibrated=False, qdq=False, cast=True, min_opset=1,
                   min_compute_capability=None, export_tolerance=(1e-2, 1e-2), weight_bytes=2.0),
    PrecisionFacts("fp32", quantize=True, rest=True, calibrated=False, qdq=False, cast=False, min_opset=1,
                   min_compute_capability=None, export_tolerance=(1e-4, 1e-4), weight_bytes=4.0),
    PrecisionFacts("bf16", quantize=False, rest=True, calibrated=False, qdq=False, cast=True, min_opset=13,
                   min_compute_capability=(8, 0), export_tolerance=(2e-2, 2e-2), weight_bytes=2.0,
                   ort_cpu=False),
    PrecisionFacts("int4", quantize=True, rest=False, calibrated=False, qdq=True, cast=False, min_opset=21,
                   min_compute_capability=(8, 6), export_tolerance=(1e-2, 1e-2), weight_bytes=0.5, integer=False,
                   weight_only=True),
    PrecisionFacts("nvfp4", quantize=True, rest=False, calibrated=False, qdq=True, cast=False, min_opset=23,
                   min_compute_capability=(10, 0), export_tolerance=(2.5e-1, 1.5e-1), weight_bytes=0.5625,
                   weight_only=True, cpu_simulated=True, cpu_decoded=True,
                   cpu_simulation="FP4 simulated: decoded to FP32 on this CPU", weight_methods=("rtn",),
                   weight_block=16),
)}

#: the reference every candidate is compared with, and the precision of an unquantized graph
REFERENCE = "fp32"


def facts(name: str) -> PrecisionFacts:
    """The row of precision ``name``.

    Raises:
        KeyError: ``name`` is not a precision of the table (the recipe schema refuses such names
            first, naming the field and the valid ones).
    """
    return PRECISIONS[name]


def names(**where: bool) -> tuple[str, ...]:
    """Precision names, in the table's order, whose facts equal every ``where`` (``names(quantize=True)``)."""
    return tuple(p.name for p in PRECISIONS.values() if all(getattr(p, k) == v for k, v in where.items()))


#: allowed as quantize.precision / quantize.rest_precision (the reference, its default, first);
#: calibrated (FP8/INT8); whole-graph casts
QUANTIZE = names(quantize=True)
REST = (REFERENCE, *(n for n in names(rest=True) if n != REFERENCE))
CALIBRATED = names(calibrated=True)
CAST = names(cast=True)
#: weight-only precisions (``quantize.weights``): int4, nvfp4
WEIGHT_ONLY = names(weight_only=True)


def capability_problem(precision: str, capability: str | tuple[int, int], where: str) -> str | None:
    """Why a GPU of compute capability ``capability`` ("8.6" or (8, 6)) cannot run ``precision``'s GEMM
    kernels, or None.

    ``where`` names the GPU in the sentence ("sm86", "this GPU (NVIDIA L4)").

    Raises:
        KeyError: ``precision`` is not in the table.
        ValueError: ``capability`` is not "major.minor".
    """
    if isinstance(capability, str):
        parts = capability.strip().split(".")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"compute capability {capability!r} is not 'major.minor', e.g. '8.9'")
        capability = (int(parts[0]), int(parts[1]))
    need = facts(precision).min_compute_capability
    if need is None or capability >= need:
        return None
    major, minor = capability
    return f"{precision.upper()} needs compute capability >= {need[0]}.{need[1]}; {where} has compute capability {major}.{minor}"


def runs_on(capability: tuple[int, int]) -> tuple[str, ...]:
    """``quantize.precision`` names whose GEMM kernels a GPU of ``capability`` has (the table's order)."""
    return tuple(p.name for p in PRECISIONS.values()
                 if p.quantize and (p.min_compute_capability is None or capability >= p.min_compute_capability))
