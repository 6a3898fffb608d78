"""``build.embedding_lookup: runtime`` (pipeline.trt.embedding): the embedding Gather leaves the graph
TensorRT builds, which takes ``inputs_embeds`` instead of the token ids, and the table is written
beside it. Equivalence is checked with ONNX Runtime: the cut graph fed ``table[ids]`` (decoded from
the written file) gives bit for bit what the whole graph gives for ``ids``. Under a second."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from safetensors.numpy import load_file

from pipeline.errors import EXIT_BAD_INPUT
from pipeline.trt import embedding
from pipeline.trt.builder import EngineBuildError

V, H, BLOCK = 40, 64, 32
IDS = np.array([[0, 5, 39], [1, 2, 3]], np.int64)


def tied_int8(ids_readers: tuple[str, ...] = ("Shape",), emb_output: bool = True) -> onnx.ModelProto:
    """The int4 engine graph's form (int4.share_tied_table): INT8 blocks ``[H, V]`` (axis 0, block 32)
    read by the lm_head MatMul and, through a Transpose, by the embedding Gather; a Shape of the ids
    (as the export computes positions); the embedding also a graph output."""
    rng = np.random.default_rng(3)
    values = rng.integers(-127, 128, (H, V), dtype=np.int8)
    scales = rng.uniform(0.001, 0.01, (H // BLOCK, V)).astype(np.float32)
    nodes = [
        helper.make_node("DequantizeLinear", ["values", "scales"], ["w"], name="lm_head/DequantizeLinear", axis=0,
                         block_size=BLOCK),
        helper.make_node("Transpose", ["w"], ["w_vh"], name="table_T", perm=[1, 0]),
        helper.make_node("Gather", ["w_vh", "ids"], ["emb"], name="embed", axis=0),
        helper.make_node("Mul", ["emb", "two"], ["h"], name="body"),
        helper.make_node("MatMul", ["h", "w"], ["logits"], name="lm_head"),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", V])]
    if "Shape" in ids_readers:
        nodes.append(helper.make_node("Shape", ["ids"], ["seq"], name="seq_len", start=-1))
        outputs.append(helper.make_tensor_value_info("seq", TensorProto.INT64, [1]))
    if "Cast" in ids_readers:
        nodes.append(helper.make_node("Cast", ["ids"], ["ids_f"], name="ids_as_float", to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("ids_f", TensorProto.FLOAT, ["b", "s"]))
    if emb_output:
        outputs.append(helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "s", H]))
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])], outputs,
        [numpy_helper.from_array(values, "values"), numpy_helper.from_array(scales, "scales"),
         numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def plain_table(dtype=np.float32, cast: bool = False) -> onnx.ModelProto:
    """A Gather of an initializer table (or of a Cast of one) by ``ids``."""
    table = np.random.default_rng(4).standard_normal((V, H)).astype(dtype)
    nodes = [helper.make_node("Cast", ["table"], ["table_f"], name="to_float", to=TensorProto.FLOAT)] if cast else []
    nodes.append(helper.make_node("Gather", ["table_f" if cast else "table", "ids"], ["emb"], name="embed"))
    nodes.append(helper.make_node("ReduceSum", ["emb", "axis1"], ["out"], name="pool", keepdims=0))
    out_type = TensorProto.FLOAT if cast else helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "plain", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("out", out_type, ["b", H])],
                              [numpy_helper.from_array(table, "table"),
                               numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def run(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Every output, at level basic: at ``all`` the cut graph's DequantizeLinear (one reader left) would
    fuse into a MatMulNBits that computes otherwise than the whole graph's unfused one."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def cut_and_compare(model: onnx.ModelProto, tmp_path) -> tuple[onnx.ModelProto, embedding.EmbeddingCut, dict]:
    """Cut a copy of ``model``, write its table, and check every output against the whole graph's."""
    whole = run(model, {"ids": IDS})
    cut = onnx.ModelProto()
    cut.CopyFrom(model)
    found = embedding.cut(cut)
    onnx.checker.check_model(cut, full_check=True)
    record = embedding.write_table(found, tmp_path)
    on_disk = load_file(str(tmp_path / embedding.TABLE_FILE))
    assert set(on_disk) == set(found.tensors) and all(np.array_equal(on_disk[k], found.tensors[k]) for k in on_disk)
    rows = found.decoded()[IDS]
    outputs = run(cut, {embedding.INPUT: rows})
    assert set(outputs) == set(whole)
    for name, value in whole.items():
        assert np.array_equal(outputs[name], value), name
    return cut, found, record


