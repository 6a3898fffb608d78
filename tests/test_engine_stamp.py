"""An engine is placed in a repository only when its stamp matches the target."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from pipeline.artifacts import BuildArtifact
from pipeline.errors import TritonConfigError
from pipeline.recipe import load_recipe
from pipeline.stages.triton import check_engine


def _build(tmp_path, **stamp):
    path = tmp_path / "engine_stamp.json"
    path.write_text(json.dumps(stamp))
    return BuildArtifact("ok", "", str(tmp_path / "model.plan"), str(path), str(tmp_path / "trtexec.sh"), [])


def test_matching_stamp_is_accepted(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    b = _build(tmp_path, tensorrt_version="10.13.0", compute_capability="9.0", recipe_hash=recipe.engine_hash)
    check_engine(recipe, b, tensorrt_version="10.13.0", compute_capability="9.0")


@pytest.mark.parametrize("field, value, message", [
    ("tensorrt_version", "10.8.0", "tensorrt_version: engine has '10.8.0', here '10.13.0'"),
    ("compute_capability", "8.9", "compute_capability: engine has '8.9', here '9.0'"),
    ("recipe_hash", "0" * 64, "recipe changed"),
])
def test_mismatched_stamp_is_refused(tmp_path, field, value, message):
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    stamp = {"tensorrt_version": "10.13.0", "compute_capability": "9.0", "recipe_hash": recipe.engine_hash}
    stamp[field] = value
    with pytest.raises(TritonConfigError, match="refused") as err:
        check_engine(recipe, _build(tmp_path, **stamp), tensorrt_version="10.13.0", compute_capability="9.0")
    assert message in str(err.value)


def test_gate_change_keeps_the_engine_hash():
    a = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    b = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"validate.gates.max_relative_perplexity_increase": 0.5})
    c = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"quantize.calibration.method": "entropy"})
    assert a.engine_hash == b.engine_hash != c.engine_hash


def test_missing_stamp_is_refused(tmp_path):
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    b = BuildArtifact("ok", "", str(tmp_path / "model.plan"), None, str(tmp_path / "trtexec.sh"), [])
    with pytest.raises(TritonConfigError, match="no engine_stamp.json"):
        check_engine(recipe, b, tensorrt_version="10.13.0", compute_capability="9.0")
