"""The serving runtime an engine is built for: Triton container -> TensorRT version, GPU model -> compute capability.

A TensorRT plan loads only in the TensorRT version that built it and only on
the GPU architecture it was built for. TensorRT's "Engine Compatibility" page
(docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/engine-compatibility.html,
also the 10.x "Version Compatibility" page) says engines are, by default,
compatible only with the version of TensorRT used to build them; the runtime
refuses a plan whose recorded library version differs ("The engine plan file
is not compatible with this version of TensorRT, expecting library version
5.1.5 got 5.1.6"), so major.minor.patch must match. The build number (fourth
field) is not compared: the tables below give some versions with three fields.
This pipeline does not set ``VERSION_COMPATIBLE`` or a hardware-compatibility
level, so both rules apply to every engine it builds.

Used by the recipe schema (``triton.serving``), the build stage (refuse a
local TensorRT / GPU that differs from the declared one) and the deploy check
(stamp against the declared target).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol


# Triton container tag -> the TensorRT it ships, only rows confirmed against
# NVIDIA's own table: "Release Compatibility Matrix", Container Name:
# trtllm-python-py3 (triton-inference-server/server,
# docs/introduction/compatibility.md; docs.nvidia.com/deeplearning/
# triton-inference-server/user-guide/docs/introduction/compatibility.html).
# The plain ``<release>-py3`` images are not in that table (their versions
# are in the Deep Learning Frameworks Support Matrix, which could not be read
# when this was written): declare ``tensorrt:`` explicitly for those, with
# ``container:`` to name the image in messages.
TRITON_TENSORRT: dict[str, str] = {
    "24.08-trtllm-python-py3": "10.3.0",
    "24.09-trtllm-python-py3": "10.4.0",
    "24.10-trtllm-python-py3": "10.4.0",
    "24.11-trtllm-python-py3": "10.6.0",
    "24.12-trtllm-python-py3": "10.7.0",
    "25.01-trtllm-python-py3": "10.8.0.43",
    "25.02-trtllm-python-py3": "10.8.0.43",
    "25.03-trtllm-python-py3": "10.9.0.34",
    "25.04-trtllm-python-py3": "10.9.0.34",
    "25.05-trtllm-python-py3": "10.9.0.34",
    "25.06-trtllm-python-py3": "10.10.0.31",
    "25.07-trtllm-python-py3": "10.10.0.31",
    "25.08-trtllm-python-py3": "10.11.0.33",
    "25.09-trtllm-python-py3": "10.11.0.33",
    "25.10-trtllm-python-py3": "10.11.0.33",
    "25.11-trtllm-python-py3": "10.13.3.9",
    "25.12-trtllm-python-py3": "10.13.3.9",
}

#: Triton release -> the ONNX Runtime its ``onnxruntime`` backend is built with: ``ort_version``
#: of ``TRITON_VERSION_MAP`` / ``DEFAULT_TRITON_VERSION_MAP`` in build.py on each ``rYY.MM`` branch
#: of triton-inference-server/server (read from the source; no container was run here).
TRITON_ONNXRUNTIME: dict[str, str] = {
    "24.08": "1.19.0", "24.09": "1.19.2", "24.10": "1.19.2", "24.11": "1.19.2", "24.12": "1.20.1",
    "25.01": "1.20.1", "25.02": "1.20.1", "25.03": "1.21.0", "25.04": "1.21.0", "25.05": "1.22.0",
    "25.06": "1.22.0", "25.07": "1.22.0", "25.08": "1.23.0", "25.09": "1.23.0", "25.10": "1.23.1",
    "25.11": "1.23.2", "25.12": "1.23.2", "26.01": "1.23.2", "26.02": "1.24.1", "26.03": "1.24.2",
    "26.04": "1.24.4", "26.05": "1.24.4", "26.06": "1.24.4",
}

#: ONNX Runtime major.minor -> (highest ONNX IR version, highest ai.onnx opset) it reads, from the
#: version table of onnxruntime's docs/reference/compatibility.md (rows 1.18-1.20; later releases
#: are not in that table, so their graphs are not checked). Every release reads opsets from
#: :data:`ONNXRUNTIME_MIN_OPSET` up, and every lower IR version.
ONNXRUNTIME_READS: dict[str, tuple[int, int]] = {"1.18": (10, 21), "1.19": (10, 21), "1.20": (10, 21)}
ONNXRUNTIME_MIN_OPSET = 7

#: The Triton release served where the recipe declares none (``deploy k8s``'s image; Triton
#: 2.51.0, the release of the tritonserver in the pytriton wheel the repositories are tested with).
DEFAULT_RELEASE = "24.10"


@dataclass(frozen=True)
class OnnxReader:
    """What a Triton release's onnxruntime backend reads."""

    release: str
    onnxruntime: str
    max_ir: int
    opsets: tuple[int, int]  # ai.onnx, inclusive


