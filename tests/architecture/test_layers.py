"""The import structure of ``pipeline/``: layers, and no import circles.

Every import in the package is read with ``ast`` by :mod:`pipeline.imports` (which imports nothing of it):
module-level, inside functions, under ``TYPE_CHECKING``, ``importlib.import_module`` /
``__import__`` calls, and ``"pipeline.x.y"`` / ``"pipeline.x.y:name"`` strings (the lazy
references the model registry and the CLI's command table resolve, and
``importlib.resources.files("pipeline.triton")``, which imports that package).

A module may import its own layer or a lower one, never a higher one; and no module
reaches itself through its imports, whatever the layers. A new module needs a row in
:data:`LAYERS` (its longest listed prefix gives its layer).
"""
from __future__ import annotations

import ast
from pathlib import Path

from pipeline.imports import PACKAGE, ROOT, Import, _module_of, _named, package_imports, package_modules  # noqa: F401

BASE, GROUND, TOOLKITS, KINDS, STAGES, RUN, SERVICES, ROOF = range(8)
LAYER_NAMES = ("base", "ground (recipe and sources)", "toolkits", "model kinds", "stages", "run",
               "serve / plan / remote", "CLI")

#: module or package prefix -> layer; the longest prefix that matches a module decides.
LAYERS: dict[str, int] = {
    # below everything: errors, files, artifact types, this process, ONNX I/O and sessions, versions
    "pipeline": BASE, "pipeline.errors": BASE, "pipeline.fsutil": BASE, "pipeline.artifacts": BASE,
    "pipeline.faults": BASE, "pipeline.interrupts": BASE, "pipeline.memory": BASE, "pipeline.imports": BASE,
    "pipeline.provenance": BASE, "pipeline.onnx_io": BASE,
    # what one run asks for, and what it reads
    "pipeline.recipe": GROUND, "pipeline.sources": GROUND, "pipeline.targets": GROUND,
    # toolkits
    "pipeline.ort_sessions": TOOLKITS, "pipeline.context": TOOLKITS,
    "pipeline.checks": TOOLKITS, "pipeline.trt": TOOLKITS, "pipeline.runners": TOOLKITS,
    "pipeline.quant": TOOLKITS, "pipeline.triton": TOOLKITS, "pipeline.metrics": TOOLKITS,
    "pipeline.models": KINDS,
    "pipeline.stages": STAGES,
    "pipeline.run": RUN,
    "pipeline.serve": SERVICES, "pipeline.plan": SERVICES, "pipeline.remote": SERVICES,
    "pipeline.cli": ROOF, "pipeline.__main__": ROOF, "pipeline.docs_reference": ROOF,
}

def layer_of(module: str) -> int | None:
    """The layer of ``module``: that of its longest prefix in :data:`LAYERS`, or None."""
    name = module
    while name:
        if name in LAYERS:
            return LAYERS[name]
        name = name.rpartition(".")[0]
    return None


