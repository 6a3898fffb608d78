"""Which engine may be built here, and where it may run.

Availability (:func:`unavailable_reason`, :func:`builder_key`); the serving runtime checked
before a datacenter build (:func:`preflight`: the recipe's ``triton.serving`` against this
machine's TensorRT and GPU, see :mod:`pipeline.targets`); the stamp that records what an
engine was built with and for (:func:`make_stamp`), and the deploy-time comparison of a stamp with
the declared serving target (:func:`check_stamp`).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.trt import backends as engine_backends
from pipeline import targets as serving_targets
from pipeline.artifacts import ResolvedProfile
from pipeline.trt.backends import TENSORRT
from pipeline.trt.builder import BuiltEngine, EngineBuildError, tensorrt_version
from pipeline.fsutil import sha256_file
from pipeline.recipe.schema import Recipe
from pipeline.recipe.precisions import capability_problem


class ServingRuntimeError(EngineBuildError):
    """This machine cannot build an engine the declared serving runtime loads (or none is declared)."""


# --- availability, stamp ------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why datacenter TensorRT cannot build here, or None if tensorrt and a CUDA GPU are present."""
    import torch

    gpu = torch.cuda.is_available()
    problem = engine_backends.import_problem(TENSORRT)
    if problem:
        return problem + ("" if gpu else "; no CUDA GPU visible either")
    return None if gpu else "no CUDA GPU visible"


def builder_key() -> str:
    """What of this machine decides the engine, for the build stage's cache key: the local
    GPU where datacenter TensorRT builds for it, else that it cannot (TensorRT-RTX builds for
    declared targets, or the stage skips). The tool versions are in the key already."""
    if unavailable_reason() is not None:
        return "no datacenter TensorRT build here"
    capability, name = gpu_info()
    return f"datacenter TensorRT on a {name} (compute capability {capability})"