def onnxruntime_reader(container: str | None) -> OnnxReader | None:
    """The onnxruntime backend of Triton container ``container`` (a tag such as
    ``24.10-py3``; None: :data:`DEFAULT_RELEASE`), or None where its release or that
    ONNX Runtime is not in :data:`TRITON_ONNXRUNTIME` / :data:`ONNXRUNTIME_READS`."""
    release = (container or DEFAULT_RELEASE)[:5]
    ort = TRITON_ONNXRUNTIME.get(release)
    reads = ONNXRUNTIME_READS.get(".".join(ort.split(".")[:2])) if ort else None
    if ort is None or reads is None:
        return None
    return OnnxReader(release, ort, reads[0], (ONNXRUNTIME_MIN_OPSET, reads[1]))


# GPU model -> CUDA compute capability (developer.nvidia.com/cuda-gpus). Keys
# are matched as whole words of the GPU name, the longest match wins.
GPU_CAPABILITY: dict[str, str] = {
    "v100": "7.0",
    "t4": "7.5",
    "a100": "8.0", "a800": "8.0", "a30": "8.0",
    "a10": "8.6", "a10g": "8.6", "a40": "8.6", "a16": "8.6", "a2": "8.6",
    "rtx a6000": "8.6", "rtx 3090": "8.6",
    "l4": "8.9", "l40": "8.9", "l40s": "8.9", "l20": "8.9", "rtx 4090": "8.9", "rtx 6000 ada": "8.9",
    "h100": "9.0", "h200": "9.0", "h800": "9.0", "h20": "9.0", "gh200": "9.0",
    "b200": "10.0", "gb200": "10.0",
    "rtx 5090": "12.0", "rtx pro 6000": "12.0",
}

#: Compute capabilities TensorRT-RTX 1.7 builds for (its ``ComputeCapability`` enum): no sm90 (Hopper)
#: nor sm100 (datacenter Blackwell), which only datacenter TensorRT targets.
RTX_TARGETS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")
#: The architecture a TensorRT-RTX *check* builds for when the real target is not in RTX_TARGETS
#: (sm89: FP8 and INT8 both build there).
RTX_CHECK_TARGET = "sm89"

_IGNORED_WORDS = {"nvidia", "tesla", "geforce"}


@dataclass(frozen=True)
class Target:
    """Where an engine runs: TensorRT version, compute capability ("9.0"), GPU model name."""

    tensorrt: str
    compute_capability: str
    gpu_name: str
    container: str | None = None  # Triton tag, e.g. "25.01-trtllm-python-py3"

    @property
    def image(self) -> str | None:
        """The Triton image (``nvcr.io/nvidia/tritonserver:<tag>``), or None if no container was declared."""
        return container_image(self.container) if self.container else None


class ServingSection(Protocol):
    """What :func:`declared_target` reads of the recipe's ``triton.serving``
    (:class:`pipeline.recipe.schema.ServingRuntime`, whose validator uses this module's tables)."""

    @property
    def container(self) -> str | None: ...
    @property
    def tensorrt(self) -> str | None: ...
    @property
    def gpu(self) -> str: ...
    @property
    def compute_capability(self) -> str | None: ...


def declared_target(cfg: ServingSection) -> Target:
    """The recipe's ``triton.serving`` as a :class:`Target` (TensorRT from the container
    table unless given; compute capability from the GPU table unless given)."""
    trt = cfg.tensorrt or container_tensorrt(cfg.container or "")
    cap = cfg.compute_capability or gpu_capability(cfg.gpu) or ""
    return Target(trt, cap, cfg.gpu, cfg.container)


def container_image(tag: str) -> str:
    """``nvcr.io/nvidia/tritonserver:<tag>``; a bare release ("25.01") means the ``-py3`` image."""
    return f"nvcr.io/nvidia/tritonserver:{tag if '-' in tag else tag + '-py3'}"