def cycles(imports: list[Import]) -> list[list[Import]]:
    """One import circle (as its imports, in order) per strongly connected group of modules
    (Tarjan's algorithm, iterative); empty when the module graph is acyclic."""
    graph: dict[str, list[Import]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, []).append(imp)
        graph.setdefault(imp.imported, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            edges = graph[node]
            if i < len(edges):
                work.append((node, i + 1))
                nxt = edges[i].imported
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return [_circle(group, graph) for group in groups]


def _circle(group: set[str], graph: dict[str, list[Import]]) -> list[Import]:
    """A path of imports inside ``group`` from its first module back to itself (breadth first)."""
    start = min(group)
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for imp in graph[node]:
                if imp.imported not in group:
                    continue
                if imp.imported == start:
                    path = [imp]
                    while path[0].importer != start:
                        path.insert(0, came[path[0].importer])
                    return path
                if imp.imported not in came:
                    came[imp.imported] = imp
                    nxt.append(imp.imported)
        frontier = nxt
    raise AssertionError(f"no circle through {start} in {sorted(group)}")  # a group always has one


def _where(imp: Import) -> str:
    return f"{imp.file}:{imp.line}: {imp.importer} imports {imp.imported}"


def test_every_module_has_a_layer():
    unlisted = sorted(m for m in package_modules() if layer_of(m) is None)
    assert not unlisted, f"modules without a layer (add a row to LAYERS in {Path(__file__).name}): {unlisted}"


def test_no_module_imports_a_higher_layer():
    upward = [imp for imp in package_imports()
              if (layer_of(imp.importer) or 0) < (layer_of(imp.imported) or 0)]
    lines = [f"{_where(imp)} (layer {LAYER_NAMES[layer_of(imp.importer) or 0]} imports "
             f"layer {LAYER_NAMES[layer_of(imp.imported) or 0]})" for imp in upward]
    assert not upward, "imports of a higher layer:\n" + "\n".join(lines)


def test_no_import_circle():
    found = cycles(package_imports())
    text = "\n".join("circle:\n  " + "\n  ".join(_where(imp) for imp in circle) for circle in found)
    assert not found, f"{len(found)} import circle(s):\n{text}"


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """The checks above are only as good as the reader: a function-level, a type-only, an
    ``importlib`` and a relative import are each found, and a circle of two is reported."""
    source = ('from __future__ import annotations\nfrom typing import TYPE_CHECKING\nimport importlib\n'
              'if TYPE_CHECKING:\n    from pipeline.recipe import Recipe\n'
              'def f():\n    from pipeline import cli\n    return importlib.import_module("pipeline.plan.capacity")\n'
              'from .registry import adapter\n')
    modules = {"pipeline.models.common": Path("x"), "pipeline.recipe": Path("x"), "pipeline.cli": Path("x"),
               "pipeline.plan.capacity": Path("x"), "pipeline.models.registry": Path("x"), "pipeline": Path("x")}
    names = {_module_of(n, modules) for node in ast.walk(ast.parse(source))
             for n in _named(node, "pipeline.models.common", False)}
    assert names == {None, "pipeline.recipe", "pipeline.cli", "pipeline.plan.capacity", "pipeline.models.registry"}
    a_b = Import("a", "a.py", 3, "b")
    b_a = Import("b", "b.py", 7, "a")
    assert cycles([a_b, b_a, Import("b", "b.py", 8, "c")]) == [[a_b, b_a]]
    assert cycles([a_b, Import("b", "b.py", 8, "c")]) == []


def test_a_stage_key_hashes_its_own_import_closure_only():
    """A serve-only edit re-runs no stage; a quantization edit re-runs quantize, not export."""
    from pipeline import imports, provenance

    export, quantize = imports.closure("pipeline.stages.export"), imports.closure("pipeline.stages.quantize")
    assert "pipeline.quant.budget" in quantize and "pipeline.quant.budget" not in export
    assert not any(m.startswith(("pipeline.serve", "pipeline.remote", "pipeline.cli.app")) for m in export + quantize)
    assert provenance.code_hash("pipeline.stages.export") != provenance.code_hash("pipeline.stages.quantize")


def _top_level_names(path: Path) -> set[str]:
    """Names a module binds at its top level (also inside top-level if/try/with blocks)."""
    names: set[str] = set()
    todo = list(ast.parse(path.read_text()).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    return names


def test_every_import_of_the_package_names_something_that_exists():
    """A lazy import inside a function (``from pipeline import data``) of a module that was moved
    fails only when that function runs; this reads every absolute import of ``pipeline.*`` in the
    package, the tests, the benchmarks and the examples."""
    modules = package_modules()
    missing = []
    files = [*modules.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "examples").rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                missing += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}" for a in node.names
                            if a.name.startswith("pipeline.") and a.name not in modules]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "pipeline":
                if node.module not in modules:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} (no such module)")
                    continue
                defined = _top_level_names(modules[node.module])
                missing += [f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {a.name}"
                            for a in node.names if a.name != "*" and f"{node.module}.{a.name}" not in modules
                            and a.name not in defined]
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