def gpu_info() -> tuple[str, str]:
    """(compute capability as "major.minor", GPU name) of CUDA device 0."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}", torch.cuda.get_device_name(0)


def make_stamp(
    recipe: Recipe,
    onnx_path: Path,
    resolved: list[ResolvedProfile],
    plan: engine_backends.BuildPlan,
    built: BuiltEngine,
    engine_path: Path,
) -> dict[str, Any]:
    """What an engine was built with and for. Datacenter TensorRT: the local GPU
    (``compute_capability``, ``gpu_name``); TensorRT-RTX: ``targets`` (``["sm89"]``),
    ``compute_capability`` their capabilities joined by ",", ``gpu_name`` None."""
    backend = plan.backend or TENSORRT
    if backend is TENSORRT:
        capability, gpu_name = gpu_info()
        targets = [serving_targets.sm_name(capability)]
        runs_on = f"Triton's tensorrt_plan backend with TensorRT {backend.version()} on a {gpu_name}"
    else:
        capability, gpu_name, targets = ",".join(serving_targets.sm_capability(t) for t in plan.targets), None, plan.targets
        runs_on = rtx_runs_on(plan.targets)
    return {
        "backend": backend.name,
        "backend_label": backend.label,
        "tensorrt_version": backend.version(),
        "compute_capability": capability,
        "gpu_name": gpu_name,
        "targets": targets,
        "check_only": plan.check_only,
        "recipe_hash": recipe.engine_hash,
        "onnx_sha256": sha256_file(onnx_path),  # the .onnx file only, not external data
        "profiles": [asdict(p) for p in resolved],
        "engine_file": engine_path.name,
        "engine_bytes": len(built.plan),
        "build_wall_s": round(built.wall_s, 3),
        "builder_peak_rss_mib": round(built.peak_rss_mib, 1),
        "timing_cache": built.timing_cache,
        "runs_on": runs_on,
        "network": built.network.to_json(),
    }


def rtx_runs_on(targets: Sequence[str]) -> str:
    """Where a TensorRT-RTX engine for ``targets`` runs, and how to load it."""
    gpus = [f"{t} ({', '.join(g.upper() for g, c in serving_targets.GPU_CAPABILITY.items() if c == serving_targets.sm_capability(t))})"
            for t in targets]
    return ("the TensorRT-RTX runtime (tensorrt_rtx_bindings.Runtime(logger).deserialize_cuda_engine(bytes)) on a "
            f"GPU of {', '.join(gpus)}; not Triton's tensorrt_plan backend, which links datacenter TensorRT")


def check_stamp(stamp: dict[str, Any], target: serving_targets.Target, recipe_hash: str) -> serving_targets.Comparison:
    """Compare an engine's stamp with the DECLARED serving target (not this machine).

    A plan loads only in the TensorRT major.minor.patch that built it and on
    GPUs of its compute capability (e.g. "9.0"); ``recipe_hash`` is
    ``Recipe.engine_hash`` of the current recipe. A TensorRT-RTX engine never
    passes: Triton's ``tensorrt_plan`` backend links datacenter TensorRT.

    Returns:
        ``errors``: one line per missing or mismatching field (backend, TensorRT
        version, compute capability, recipe hash); ``warnings``: a different
        GPU model with the same compute capability.
    """
    if stamp.get("backend", TENSORRT.name) != TENSORRT.name:
        return serving_targets.Comparison([
            f"backend: engine built by {stamp.get('backend_label', stamp['backend'])} "
            f"{stamp.get('tensorrt_version', '?')}, which Triton's tensorrt_plan backend (datacenter TensorRT "
            f"{target.tensorrt}) cannot load; serve the ONNX graph, or build with datacenter TensorRT on the "
            f"serving GPU {target.gpu_name} (build.backend: tensorrt)"], [])
    errors: list[str] = []
    for key in ("tensorrt_version", "compute_capability", "gpu_name", "recipe_hash"):
        if key not in stamp:
            errors.append(f"{key}: missing from the engine stamp; rebuild the engine")
    if "recipe_hash" in stamp and str(stamp["recipe_hash"]) != recipe_hash:
        errors.append(f"recipe_hash: engine has {stamp['recipe_hash']!r}, the recipe {recipe_hash!r} "
                      "(the recipe changed since the engine was built); rebuild the engine")
    if errors:
        return serving_targets.Comparison(errors, [])
    built = serving_targets.Target(str(stamp["tensorrt_version"]), str(stamp["compute_capability"]), str(stamp["gpu_name"]))
    result = serving_targets.compare(built, target, "engine")
    return serving_targets.Comparison([f"{e}; rebuild the engine" for e in result.errors], result.warnings)


# --- serving runtime: checked before building ---------------------------------------------


def local_target() -> serving_targets.Target:
    """This machine as a build target: tensorrt package version and CUDA device 0."""
    capability, name = gpu_info()
    return serving_targets.Target(tensorrt_version(), capability, name)


def preflight(recipe: Recipe, local: serving_targets.Target, script: Path) -> list[str]:
    """Refuse a build whose engine the declared serving runtime could not load.

    Args:
        recipe: its ``triton.serving`` is the declared target; ``quantize.precision``.
        local: this machine (TensorRT version, compute capability, GPU name).
        script: the written ``trtexec.sh``, named in the refusal.

    Returns:
        Warnings (e.g. another GPU model with the same compute capability).

    Raises:
        ServingRuntimeError: FP8 on a GPU below compute capability 8.9 (here or
            declared); ``triton.serving`` missing; a different TensorRT
            major.minor.patch or compute capability than declared.
    """
    precision = recipe.quantize.precision
    problem = capability_problem(precision, local.compute_capability, f"this GPU ({local.gpu_name})")
    if problem:
        raise ServingRuntimeError(f"build: {problem}; build on a GPU of compute capability 8.9 or later")
    cfg = recipe.triton.serving
    if cfg is None:
        raise ServingRuntimeError(
            f"build: TensorRT {local.tensorrt} and a {local.gpu_name} (compute capability {local.compute_capability}) "
            "are present, so an engine would be built, but the recipe does not declare triton.serving, the runtime "
            "that will load it. Add e.g. triton: {serving: {container: '25.01-trtllm-python-py3', gpu: 'H100'}} or "
            "{tensorrt: '10.8.0', gpu: 'H100'}" + _containers_hint(local.tensorrt)
        )
    declared = serving_targets.declared_target(cfg)
    problem = capability_problem(precision, declared.compute_capability, f"the serving GPU ({declared.gpu_name})")
    if problem:
        raise ServingRuntimeError(f"build: {problem} (recipe triton.serving.gpu)")
    result = serving_targets.compare(local, declared, "this machine")
    if result.errors:
        raise ServingRuntimeError(
            "build: refusing to build an engine the declared serving runtime cannot load:\n  "
            + "\n  ".join(result.errors) + "\n" + _where_to_build(declared, script)
        )
    return result.warnings


def _containers_hint(version: str) -> str:
    tags = serving_targets.containers_with(version)
    return f"; known containers with TensorRT {version}: {', '.join(tags)}" if tags else ""


def _where_to_build(declared: serving_targets.Target, script: Path) -> str:
    """How to build the same engine where TensorRT and the GPU match the declaration."""
    rel = os.path.relpath(script)
    under_cwd = not rel.startswith("..")  # then mounting the working folder brings the script's inputs along
    shown = rel if under_cwd else str(script)
    image = declared.image
    if image is None:
        tags = serving_targets.containers_with(declared.tensorrt)
        image = serving_targets.container_image(tags[0]) if tags else None
    where = f"inside {image}" if image else f"where TensorRT {declared.tensorrt} is installed"
    docker = f"  (e.g. docker run --rm --gpus all -v \"$PWD\":/work -w /work {image} sh {shown})"
    return (
        f"Build on a {declared.gpu_name} (compute capability {declared.compute_capability}) {where}, with "
        f"trtexec on PATH: sh {shown}" + (docker if image and under_cwd else "")
        + f"; or install tensorrt=={'.'.join(map(str, serving_targets.tensorrt_triple(declared.tensorrt)))}.* here"
    )