def tensorrt_triple(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of "10.13.0.35" or "10.13.0".

    Raises:
        ValueError: not at least three dot-separated integers.
    """
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.\d+)?(?:\S*)", version.strip())
    if m is None:
        raise ValueError(f"TensorRT version {version!r} is not major.minor.patch[.build], e.g. '10.8.0' or '10.8.0.43'")
    return int(m[1]), int(m[2]), int(m[3])


def same_tensorrt(a: str, b: str) -> bool:
    """Whether two TensorRT versions share major.minor.patch (what a plan needs)."""
    return tensorrt_triple(a) == tensorrt_triple(b)


def container_tensorrt(tag: str) -> str:
    """The TensorRT version of Triton container ``tag``.

    Raises:
        ValueError: the tag is not in :data:`TRITON_TENSORRT`; the message lists
            the known tags and asks for an explicit ``tensorrt`` version.
    """
    if tag in TRITON_TENSORRT:
        return TRITON_TENSORRT[tag]
    raise ValueError(
        f"container {tag!r} ({container_image(tag)}): its TensorRT version is not in this pipeline's table; "
        f"known containers: {', '.join(TRITON_TENSORRT)}. Give the TensorRT version explicitly, "
        "e.g. serving: {container: '" + tag + "', tensorrt: '10.8.0', gpu: 'H100'}"
    )


def containers_with(version: str) -> list[str]:
    """Known Triton container tags whose TensorRT matches ``version`` (major.minor.patch)."""
    return [tag for tag, v in TRITON_TENSORRT.items() if same_tensorrt(v, version)]


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[\s_\-]+", name.lower()) if w and w not in _IGNORED_WORDS]


def gpu_capability(name: str) -> str | None:
    """Compute capability of a GPU model name ("NVIDIA H100 80GB HBM3" -> "9.0"), or None if unknown."""
    words = _words(name)
    best: tuple[int, str] | None = None
    for key, cap in GPU_CAPABILITY.items():
        k = key.split()
        if any(words[i:i + len(k)] == k for i in range(len(words))) and (best is None or len(k) > best[0]):
            best = (len(k), cap)
    return best[1] if best else None


def same_gpu_model(declared: str, actual: str) -> bool:
    """Whether GPU ``actual`` (as CUDA names it) is the declared model: every word of
    ``declared`` ("H100") appears in ``actual`` ("NVIDIA H100 80GB HBM3"); case and
    "NVIDIA"/"Tesla"/"GeForce" are ignored."""
    want, have = _words(declared), set(_words(actual))
    return bool(want) and all(w in have for w in want)


def capability_tuple(cap: str) -> tuple[int, int]:
    """"8.9" -> (8, 9).

    Raises:
        ValueError: not "major.minor".
    """
    m = re.fullmatch(r"(\d+)\.(\d+)", cap.strip())
    if m is None:
        raise ValueError(f"compute capability {cap!r} is not 'major.minor', e.g. '8.9'")
    return int(m[1]), int(m[2])


@dataclass
class Comparison:
    """Result of comparing an engine (or this machine) with a declared target."""

    errors: list[str]
    warnings: list[str]


def compare(actual: Target, declared: Target, what: str) -> Comparison:
    """Compare TensorRT (major.minor.patch), compute capability and GPU model.

    ``what`` names the actual side in messages ("engine", "this machine").
    A different TensorRT or compute capability is an error (the plan will not
    load); a different GPU model with the same compute capability is a
    warning (it loads, but kernels were timed on another chip).
    """
    errors, warnings = [], []
    if not same_tensorrt(actual.tensorrt, declared.tensorrt):
        errors.append(
            f"tensorrt_version: {what} has {actual.tensorrt!r}, the serving runtime{_image(declared)} has "
            f"{declared.tensorrt!r} (a plan loads only in the TensorRT major.minor.patch that built it)"
        )
    if actual.compute_capability != declared.compute_capability:
        errors.append(
            f"compute_capability: {what} has {actual.compute_capability!r}, the serving GPU "
            f"{declared.gpu_name!r} has {declared.compute_capability!r} (engines are specific to a GPU architecture)"
        )
    elif not same_gpu_model(declared.gpu_name, actual.gpu_name):
        warnings.append(
            f"gpu_name: {what} has {actual.gpu_name!r}, the serving GPU is {declared.gpu_name!r}: same compute "
            f"capability {actual.compute_capability}, so the engine loads, but its kernels were timed on another "
            "GPU model (performance may differ); rebuild on the serving GPU model for best results"
        )
    return Comparison(errors, warnings)


def _image(t: Target) -> str:
    return f" {t.image}" if t.image else ""


def sm_name(capability: str) -> str:
    """"8.9" -> "sm89" (the ``build.targets`` spelling).

    Raises:
        ValueError: not "major.minor".
    """
    major, minor = capability_tuple(capability)
    return f"sm{major}{minor}"


def sm_capability(target: str) -> str:
    """"sm89" -> "8.9", "sm120" -> "12.0" (the last digit is the minor version).

    Raises:
        ValueError: not ``sm`` followed by at least two digits.
    """
    m = re.fullmatch(r"sm(\d+)(\d)", target)
    if m is None:
        raise ValueError(f"compute target {target!r} is not sm<major><minor>, e.g. 'sm89'")
    return f"{int(m[1])}.{m[2]}"


# --- datacenter GPU SKUs as Kubernetes schedules them ------------------------------------------------

#: Datacenter GPU SKU (a ``plan-build --targets`` / ``triton.serving.gpus`` name) -> the value GPU
#: feature discovery gives its nodes' ``nvidia.com/gpu.product`` label. GFD (NVIDIA/k8s-device-plugin,
#: ``gpu-feature-discovery``; its README's label table) takes the NVML device name that
#: ``nvidia-smi --query-gpu=name`` prints ("NVIDIA H100 80GB HBM3") and replaces each space with
#: ``-``. A board with a variant not listed here (H100 PCIe, A100 40GB) is its own SKU: give it as
#: ``NAME=LABEL`` (``--targets H100-PCIe=NVIDIA-H100-PCIe``); check a cluster's values with
#: ``kubectl get nodes -L nvidia.com/gpu.product``.
GPU_PRODUCT: dict[str, str] = {
    "T4": "Tesla-T4",
    "A10": "NVIDIA-A10",
    "A10G": "NVIDIA-A10G",
    "A30": "NVIDIA-A30",
    "A40": "NVIDIA-A40",
    "A100": "NVIDIA-A100-SXM4-80GB",
    "L4": "NVIDIA-L4",
    "L40": "NVIDIA-L40",
    "L40S": "NVIDIA-L40S",
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
}
#: the label GPU feature discovery sets (and a GPU step's ``nodeSelector`` / a deployment's node affinity reads)
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class Sku:
    """One datacenter GPU SKU: its name ("H100"), ``nvidia.com/gpu.product`` value and compute capability."""

    name: str
    product: str
    compute_capability: str

    @property
    def sm(self) -> str:
        """``sm90``: the ``build.targets`` spelling of its compute capability."""
        return sm_name(self.compute_capability)


def datacenter_sku(spec: str) -> Sku:
    """A datacenter SKU from ``NAME`` (a :data:`GPU_PRODUCT` key, any case) or ``NAME=LABEL`` (the
    ``nvidia.com/gpu.product`` value given; NAME must still name a GPU of :data:`GPU_CAPABILITY`).

    Raises:
        ValueError: no known ``nvidia.com/gpu.product`` value, or an unknown compute capability;
            the message lists the known SKUs.
    """
    name, _, label = spec.partition("=")
    name = name.strip()
    known = {k.lower(): k for k in GPU_PRODUCT}
    canonical = known.get(name.lower(), name)
    product = label.strip() or GPU_PRODUCT.get(canonical)
    if not product:
        raise ValueError(f"GPU {name!r}: no known {GPU_PRODUCT_LABEL} value; known SKUs: {', '.join(GPU_PRODUCT)} "
                         f"(or give NAME=LABEL, e.g. {name}=NVIDIA-{name.upper()}, the label of "
                         f"`kubectl get nodes -L {GPU_PRODUCT_LABEL}`)")
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?", product):
        raise ValueError(f"GPU {name!r}: {product!r} is not a Kubernetes label value (63 characters of "
                         "letters, digits, '-', '_', '.')")
    cap = gpu_capability(canonical.replace("-", " "))
    if cap is None:
        raise ValueError(f"GPU {name!r}: compute capability unknown; known GPU models: {', '.join(GPU_CAPABILITY)}")
    return Sku(canonical, product, cap)
