"""The two TensorRT Python modules the build stage drives, and which one a recipe gets.

Datacenter TensorRT (``import tensorrt``, the ``[tensorrt]`` extra) builds for
the GPU it runs on and needs one; its plans are what Triton's ``tensorrt_plan``
backend loads. TensorRT for RTX (``import tensorrt_rtx_bindings``, a core
dependency) has the same ONNX parser and builder API and builds without a GPU
for the compute capabilities chosen on the builder config
(``num_compute_capabilities`` / ``set_compute_capability``), but only those of
its ``ComputeCapability`` enum (no sm90 / sm100, see
:data:`pipeline.targets.RTX_TARGETS`); its timing-cache calls are deprecated
no-ops. Its engines run only in the TensorRT-RTX runtime, not in Triton.

:class:`Backend` hides those differences so pipeline.stages.build has one
build path; :func:`choose` turns ``build.backend`` / ``build.targets`` into a
:class:`BuildPlan`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from pipeline import targets as serving_targets
from pipeline.errors import PipelineError

if TYPE_CHECKING:
    import tensorrt_rtx_bindings as rtx

    from pipeline.recipe.schema import Recipe


class BackendChoiceError(PipelineError):
    """``build.backend`` asks for a build this recipe or machine cannot make (exit 2)."""


@dataclass(frozen=True)
class Backend:
    """One TensorRT Python module: ``name`` as in ``build.backend``, ``label`` for people."""

    name: str
    label: str
    module_name: str
    #: whether the timing cache does anything (TensorRT-RTX: deprecated no-ops)
    timing_cache: bool
    #: whether it builds for chosen compute capabilities without a GPU (else: for the local GPU)
    cross_targets: bool

    def module(self) -> Any:
        """The imported Python module (``tensorrt`` or ``tensorrt_rtx_bindings``)."""
        return importlib.import_module(self.module_name)

    def version(self) -> str:
        return str(self.module().__version__)

    def select_targets(self, config: Any, targets: Sequence[str]) -> None:
        """Set the compute capabilities (``["sm89"]``) to build for; datacenter TensorRT
        builds for the local GPU and ignores ``targets``."""
        if self.cross_targets:
            set_compute_capabilities(config, targets)


TENSORRT = Backend("tensorrt", "TensorRT", "tensorrt", timing_cache=True, cross_targets=False)
TENSORRT_RTX = Backend("tensorrt-rtx", "TensorRT-RTX", "tensorrt_rtx_bindings", timing_cache=False,
                       cross_targets=True)
BACKENDS = {b.name: b for b in (TENSORRT, TENSORRT_RTX)}


def set_compute_capabilities(config: rtx.IBuilderConfig, targets: Sequence[str]) -> None:
    """TensorRT-RTX: build one engine for every target in ``targets`` (``sm89`` -> ``SM89``).

    Raises:
        BackendChoiceError: a target TensorRT-RTX has no kernels for (sm90, sm100).
    """
    import tensorrt_rtx_bindings as rtx

    config.num_compute_capabilities = len(targets)
    for index, target in enumerate(targets):
        cap = getattr(rtx.ComputeCapability, target.upper(), None)
        if cap is None:
            raise BackendChoiceError(f"build.targets: TensorRT-RTX {rtx.__version__} cannot build for {target}; "
                                     f"it builds {', '.join(serving_targets.RTX_TARGETS)}")
        config.set_compute_capability(cap, index)


def import_problem(backend: Backend) -> str | None:
    """Why ``backend``'s module cannot be used here (None if it has a Builder)."""
    try:
        module = backend.module()
    except (ImportError, OSError) as e:
        return f"{backend.module_name} Python package not importable: {e}"
    if not hasattr(module, "Builder"):
        where = getattr(module, "__file__", None) or ", ".join(getattr(module, "__path__", [])) or "?"
        return (f"{backend.module_name} Python package not importable: {backend.module_name!r} resolves to {where}, "
                "which has no Builder (only type stubs are installed, not the wheel)")
    return None


