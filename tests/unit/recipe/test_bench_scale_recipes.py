"""benchmarks/scale.py ``scale_recipe``: the recipe each bench-scale row builds (fp8 and int4-awq),
checked against the schema and the shipped recipes it starts from."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("bench_scale", ROOT / "benchmarks" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scale = _script()
BASES = {name: yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text()) for name in set(scale.BASES.values())}


def _load(data: dict, tmp_path: Path):
    from pipeline.recipe.load import load_recipe

    path = tmp_path / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_recipe(path)


@pytest.mark.parametrize("size", list(scale.SIZES))
def test_int4_awq_row_is_int4_llm_with_awq_blocks_and_fp8_calibration(size, tmp_path):
    data = scale.scale_recipe(BASES, size, "int4-awq", tmp_path / "model", tmp_path)
    r = _load(data, tmp_path)
    assert r.quantize.precision == "int4"
    assert (r.quantize.weights.method, r.quantize.weights.block_size) == ("awq", scale.INT4_BLOCK)
    assert data["quantize"]["calibration"] == BASES["fp8-llm"]["quantize"]["calibration"]
    assert list(r.build.targets) == BASES["int4-llm"]["build"]["targets"]
    assert "sm75" not in r.build.targets  # no INT4 kernels there
    shape = scale.SIZES[size]
    assert shape["hidden_size"] % scale.INT4_BLOCK == 0 and shape["intermediate_size"] % scale.INT4_BLOCK == 0
    assert data["model"] == {"kind": "text-generation", "source": {"path": str(tmp_path / "model")}}
    assert data["validate"]["gates"] == [{"metric": "relative_perplexity_increase", "max": 9.0}]
    assert data["validate"]["max_windows"] == 8
    assert r.name == f"scale-{size.replace('.', '_')}-int4-awq"
    assert r.triton.model_name == f"scale_{size.replace('.', '_')}_int4_awq"


def test_fp8_row_keeps_its_names_and_the_shipped_recipes_are_not_changed(tmp_path):
    before = yaml.safe_dump(BASES)
    data = scale.scale_recipe(BASES, "0.5b", "fp8", tmp_path / "model", tmp_path)
    r = _load(data, tmp_path)
    assert (r.name, r.triton.model_name, r.quantize.precision) == ("scale-0_5b", "scale_0_5b", "fp8")
    assert data["validate"]["gates"] == [{"metric": "relative_perplexity_increase", "max": 9.0}]
    assert data["quantize"] == BASES["fp8-llm"]["quantize"]
    assert yaml.safe_dump(BASES) == before


def test_unknown_precision_or_size_or_a_block_not_dividing_k_is_refused(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="int8"):
        scale.scale_recipe(BASES, "0.5b", "int8", tmp_path, tmp_path)
    with pytest.raises(ValueError, match="7b"):
        scale.scale_recipe(BASES, "7b", "fp8", tmp_path, tmp_path)
    monkeypatch.setattr(scale, "INT4_BLOCK", 128)  # 576 = 4.5 x 128
    with pytest.raises(ValueError, match="hidden_size"):
        scale.scale_recipe(BASES, "135m", "int4-awq", tmp_path, tmp_path)
