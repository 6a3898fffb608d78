"""Published figures of the data-center GPUs ``pipeline plan`` sizes for.

Every figure is NVIDIA's own, as printed in the product datasheet named in
``source`` (URL in ``url``). Units: memory in GB (10^9 bytes, as NVIDIA prints
them), bandwidth in GB/s (10^9 bytes/s), Tensor Core throughput in dense TFLOPS
(10^12 FLOP/s). NVIDIA's datasheets print the sparse (2:4 structured sparsity)
figure with an asterisk for most precisions; dense = sparse / 2, which is what
an FP8/FP16 GEMM without structured sparsity can reach.

Cross-checked against the datasheets' spec tables as quoted by vendors
and reference pages:

* L4: 24 GB GDDR6, 300 GB/s; FP8 485* / FP16 242* TFLOPS (sparse).
  "NVIDIA L4 Tensor Core GPU datasheet".
* L40S: 48 GB GDDR6, 864 GB/s; FP8 733 (1,466*), FP16 362.05 (733*).
  "NVIDIA L40S datasheet".
* A100 80GB SXM: 80 GB HBM2e, 2,039 GB/s; FP16 312 (624*); no FP8 Tensor Core
  support (Ampere has none: FP8 Q/DQ GEMMs cannot run in FP8 there).
  "NVIDIA A100 Tensor Core GPU datasheet".
* H100 SXM: 80 GB HBM3, 3.35 TB/s; FP8 3,958*, FP16 1,979* TFLOPS.
  "NVIDIA H100 Tensor Core GPU datasheet".
* H200 SXM: 141 GB HBM3e, 4.8 TB/s; FP8 3,958*, FP16 1,979* TFLOPS.
  "NVIDIA H200 Tensor Core GPU datasheet".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPU:
    """One GPU's published figures (see the module docstring for units)."""

    name: str
    memory_gb: float
    bandwidth_gbs: float
    fp16_tflops: float  # dense FP16 Tensor Core
    fp8_tflops: float | None  # dense FP8 Tensor Core; None: the GPU has no FP8 Tensor Cores
    source: str  # the datasheet's title
    url: str
    note: str = ""

    def to_json(self) -> dict:
        return asdict(self)


GPUS: tuple[GPU, ...] = (
    # NVIDIA L4 Tensor Core GPU datasheet: 24GB GDDR6, 300GB/s, FP8 485 TFLOPS*, FP16 242 TFLOPS* (*sparsity).
    GPU("L4", 24, 300, 121, 242.5, "NVIDIA L4 Tensor Core GPU datasheet",
        "https://www.nvidia.com/en-us/data-center/l4/",
        "dense = datasheet sparse figure / 2"),
    # NVIDIA L40S datasheet: 48GB GDDR6, 864GB/s, FP8 733 (1,466*), FP16 362.05 (733*).
    GPU("L40S", 48, 864, 362.05, 733, "NVIDIA L40S datasheet",
        "https://www.nvidia.com/en-us/data-center/l40s/"),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: 80GB HBM2e, 2,039GB/s, FP16 312 (624*), no FP8.
    GPU("A100 80GB SXM", 80, 2039, 312, None, "NVIDIA A100 Tensor Core GPU datasheet",
        "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
        "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
        "no FP8 Tensor Cores (Ampere)"),
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: 80GB, 3.35TB/s, FP8 3,958*, FP16 1,979* TFLOPS.
    GPU("H100 SXM", 80, 3350, 989.5, 1979, "NVIDIA H100 Tensor Core GPU datasheet",
        "https://www.nvidia.com/en-us/data-center/h100/",
        "dense = datasheet sparse figure / 2"),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: 141GB HBM3e, 4.8TB/s, FP8 3,958*, FP16 1,979* TFLOPS.
    GPU("H200 SXM", 141, 4800, 989.5, 1979, "NVIDIA H200 Tensor Core GPU datasheet",
        "https://www.nvidia.com/en-us/data-center/h200/",
        "dense = datasheet sparse figure / 2"),
)
