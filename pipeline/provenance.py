"""What produced an artifact: the versions of the tools that shape it, the CPU features
that change ONNX Runtime's kernels, and the hash of this package's code (the stage cache
key's code part). Recorded in ``manifest.json`` (:mod:`pipeline.run.report`)."""
from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

_TOOLS = {"torch": "torch", "onnx": "onnx", "onnxruntime": "onnxruntime-gpu", "transformers": "transformers",
          "numpy": "numpy", "ml_dtypes": "ml_dtypes"}
#: CPU features that change ONNX Runtime's kernels (INT8 GEMMs: VNNI; FP32: AVX-512), hence the numbers.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of Linux ``/proc/cpuinfo``; None where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((l.split(":", 1)[1].strip() for l in lines if l.split(":", 1)[0].strip() == field), None)


#: CPU features with an 8-bit dot product into int32 (VNNI, AMX): ONNX Runtime's INT8 GEMMs need one
#: to beat FP32; without, they multiply in int16 pairs (``vpmaddubsw``).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_flags() -> list[str]:
    """Which of :data:`_CPU_FLAGS` the CPU has (Linux ``/proc/cpuinfo``; ``[]`` elsewhere)."""
    flags = set((_cpuinfo("flags") or "").split())
    return [f for f in _CPU_FLAGS if f in flags]


def cpu_description() -> str:
    """``"<machine> <flag>..."``: the architecture and :func:`cpu_flags`. FP8 perplexity moves
    ~0.4 % when activation scales move by one float32 ulp, so kernels matter."""
    import platform

    return " ".join([platform.machine(), *cpu_flags()])


def cpu_model() -> str:
    """The CPU's model name, e.g. ``"AMD EPYC 9654 96-Core Processor"``: ``/proc/cpuinfo``
    ``model name`` (x86), else :func:`platform.processor`, else ``"unknown"``. Recorded in
    the manifest (``cpu_model``) so two runners' numbers can be told apart; it is not part
    of :func:`tool_versions`, hence of no stage key."""
    import platform

    return _cpuinfo("model name") or platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def tool_versions() -> dict[str, str]:
    """Versions of the tools that shape the artifacts; TensorRT or "absent"."""
    out = {k: _version(d) for k, d in _TOOLS.items()}
    if out["onnxruntime"] == "absent":
        out["onnxruntime"] = _version("onnxruntime")
    try:
        import tensorrt  # type: ignore[import-not-found]

        out["tensorrt"] = tensorrt.__version__
    except Exception:
        out["tensorrt"] = "absent"
    out["tensorrt-rtx"] = _version("tensorrt-rtx-cu12-bindings")
    out["trt-pipeline"] = f"{_version('trt-pipeline')}+src.{code_hash()[:12]}"
    out["python"] = sys.version.split()[0]
    out["cpu"] = cpu_description()
    return out


def inputs(sources: Iterable[tuple[str, Any]]) -> dict[str, dict[str, str]]:
    """The files a run reads, each hashed once: name -> ``{"path", "sha256"}`` for each ``(name,
    source)``, in order (a source is any object with ``location()`` and ``sha256()``: a model source,
    a bound data source; ``sources`` may be lazy, so a source is bound only after the ones before
    it were hashed). The runner calls it once per run (:func:`pipeline.run.report.input_sources`)
    and hands the result to the manifest's ``inputs``, the pin lookup and the stage keys.

    Raises:
        ModelFileError, DataError: a source's file is missing (whatever its ``sha256`` raises).
    """
    out: dict[str, dict[str, str]] = {}
    for name, source in sources:
        out[name] = {"path": str(source.location()), "sha256": source.sha256()}
    return out


#: (folder a closure reaches, folder of Python files copied into model repositories that it then
#: hashes too), relative to the package: the Triton templates, the served generation model, and the
#: image classifier's preprocessing model (``preprocess_model.py``, copied, never imported).
SHIPPED = (("triton", "triton/templates"), ("models/text_generation/served", "models/text_generation/served"),
           ("models/image_classification", "models/image_classification"))


@functools.lru_cache(maxsize=None)
def code_hash(module: str | None = None) -> str:
    """sha256 of Python sources: with ``module`` (e.g. ``pipeline.stages.export``), of the files of
    its static import closure inside this package (:func:`pipeline.imports.closure`), plus the
    code shipped into model repositories (:data:`SHIPPED`) where the closure reaches it; without, of
    the whole package.
    A stage's cache key holds its own, so an edit elsewhere (a server, a report) re-runs nothing."""
    from pipeline import imports

    root = Path(__file__).resolve().parent
    if module is None:
        files = sorted(root.rglob("*.py"))
    else:
        mods = imports.package_modules()
        names = imports.closure(module)
        files = sorted({mods[m] for m in names if m in mods})
        for reached, shipped in SHIPPED:  # the code it copies into repositories, which no module imports
            if any(f.is_relative_to(root / reached) for f in files):
                files = sorted({*files, *(root / shipped).rglob("*.py")})
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(root)}\0".encode() + f.read_bytes())
    return h.hexdigest()


def portable(section: Any) -> Any:
    """A recipe section (JSON-like) with each absolute path cut to its last part, for stage keys:
    where a file lies is no part of a key (its content is, through the recipe's input sha256s), so
    two folders, or two machines, get the same keys. ``"/abs/model.py:make_model"`` (an entry)
    becomes ``"model.py:make_model"``; relative paths and other values are kept."""
    if isinstance(section, dict):
        return {k: portable(v) for k, v in section.items()}
    if isinstance(section, (list, tuple)):
        return [portable(v) for v in section]
    if isinstance(section, str) and os.path.isabs(section.split(":", 1)[0]):
        return Path(section).name
    return section
