"""The serving pin (pipeline.triton.pin): its match rules (hardware class declared by the recipe,
graph sha256, runtime per model), its validation, and the triton stage applying it: a pin that
changes the instance count makes a rebuild write that count, and a new pin changes the stage key."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.context import Progress, StageContext
from pipeline.errors import RecipeError
from pipeline.stages import triton as stage
from pipeline.triton import pin
from pipeline.triton.config import parse_config
from serve_tiny import encoder_artifacts, encoder_recipe

CHOSEN = {"tiny_enc": {"role": "compute", "instance_count": 3, "max_batch_size": 8,
                       "dynamic_batching": {"max_queue_delay_microseconds": 1000, "preferred_batch_size": []},
                       "intra_op_threads": 1}}


def write_pin(recipe, artifacts, recipe_path: Path, runtime: str = "python-onnxruntime", **match) -> Path:
    fields = pin.match_fields(recipe, pin.served_graphs(recipe, artifacts["quantize"], artifacts["build"], runtime),
                              pin.runtimes_of(recipe, runtime, None))
    fields.update(match)
    path = pin.pin_path(recipe_path, recipe.name)
    pin.write(path, fields, CHOSEN, [], "test", {"note": "test"})
    return path


def lookup(recipe, artifacts, recipe_path, runtime="python-onnxruntime"):
    return stage.serving_pin(recipe, recipe_path, artifacts["quantize"], artifacts["build"], runtime)


def test_pin_applies_only_where_hardware_graph_and_runtime_match(tmp_path):
    recipe = encoder_recipe(tmp_path, serve={"cpu_cores": 2})
    artifacts, recipe_path = encoder_artifacts(tmp_path), tmp_path / "r.yaml"
    assert not lookup(recipe, artifacts, recipe_path).applies  # no pin yet
    write_pin(recipe, artifacts, recipe_path)
    found = lookup(recipe, artifacts, recipe_path)
    assert found.applies and found.pinned["match"]["hardware"] == "cpu:2"

    other_hardware = encoder_recipe(tmp_path, serve={"cpu_cores": 16})  # another declared serving host
    found = lookup(other_hardware, artifacts, recipe_path)
    assert not found.applies and not found.serve_only
    assert "hardware class: pinned 'cpu:2', the recipe declares 'cpu:16'" in found.reason

    write_pin(recipe, artifacts, recipe_path, graphs={"tiny_enc": "0" * 64})  # tuned on other graphs
    found = lookup(recipe, artifacts, recipe_path)
    assert not found.applies and not found.serve_only and "graph of tiny_enc: pinned sha256 000000000000" in found.reason

    write_pin(recipe, artifacts, recipe_path)  # measured on python-onnxruntime; published as onnxruntime_onnx
    found = lookup(recipe, artifacts, recipe_path, runtime="onnxruntime")
    assert not found.applies and found.serve_only
    assert "runtime of tiny_enc: measured python-onnxruntime, this repository onnxruntime_onnx" in found.reason


def test_hardware_class_is_the_declared_one():
    from types import SimpleNamespace as NS

    assert pin.hardware_class(NS(triton=NS(serving=NS(gpu="L4")), serve=NS(cpu_cores=2))) == "gpu:L4"
    assert pin.hardware_class(NS(triton=NS(serving=None), serve=NS(cpu_cores=2))) == "cpu:2"
    assert pin.hardware_class(NS(triton=NS(serving=None), serve=NS(cpu_cores=None))) is None


def test_invalid_pin_is_refused_naming_the_key(tmp_path):
    recipe = encoder_recipe(tmp_path, serve={"cpu_cores": 2})
    artifacts, recipe_path = encoder_artifacts(tmp_path), tmp_path / "r.yaml"
    path = write_pin(recipe, artifacts, recipe_path)
    data = json.loads(path.read_text())
    data["chosen"]["tiny_enc"]["instance_count"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(RecipeError, match=r"chosen\[\"tiny_enc\"\]\[\"instance_count\"\]"):
        lookup(recipe, artifacts, recipe_path)


def test_a_pin_that_changes_the_count_makes_a_rebuild_write_it(tmp_path):
    recipe = encoder_recipe(tmp_path, serve={"cpu_cores": 2})  # target python-onnxruntime, count 1
    artifacts, recipe_path = encoder_artifacts(tmp_path), tmp_path / "r.yaml"
    ctx = StageContext(recipe, recipe_path, tmp_path / "artifacts" / recipe.name, "triton", Progress(True))
    a = artifacts
    stage.run(ctx, a["export"], a["quantize"], a["build"])
    config = Path(recipe.output_dir) / "tiny_enc" / "config.pbtxt"
    assert parse_config(config.read_text()).instance_group[0].count == 1
    key_before = stage.key_extra(ctx)

    write_pin(recipe, artifacts, recipe_path)
    assert stage.key_extra(ctx) != key_before  # a new pin is a new triton stage key: it republishes
    stage.run(ctx, a["export"], a["quantize"], a["build"])
    cfg = parse_config(config.read_text())
    assert cfg.instance_group[0].count == 3
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 1000 and not cfg.dynamic_batching.preferred_batch_size
    assert cfg.parameters["intra_op_threads"].string_value == "1"
    first = config.read_text()
    stage.run(ctx, a["export"], a["quantize"], a["build"])
    assert config.read_text() == first  # the same config.pbtxt every time: nothing is derived from this CPU
    index = json.loads((Path(recipe.output_dir) / "repository.json").read_text())
    assert index["models"]["tiny_enc"]["recipe_hash"] == recipe.digest

    mismatched = encoder_recipe(tmp_path, serve={"cpu_cores": 8})  # another hardware class: not applied
    ctx = StageContext(mismatched, recipe_path, ctx.run_dir, "triton", Progress(True))
    art = stage.run(ctx, a["export"], a["quantize"], a["build"])
    assert parse_config(config.read_text()).instance_group[0].count == 1
    assert any("hardware class" in w for w in art.warnings)


SHIPPED = sorted((Path(__file__).resolve().parents[3] / "recipes" / "tuned").glob("*.serving.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_serving_pins_are_valid_and_say_where_they_were_measured(path):
    from pipeline.recipe.load import load_recipe

    data = pin.read(path)
    recipe = load_recipe(path.parent.parent / f"{path.name.removesuffix(pin.SUFFIX)}.yaml")
    assert data["match"]["hardware"] == pin.hardware_class(recipe)  # the recipe declares what it was measured for
    assert data["recorded"]["note"] and data["recorded"]["cpu_model"] and data["candidates"]
    assert set(data["chosen"]) <= set(data["match"]["runtimes"])
