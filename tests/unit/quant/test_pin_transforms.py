"""The pin records the transforms it was tuned with (``match.transforms``): a pin made before them,
or with other ones, is stale and says which method made it; the new quantize fields at their
defaults keep every digest."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.quant import pin
from pipeline.recipe.load import load_recipe

ROOT = Path(__file__).resolve().parents[3]


def _inputs(match: dict) -> dict:
    """The manifest inputs a pin's ``match`` was made from (the model and data digests)."""
    out = {"model_file": {"sha256": match["model"]}}
    for use in ("quantize.calibration.data", "quantize.tuning.data"):
        out[use] = {"sha256": match[use]}
    return out


@pytest.fixture
def recipe_copy(tmp_path):
    path = tmp_path / "fp8-llm.yaml"
    shutil.copy(ROOT / "recipes" / "fp8-llm.yaml", path)
    (tmp_path / "tuned").mkdir()
    return path


def test_a_pin_made_before_the_transforms_is_stale_naming_its_method(recipe_copy):
    old = json.loads((ROOT / "recipes" / "tuned" / "fp8-llm.json").read_text())
    if old["match"].get("search_version") == pin.SEARCH_VERSION:
        old["match"] = {k: v for k, v in old["match"].items() if k != "transforms"}
        old["match"]["search_version"] = 3  # the shipped pin re-tuned: test its predecessor's shape
    (recipe_copy.parent / "tuned" / "fp8-llm.json").write_text(json.dumps(old))
    found = pin.lookup(load_recipe(recipe_copy), recipe_copy, _inputs(old["match"]))
    assert found.pinned is None
    assert "is stale" in found.reason and "the transforms" in found.reason
    assert "made with search version 3, before transforms were recorded" in found.reason
    assert "this recipe: clip:max,wclip:max" in found.reason


def test_a_pin_made_with_other_transforms_names_them(recipe_copy):
    base = load_recipe(recipe_copy)
    old = json.loads((ROOT / "recipes" / "tuned" / "fp8-llm.json").read_text())
    match = {**old["match"], **pin.match_fields(base, _inputs(old["match"]))}
    assert match["transforms"] == "clip:max,wclip:max"
    (recipe_copy.parent / "tuned" / "fp8-llm.json").write_text(json.dumps({**old, "match": match}))
    assert pin.lookup(base, recipe_copy, _inputs(match)).pinned is not None
    clipped = load_recipe(recipe_copy, {"quantize.weight_clip": "mse", "quantize.calibration.method": "kl",
                                        "quantize.smoothquant": {"mode": "search"}})
    found = pin.lookup(clipped, recipe_copy, _inputs(match))
    assert found.pinned is None
    assert "made with clip:max,wclip:max; this recipe: clip:kl,wclip:mse,smooth:search" in found.reason


def test_new_fields_at_their_defaults_keep_the_digest():
    plain = load_recipe(ROOT / "recipes" / "int8-llm.yaml")
    spelled = load_recipe(ROOT / "recipes" / "int8-llm.yaml", {
        "quantize.weight_clip": "max", "quantize.rotate": False, "quantize.smoothquant.mode": "alpha"})
    assert spelled.quantize.model_dump(mode="json") == plain.quantize.model_dump(mode="json")
    assert pin.match_fields(spelled, {})["quantize"] == pin.match_fields(plain, {})["quantize"]
    shipped = json.loads((ROOT / "recipes" / "tuned" / "int8-llm.json").read_text())
    assert pin.match_fields(plain, {})["quantize"] == shipped["match"]["quantize"]
    for over in ({"quantize.weight_clip": "kl"}, {"quantize.rotate": True}, {"quantize.smoothquant.mode": "search"}):
        assert pin.match_fields(load_recipe(ROOT / "recipes" / "int8-llm.yaml", over), {})["quantize"] != \
            shipped["match"]["quantize"], over