@dataclass(frozen=True)
class BuildPlan:
    """What the build stage makes: ``backend`` None means no engine (``reason`` says why).

    ``targets``: compute capabilities the engine is built for (``["sm89"]``; empty for
    datacenter TensorRT, which builds for the local GPU). ``check_only``: a TensorRT-RTX
    parse-and-build check for :data:`~pipeline.targets.RTX_CHECK_TARGET`, standing in for
    a target TensorRT-RTX cannot build (not a deployable engine). ``notes``: for the report.
    """

    backend: Backend | None
    targets: list[str] = field(default_factory=list)
    check_only: bool = False
    reason: str = ""
    notes: list[str] = field(default_factory=list)


def declared_targets(recipe: Recipe) -> list[str]:
    """``build.targets``, then the compute capability of ``triton.serving.gpu`` if not among
    them (``["sm89", "sm90"]``); [] when neither is declared."""
    targets: list[str] = list(recipe.build.targets)
    if recipe.triton.serving is not None:
        served = serving_targets.sm_name(serving_targets.declared_target(recipe.triton.serving).compute_capability)
        targets += [] if served in targets else [served]
    return targets


def choose(recipe: Recipe, datacenter_problem: str | None) -> BuildPlan:
    """The build for ``recipe.build.backend`` on this machine.

    Args:
        datacenter_problem: why datacenter TensorRT cannot build here (no wheel, no
            CUDA GPU), or None when it can.

    Raises:
        BackendChoiceError: ``tensorrt-rtx`` without any declared target, or with
            only targets TensorRT-RTX cannot build.
    """
    choice = recipe.build.backend
    if choice == "none":
        return BuildPlan(None, reason="build.backend is 'none'")
    if choice == "tensorrt" or (choice == "auto" and datacenter_problem is None):
        return BuildPlan(TENSORRT if datacenter_problem is None else None, reason=datacenter_problem or "")
    return _rtx_plan(recipe, choice, datacenter_problem)


def check_target(precision: str) -> str:
    """The TensorRT-RTX target of a parse-and-build check: :data:`pipeline.targets.RTX_CHECK_TARGET`
    (sm89) where the precision's kernels exist there, else the first TensorRT-RTX target that has
    them (NVFP4: sm120)."""
    from pipeline.recipe.precisions import capability_problem

    order = [serving_targets.RTX_CHECK_TARGET, *serving_targets.RTX_TARGETS]
    return next((t for t in order if capability_problem(precision, serving_targets.sm_capability(t), t) is None),
                serving_targets.RTX_CHECK_TARGET)


def _rtx_plan(recipe: Recipe, choice: str, datacenter_problem: str | None) -> BuildPlan:
    targets = declared_targets(recipe)
    if not targets:
        if choice == "tensorrt-rtx":
            raise BackendChoiceError("build.backend: tensorrt-rtx needs a target: set build.targets "
                                     "(e.g. [sm89]) or triton.serving.gpu")
        return BuildPlan(None, reason=f"{datacenter_problem}; no build.targets or triton.serving.gpu declared, so "
                         "TensorRT-RTX has no target to build for (add e.g. build.targets: [sm89])")
    problem = import_problem(TENSORRT_RTX)
    if problem:
        why = f"{datacenter_problem}; {problem}" if choice == "auto" else problem
        return BuildPlan(None, reason=why)
    buildable = [t for t in targets if t in serving_targets.RTX_TARGETS]
    left = [t for t in targets if t not in serving_targets.RTX_TARGETS]
    notes = [f"{', '.join(left)}: not a TensorRT-RTX target; build that engine with datacenter TensorRT on such a "
             "GPU (trtexec.sh)"] if left else []
    if buildable:
        return BuildPlan(TENSORRT_RTX, buildable, notes=notes)
    if choice == "tensorrt-rtx":
        raise BackendChoiceError(f"build.backend: tensorrt-rtx cannot build for {targets} (it builds "
                                 f"{', '.join(serving_targets.RTX_TARGETS)}); use backend auto for a check build")
    check = check_target(recipe.quantize.precision)
    return BuildPlan(TENSORRT_RTX, [check], check_only=True, notes=notes + [
        f"TensorRT-RTX parse-and-build CHECK for {check} (the parser and builder accept the graph and profiles), "
        f"not a deployable engine for {', '.join(left)}"])
