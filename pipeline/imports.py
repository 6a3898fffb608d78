"""The package's own import graph, read with ``ast`` (nothing is imported): module-level
imports, imports inside functions and under ``TYPE_CHECKING``, and ``"pipeline.x.y"`` /
``"pipeline.x.y:name"`` strings (lazy references that ``importlib`` resolves).

Used by the architecture test (layers, no circles) and by :func:`pipeline.provenance.code_hash`,
which hashes a stage's static import closure, so a stage's cache key changes with the code it
runs and with no other.
"""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import NamedTuple

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent

#: Files that are not modules of the package (none: Triton's Python models under triton/templates/ and
#: models/text_generation/served/ run inside tritonserver and import nothing of the pipeline, and the
#: pipeline imports their weight helpers).
NOT_MODULES: tuple[str, ...] = ()

_REFERENCE = re.compile(r"^pipeline(\.\w+)*(:\w+)?$")


class Import(NamedTuple):
    importer: str  # module name
    file: str  # path from the repository root
    line: int
    imported: str  # module name (the longest one of the package that the import names)


def package_modules() -> dict[str, Path]:
    """Module name -> file, for every ``.py`` of ``pipeline/`` (templates excepted)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(NOT_MODULES):
            continue
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    """The longest module of the package that ``name`` (a dotted name) starts with."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _named(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names one AST node imports or refers to (empty for other nodes)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parent = module.split(".") if is_package else module.split(".")[:-1]
            parent = parent[: len(parent) - (node.level - 1)]
            base = ".".join([*parent, *([node.module] if node.module else [])])
        return [f"{base}.{a.name}" for a in node.names]  # a submodule, else resolved to ``base``
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _REFERENCE.match(node.value):
        return [node.value.partition(":")[0]]  # import_module("pipeline.x"), "pipeline.x:Class", resources
    return []


@functools.lru_cache(maxsize=1)
def _cached_imports() -> tuple[Import, ...]:
    return tuple(package_imports())


def package_imports() -> list[Import]:
    """Every import between modules of ``pipeline/`` (a module importing itself is dropped)."""
    modules = package_modules()
    out = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for name in _named(node, module, path.name == "__init__.py"):
                target = _module_of(name, modules)
                if target is not None and target != module:
                    out.append(Import(module, path.relative_to(ROOT).as_posix(), node.lineno, target))
    return out


def closure(module: str) -> list[str]:
    """``module`` and every package module it reaches through its imports, sorted."""
    edges: dict[str, set[str]] = {}
    for imp in _cached_imports():
        edges.setdefault(imp.importer, set()).add(imp.imported)
    seen, todo = {module}, [module]
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return sorted(seen)