def test_the_tied_int8_table_leaves_the_engine_graph_and_is_written_as_blocks(tmp_path):
    cut, found, record = cut_and_compare(tied_int8(), tmp_path)
    assert (found.ids_input, found.gather, found.form, found.dtype, found.vocab, found.hidden, found.block_size) == (
        "ids", "embed", "int8_blocks", "float32", V, H, BLOCK)
    assert found.tensors["values"].dtype == np.int8 and found.tensors["values"].shape == (V, H)
    assert found.tensors["scales"].dtype == np.float32 and found.tensors["scales"].shape == (V, H // BLOCK)
    assert found.nbytes == V * H + 4 * V * H // BLOCK
    # the engine input takes the ids' place, with the hidden size added; the ids are gone
    first = cut.graph.input[0]
    assert first.name == "inputs_embeds" and [d.dim_param or d.dim_value for d in first.type.tensor_type.shape.dim] \
        == ["b", "s", H]
    assert [i.name for i in cut.graph.input] == ["inputs_embeds"]
    # one reader of the INT8 blocks is left (the lm_head): the Transpose went with the Gather
    ops = [n.op_type for n in cut.graph.node]
    assert "Gather" not in ops and "Transpose" not in ops and ops.count("DequantizeLinear") == 1
    dq = next(n for n in cut.graph.node if n.op_type == "DequantizeLinear")
    assert [n.op_type for n in cut.graph.node if dq.output[0] in n.input] == ["MatMul"]
    # the Shape of the ids reads the same (non-negative) axes of inputs_embeds
    shape = next(n for n in cut.graph.node if n.op_type == "Shape")
    assert list(shape.input) == ["inputs_embeds"] and {a.name: a.i for a in shape.attribute} == {"start": 1, "end": 2}
    assert record["bytes"] == (tmp_path / embedding.TABLE_FILE).stat().st_size and len(record["sha256"]) == 64
    assert record["tensors"] == {"values": {"dtype": "int8", "shape": [V, H]},
                                 "scales": {"dtype": "float32", "shape": [V, H // BLOCK]}}
    assert (record["form"], record["block_size"], record["replaces"], record["engine_input"]) == (
        "int8_blocks", str(BLOCK), "ids", "inputs_embeds")


@pytest.mark.parametrize("dtype,cast", [(np.float32, False), (np.float16, False), (np.float16, True)])
def test_a_plain_table_is_written_as_it_was_read(tmp_path, dtype, cast):
    _, found, record = cut_and_compare(plain_table(dtype, cast), tmp_path)
    assert found.form == "table" and found.dtype == ("float32" if cast else np.dtype(dtype).name)
    assert record["tensors"] == {"weight": {"dtype": found.dtype, "shape": [V, H]}}


def refusal(model: onnx.ModelProto) -> str:
    before = model.SerializeToString()
    with pytest.raises(EngineBuildError) as err:
        embedding.cut(model)
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert model.SerializeToString() == before  # nothing changed
    return str(err.value)


def test_another_reader_of_the_ids_is_refused_by_name():
    assert "ids is read by ids_as_float (Cast)" in refusal(tied_int8(ids_readers=("Shape", "Cast")))


def test_a_graph_without_an_embedding_gather_is_refused():
    model = plain_table()
    model.graph.node[0].input[0] = "ids_table"  # the Gather's table becomes a graph input: not a constant
    model.graph.input.append(helper.make_tensor_value_info("ids_table", TensorProto.FLOAT, [V, H]))
    assert "found none" in refusal(model)


def test_int4_blocks_are_refused_naming_the_type():
    model = tied_int8()
    values = next(t for t in model.graph.initializer if t.name == "values")
    packed = numpy_helper.from_array(np.zeros((H, V), np.int8), "values")
    packed.data_type = TensorProto.INT4
    packed.ClearField("raw_data")
    packed.int32_data.extend([0] * (H * V // 2))
    values.CopyFrom(packed)
    assert "is INT4 blocks (values)" in refusal(model)


def test_a_tensor_already_named_inputs_embeds_is_refused():
    model = tied_int8()
    model.graph.node[3].output[0] = "inputs_embeds"
    model.graph.node[4].input[0] = "inputs_embeds"
    assert "already has a tensor named inputs_embeds" in refusal(model)


def with_attribute(model: onnx.ModelProto, node: str, **attrs) -> onnx.ModelProto:
    n = next(n for n in model.graph.node if n.name == node)
    kept = [a for a in n.attribute if a.name not in attrs]
    del n.attribute[:]
    n.attribute.extend(kept + [helper.make_attribute(k, v) for k, v in attrs.items()])
    return model


@pytest.mark.parametrize("node,attrs", [("embed", {"axis": -2}), ("lm_head/DequantizeLinear", {"axis": -2})])
def test_negative_axes_count_from_the_end(tmp_path, node, attrs):
    """A Gather along axis -2 of the [V, H] table is along 0; a DequantizeLinear along -2 of [H, V] along 0."""
    _, found, _ = cut_and_compare(with_attribute(tied_int8(), node, **attrs), tmp_path)
    assert (found.form, found.block_size, found.tensors["scales"].shape) == ("int8_blocks", BLOCK, (V, H // BLOCK))


def if_reading(model: onnx.ModelProto, name: str, elem_type: int) -> onnx.ModelProto:
    """``model`` plus an If whose branches sum the outer-scope tensor ``name`` (a graph output)."""
    branch = helper.make_graph([helper.make_node("ReduceSum", [name], ["sum"], name="sum", keepdims=0)], "branch", [],
                               [helper.make_tensor_value_info("sum", elem_type, [])])
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    model.graph.node.append(helper.make_node("If", ["cond"], ["total"], name="branch", then_branch=branch,
                                             else_branch=branch))
    model.graph.output.append(helper.make_tensor_value_info("total", elem_type, []))
    return model


@pytest.mark.parametrize("make,read", [(tied_int8, "w_vh"), (plain_table, "table")])
def test_what_a_subgraph_reads_of_the_table_stays(tmp_path, make, read):
    """An If branch reading the table (or the Transpose feeding the Gather) by its outer-scope name."""
    cut, _, _ = cut_and_compare(if_reading(make(), read, TensorProto.FLOAT), tmp_path)
    assert read in {o for n in cut.graph.node for o in n.output} | {t.name for t in cut.graph.initializer}


def test_an_initializer_also_listed_as_an_input_leaves_both_lists(tmp_path):
    """Older exports list initializers among the inputs too: the dropped table must not stay an input."""
    model = plain_table()
    model.graph.input.append(helper.make_tensor_value_info("table", TensorProto.FLOAT, [V, H]))
    cut, _, _ = cut_and_compare(model, tmp_path)
    assert [i.name for i in cut.graph.input] == ["inputs_embeds"]


def test_a_dim_without_name_or_size_stays_so(tmp_path):
    model = tied_int8()
    model.graph.input[0].type.tensor_type.shape.dim[0].Clear()
    cut, _, _ = cut_and_compare(model, tmp_path)
    first = cut.graph.input[0].type.tensor_type.shape.dim
    assert not first[0].HasField("dim_value") and not first[0].HasField("dim_param") and first[2].dim_value == H


def shape_below_opset_15() -> onnx.ModelProto:
    model = plain_table()
    model.graph.node.append(helper.make_node("Shape", ["ids"], ["ids_shape"], name="ids_shape"))
    model.graph.output.append(helper.make_tensor_value_info("ids_shape", TensorProto.INT64, [2]))
    model.opset_import[0].version = 13
    return model


def zero_point_computed() -> onnx.ModelProto:
    model = tied_int8()
    model.graph.node[0].input.append("zero_point")
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((H // BLOCK, V), np.int32), "zero_point32"))
    model.graph.node.insert(0, helper.make_node("Cast", ["zero_point32"], ["zero_point"], name="zp_cast",
                                                to=TensorProto.INT8))
    return model


def ids_without_shape() -> onnx.ModelProto:
    model = tied_int8(ids_readers=())
    model.graph.input[0].type.tensor_type.ClearField("shape")
    return model


def ids_as_output() -> onnx.ModelProto:
    model = tied_int8()
    model.graph.output.append(helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"]))
    return model


@pytest.mark.parametrize("make,message", [
    (lambda: if_reading(tied_int8(), "ids", TensorProto.INT64), "ids is read by branch (If) besides"),
    (ids_as_output, "ids is read by the graph output ids besides"),
    (ids_without_shape, "the graph input ids has no shape"),
    (shape_below_opset_15, "ids_shape (Shape) reads ids; reading the same axes of inputs_embeds needs Shape's "
                           "start / end, opset 15 or later (the graph's is 13)"),
    (zero_point_computed, "comes from DequantizeLinear lm_head/DequantizeLinear (an input not an initializer)"),
    (lambda: with_attribute(tied_int8(), "lm_head/DequantizeLinear", block_size=48),
     "not blocked along the hidden axis in whole blocks (block_size 48, axis 1 of the [vocab, hidden] table [40, 64])"),
], ids=["subgraph reads ids", "ids a graph output", "ids without shape", "Shape below opset 15",
        "zero point computed", "block not dividing hidden"])
def test_graphs_the_cut_would_break_are_refused_by_name(make, message):
    """Each of these graphs is valid ONNX (ONNX Runtime runs it), but cut as it is it would not be
    (a dangling name, a Shape attribute its opset lacks, a scale per partial block)."""
    model = make()
    run(model, {"ids": IDS})
    assert message in refusal(model)
