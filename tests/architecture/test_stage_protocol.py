"""Each stage declares itself (NAME, NEEDS, ARTIFACT, key_sections, run); the
runner only walks them and knows no recipe section."""
from __future__ import annotations

import inspect
import re

import pytest

from pipeline.run import runner
from pipeline.imports import PACKAGE
from pipeline.recipe.load import load_recipe
from conftest import ROOT


def test_every_stage_module_is_walked_and_declares_itself():
    stages = PACKAGE / "stages"  # a stage is a module or a package
    files = {f"pipeline.stages.{p.stem}" for p in stages.glob("*.py") if p.stem != "__init__"} | \
        {f"pipeline.stages.{p.parent.name}" for p in stages.glob("*/__init__.py")}
    assert set(runner.STAGES) == files
    for stage in runner._stages():
        assert stage.module.__name__ == f"pipeline.stages.{stage.name}"
        assert isinstance(stage.artifact, type)
        params = list(inspect.signature(stage.fn).parameters.values())
        assert len(params) == 1 + len(stage.deps), f"{stage.name}.run takes ctx and one artifact per need"


def test_stage_order_and_needs():
    assert [(s.name, s.deps) for s in runner._stages()] == [
        ("export", ()), ("quantize", ("export",)), ("build", ("export", "quantize")),
        ("validate", ("export", "quantize", "build")), ("triton", ("export", "quantize", "build"))]
    assert [s.name for s in runner._stages() if s.gated] == ["triton"]


def test_a_stage_that_needs_a_later_one_is_a_pipeline_bug(monkeypatch):
    from pipeline.errors import InternalError

    monkeypatch.setattr(runner, "STAGES", tuple(reversed(runner.STAGES)))
    with pytest.raises(InternalError, match=r"stage triton \(pipeline.stages.triton\) needs \['export', 'quantize', 'build'\], which do not run before it"):
        runner._stages()


def test_the_runner_reads_no_recipe_section():
    source = inspect.getsource(runner)
    sections = re.findall(r"\b(?:recipe|r)\.(model|export|quantize|build|validate_|triton)\b", source)
    assert sections == []
    assert not hasattr(runner, "_SECTIONS") and not hasattr(runner, "_build")


@pytest.mark.parametrize("name", ["fp8-llm", "int8-encoder", "int8-textline-orientation"])
def test_key_sections_follow_the_recipe_fields_each_stage_reads(name):
    recipe = load_recipe(ROOT / "recipes" / f"{name}.yaml", {})
    changed = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"quantize.calibration.method": "percentile"})
    moved = {s.name for s in runner._stages() if s.key_sections(recipe) != s.key_sections(changed)}
    assert moved == {"quantize"}
    gate = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"validate.gates.0.max": 12.5})
    assert {s.name for s in runner._stages() if s.key_sections(recipe) != s.key_sections(gate)} == {"validate"}
