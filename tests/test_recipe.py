from __future__ import annotations

import pytest
import yaml

from conftest import ROOT
from pipeline.errors import RecipeError
from pipeline.recipe import load_recipe

RECIPE = ROOT / "recipes" / "fp8-llm.yaml"


def _variant(tmp_path, mutate):
    data = yaml.safe_load(RECIPE.read_text())
    mutate(data)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_recipe_is_valid():
    r = load_recipe(RECIPE)
    assert r.quantize.precision == "fp8" and r.validate_.gates.max_relative_perplexity_increase == 0.015


@pytest.mark.parametrize(
    "mutate, expect",
    [
        (lambda d: d["quantize"].update(bogus=1), "quantize.bogus: unknown key"),
        (lambda d: d["quantize"]["calibration"].update(method="minmax"), "quantize.calibration.method"),
        (lambda d: d["export"].update(opset="nineteen"), "export.opset"),
        (lambda d: d["build"]["profiles"][0]["dims"]["batch"].update(min=9), "need min <= opt <= max"),
        (lambda d: d["quantize"]["calibration"].update(split={"start": 200, "stop": 250}), "overlaps validate.split"),
        (lambda d: d["quantize"]["calibration"].update(samples=2), "below min_samples"),
        (lambda d: d["triton"]["instance_group"][0].update(kind="GPU"), "triton.instance_group.0.kind"),
        (lambda d: d["build"].update(profiles=[]), "build.profiles"),
        (lambda d: d["quantize"]["calibration"].update(seq_len=512), "outside build.profiles[0] sequence range"),
        (lambda d: d["quantize"]["calibration"].update(batch_size=16), "outside build.profiles[0] batch range"),
    ],
)
def test_bad_recipe_names_file_and_key(tmp_path, mutate, expect):
    path = _variant(tmp_path, mutate)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(path) in str(err.value) and expect in str(err.value)


def test_override_by_dotted_path():
    r = load_recipe(RECIPE, {"validate.gates.max_relative_perplexity_increase": 0.5})
    assert r.validate_.gates.max_relative_perplexity_increase == 0.5


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(tmp_path / "list.yaml")
