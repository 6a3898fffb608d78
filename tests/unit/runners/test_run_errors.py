"""An ONNX Runtime error in a later stage (calibration, validate, serve check) is reported with the
stage, the graph, the node ONNX Runtime named and the inputs' shapes: exit 2 for the user's
exported graph, 3 for a graph the pipeline made; never a bare onnxruntime traceback."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.runners.base import OrtRunner, SessionView
from pipeline.ort_sessions import OrtRunError

TABLE = 5


def gather_graph(path) -> str:
    """``ids`` int64 ``[batch, sequence]`` -> ``out`` float32 ``[batch, sequence, 2]``: a Gather
    named ``embed/Gather`` into a 5-row table (ids >= 5 fail in ONNX Runtime)."""
    table = numpy_helper.from_array(np.arange(TABLE * 2, dtype=np.float32).reshape(TABLE, 2), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["out"], name="embed/Gather")], "g",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "sequence"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return str(path)


@pytest.mark.parametrize("user_graph, code", [(True, 2), (False, 3)])
def test_a_runner_names_the_node_and_the_input_shapes(tmp_path, user_graph, code):
    runner = OrtRunner(gather_graph(tmp_path / "model.onnx"), name="fp32 (onnxruntime)", user_graph=user_graph)
    assert runner.run({"ids": np.array([[1, 4]])})["out"].shape == (1, 2, 2)
    bad = {"ids": np.array([[1, 2, 3], [4, 9, 0]])}
    for call in (lambda: runner.run(bad), lambda: SessionView(runner).run(["out"], bad)):
        with pytest.raises(OrtRunError) as e:
            call()
        assert e.value.exit_code == code and e.value.node == ("embed/Gather", "Gather")
        assert "ids int64 [2, 3]" in str(e.value) and "out of data bounds" in str(e.value)
        assert ("add a check point of these shapes" in str(e.value)) is user_graph
        assert ("this is a bug" in str(e.value)) is not user_graph


def test_calibration_names_the_batch_that_failed(tmp_path):
    from pipeline.quant.calibrate import collect_amax
    from pipeline.quant.qdq import FORMATS

    path = gather_graph(tmp_path / "model.onnx")
    batches = [{"ids": np.zeros((2, 3), np.int64)}, {"ids": np.full((4, 7), TABLE, np.int64)}]
    with pytest.raises(OrtRunError, match=r"calibration copy of .*model.onnx at node 'embed/Gather' \(Gather\) on "
                                          r"inputs ids int64 \[4, 7\]") as e:
        collect_amax(path, ["out"], batches, "max", FORMATS["int8"])
    assert e.value.exit_code == 2


def test_the_stage_is_named_and_a_bare_onnxruntime_error_is_exit_3(tmp_path):
    from pipeline.run.runner import _named_ort_error
    from pipeline.ort_sessions import ort_session

    sess = ort_session(gather_graph(tmp_path / "model.onnx"))
    with pytest.raises(Exception) as bare:
        sess.run(None, {"ids": np.full((1, 2), 7, np.int64)})
    err = _named_ort_error(bare.value, "validate")
    assert isinstance(err, OrtRunError) and err.exit_code == 3
    assert str(err).startswith("validate: ONNX Runtime failed running a graph at node 'embed/Gather' (Gather)")
    named = OrtRunError(bare.value, "model.onnx", {"ids": np.zeros((1, 2), np.int64)}, user_graph=True)
    assert _named_ort_error(named, "quantize") is named and str(named).startswith("quantize: ")
    plain = ValueError("x")
    assert _named_ort_error(plain, "validate") is plain
