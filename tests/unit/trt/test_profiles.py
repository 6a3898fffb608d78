"""Profile resolution against graph inputs, shape-tensor detection, shape sampling."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.artifacts import TensorSpec
from pipeline.errors import ProfileError
from pipeline.trt.profiles import resolve_profiles, sample_shapes, shape_tensor_inputs
from pipeline.recipe.schema import Profile

LLM_INPUTS = [
    TensorSpec("input_ids", "int64", ["batch", "sequence"]),
    TensorSpec("attention_mask", "int64", ["batch", "total_sequence"]),
    TensorSpec("past_key_values.0.key", "float32", ["batch", 3, "past_sequence", 64]),
]
LLM_DIMS = {
    "batch": {"min": 1, "opt": 4, "max": 8},
    "sequence": {"min": 1, "opt": 64, "max": 256},
    "past_sequence": {"min": 0, "opt": 64, "max": 512},
    "total_sequence": {"min": 1, "opt": 128, "max": 768},
}


def profile(**kw) -> Profile:
    return Profile.model_validate({"name": "default", **kw})


def test_dims_resolve_per_input_and_static_axes_stay():
    [res] = resolve_profiles([profile(dims=LLM_DIMS)], LLM_INPUTS)
    assert res.name == "default"
    assert res.shapes["input_ids"] == {"min": [1, 1], "opt": [4, 64], "max": [8, 256]}
    assert res.shapes["attention_mask"] == {"min": [1, 1], "opt": [4, 128], "max": [8, 768]}
    assert res.shapes["past_key_values.0.key"] == {
        "min": [1, 3, 0, 64],
        "opt": [4, 3, 64, 64],
        "max": [8, 3, 512, 64],
    }
    assert res.dims["past_sequence"] == {"min": 0, "opt": 64, "max": 512}


def test_explicit_shape_overrides_dims_for_that_input():
    explicit = {"min": [1, 5], "opt": [2, 5], "max": [4, 5]}
    inputs = [TensorSpec("a", "float32", ["batch", 5]), TensorSpec("b", "float32", ["batch"])]
    [res] = resolve_profiles([profile(dims={"batch": {"min": 1, "opt": 2, "max": 8}}, inputs={"a": explicit})], inputs)
    assert res.shapes["a"] == explicit
    assert res.shapes["b"] == {"min": [1], "opt": [2], "max": [8]}


def test_several_profiles_resolve_in_order():
    decode = profile(name="decode", dims={**LLM_DIMS, "sequence": {"min": 1, "opt": 1, "max": 1}})
    out = resolve_profiles([profile(dims=LLM_DIMS), decode], LLM_INPUTS)
    assert [p.name for p in out] == ["default", "decode"]
    assert out[1].shapes["input_ids"]["max"] == [8, 1]


def test_unknown_input_lists_graph_inputs():
    bad = profile(dims=LLM_DIMS, inputs={"input_id": {"min": [1, 1], "opt": [1, 1], "max": [1, 1]}})
    with pytest.raises(ProfileError) as e:
        resolve_profiles([bad], LLM_INPUTS)
    msg = str(e.value)
    assert "'default'" in msg and "'input_id'" in msg
    assert "['input_ids', 'attention_mask', 'past_key_values.0.key']" in msg


def test_uncovered_dynamic_axis_names_profile_input_axis_and_dim():
    dims = {k: v for k, v in LLM_DIMS.items() if k != "past_sequence"}
    with pytest.raises(ProfileError) as e:
        resolve_profiles([profile(dims=dims)], LLM_INPUTS)
    msg = str(e.value)
    assert "'default'" in msg and "'past_key_values.0.key'" in msg and "axis 2" in msg
    assert "'past_sequence'" in msg and "dims.past_sequence" in msg


def test_explicit_shape_with_wrong_rank():
    bad = profile(dims=LLM_DIMS, inputs={"input_ids": {"min": [1], "opt": [1], "max": [1]}})
    with pytest.raises(ProfileError, match=r"inputs\['input_ids'\]: shape has rank 1 .* has rank 2"):
        resolve_profiles([bad], LLM_INPUTS)


def test_explicit_shape_contradicting_static_dim():
    rng = {"min": [1, 3, 0, 32], "opt": [1, 3, 8, 64], "max": [1, 3, 16, 64]}
    bad = profile(dims=LLM_DIMS, inputs={"past_key_values.0.key": rng})
    with pytest.raises(ProfileError) as e:
        resolve_profiles([bad], LLM_INPUTS)
    msg = str(e.value)
    assert "'past_key_values.0.key'" in msg and "axis 3" in msg
    assert "32/64/64" in msg and "static size 64" in msg


def test_unused_dims_key_is_named():
    dims = {**LLM_DIMS, "beams": {"min": 1, "opt": 1, "max": 4}}
    with pytest.raises(ProfileError) as e:
        resolve_profiles([profile(dims=dims)], LLM_INPUTS)
    msg = str(e.value)
    assert "'beams'" in msg
    assert "['batch', 'past_sequence', 'sequence', 'total_sequence']" in msg


def test_dims_key_shadowed_by_explicit_shapes_has_no_effect():
    inputs = [TensorSpec("x", "float32", ["n", 4])]
    bad = profile(dims={"n": {"min": 1, "opt": 2, "max": 3}}, inputs={"x": {"min": [1, 4], "opt": [1, 4], "max": [2, 4]}})
    with pytest.raises(ProfileError, match=r"'n' has no effect.*\['x'\]"):
        resolve_profiles([bad], inputs)


def test_unnamed_dynamic_axis_needs_explicit_shape():
    inputs = [TensorSpec("x", "float32", [0, 4])]
    with pytest.raises(ProfileError, match=r"'x' \[0, 4\] axis 0 has neither a static size nor a symbolic name"):
        resolve_profiles([profile()], inputs)
    [res] = resolve_profiles([profile(inputs={"x": {"min": [1, 4], "opt": [2, 4], "max": [3, 4]}})], inputs)
    assert res.shapes["x"]["max"] == [3, 4]


def test_shape_tensor_input_needs_value_ranges():
    inputs = [TensorSpec("x", "float32", ["n"]), TensorSpec("new_shape", "int64", [2])]
    ok_shapes = {"min": [2], "opt": [2], "max": [2]}
    prof = profile(dims={"n": {"min": 1, "opt": 4, "max": 8}}, inputs={"new_shape": ok_shapes})
    with pytest.raises(ProfileError) as e:
        resolve_profiles([prof], inputs, shape_tensors={"new_shape"})
    msg = str(e.value)
    assert "'new_shape'" in msg and "shape tensor" in msg
    assert "setShapeValues" in msg and "not support" in msg


# --- shape_tensor_inputs ------------------------------------------------------------------


def _model(nodes, inputs, inits=()):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=list(inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shape_tensor_via_cast_unsqueeze_concat():
    nodes = [
        helper.make_node("Cast", ["n"], ["n64"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["n64", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus_one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
    ]
    model = _model(nodes, [("x", TensorProto.FLOAT, ["a"]), ("n", TensorProto.INT32, [])], inits)
    assert shape_tensor_inputs(model) == ["n"]


def test_direct_shape_operands_and_shape_op_stops_the_walk():
    nodes = [
        helper.make_node("Shape", ["x"], ["xs"]),
        helper.make_node("Expand", ["x", "xs"], ["e"]),
        helper.make_node("Tile", ["e", "reps"], ["t"]),
        helper.make_node("TopK", ["t", "k"], ["y", "idx"], axis=-1),
    ]
    model = _model(
        nodes,
        [("x", TensorProto.FLOAT, ["a"]), ("reps", TensorProto.INT64, [1]), ("k", TensorProto.INT64, [1])],
    )
    assert shape_tensor_inputs(model) == ["reps", "k"]


def test_plain_llm_inputs_are_not_shape_tensors():
    nodes = [
        helper.make_node("Shape", ["attention_mask"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["ones"]),
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["m", "ones"], ["y"]),
    ]
    model = _model(nodes, [("attention_mask", TensorProto.INT64, ["batch", "total_sequence"])])
    assert shape_tensor_inputs(model) == []


# --- sample_shapes ------------------------------------------------------------------------


def test_three_samples_are_min_opt_max_and_keep_the_kv_relation():
    [res] = resolve_profiles([profile(dims=LLM_DIMS)], LLM_INPUTS)
    points = sample_shapes(res)
    assert [p["input_ids"] for p in points] == [[1, 1], [4, 64], [8, 256]]
    assert [p["past_key_values.0.key"] for p in points] == [[1, 3, 0, 64], [4, 3, 64, 64], [8, 3, 512, 64]]
    for p in points:  # the recipe ranges satisfy total = past + sequence at min/opt/max
        assert p["attention_mask"][1] == p["past_key_values.0.key"][2] + p["input_ids"][1]


def test_more_samples_interpolate_per_dim_consistently():
    [res] = resolve_profiles([profile(dims=LLM_DIMS)], LLM_INPUTS)
    points = sample_shapes(res, n=5)
    assert [p["input_ids"] for p in points] == [[1, 1], [3, 33], [4, 64], [6, 160], [8, 256]]
    assert [p["attention_mask"][1] for p in points] == [1, 65, 128, 448, 768]
    for p in points:
        batch = {p["input_ids"][0], p["attention_mask"][0], p["past_key_values.0.key"][0]}
        assert len(batch) == 1  # one dim name, one size at every point
        assert p["past_key_values.0.key"][1::2] == [3, 64]  # static axes fixed


def test_one_sample_is_opt_two_are_min_and_max():
    [res] = resolve_profiles([profile(dims=LLM_DIMS)], LLM_INPUTS)
    assert sample_shapes(res, n=1) == [{k: v["opt"] for k, v in res.shapes.items()}]
    assert sample_shapes(res, n=2) == [{k: v[e] for k, v in res.shapes.items()} for e in ("min", "max")]
    with pytest.raises(ValueError):
        sample_shapes(res, n=0)


def test_explicit_axes_interpolate_too():
    inputs = [TensorSpec("x", "float32", ["n", 4])]
    [res] = resolve_profiles([profile(inputs={"x": {"min": [2, 4], "opt": [4, 4], "max": [10, 4]}})], inputs)
    assert [p["x"] for p in sample_shapes(res, n=5)] == [[2, 4], [3, 4], [4, 4], [7, 4], [10, 4]]
