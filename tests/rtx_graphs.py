"""Small ONNX graphs for real TensorRT-RTX builds (tests/unit/trt/test_builder_rtx.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.artifacts import TensorSpec

QDQ_INPUTS = [TensorSpec("x", "float32", ["batch", "sequence", 16])]


def rtx_backend():
    """TensorRT-RTX's backend, or skip the test naming why its Python package cannot be used here
    (not installed, or only its type stubs): the README's install provides it."""
    import pytest

    from pipeline.trt import backends as engine_backends

    problem = engine_backends.import_problem(engine_backends.TENSORRT_RTX)
    if problem is not None:
        pytest.skip(problem)
    return engine_backends.TENSORRT_RTX


def _qdq(name: str, source: str, scale: str, zero: str) -> list[onnx.NodeProto]:
    """Q then DQ of ``source``, named as the quantize stage names them (pipeline.quant.qdq)."""
    return [helper.make_node("QuantizeLinear", [source, scale, zero], [f"{name}_q"], name=f"{name}_QuantizeLinear"),
            helper.make_node("DequantizeLinear", [f"{name}_q", scale, zero], [f"{name}_dq"],
                             name=f"{name}_DequantizeLinear")]


def write_qdq_matmuls(path: Path, *, quantize_second: bool = True) -> str:
    """x [batch, sequence, 16] -> INT8 Q/DQ MatMul "mm1" (16 -> 8) -> Relu -> MatMul "mm2" (8 -> 4),
    whose operands are Q/DQ'd only when ``quantize_second``. Returns the path."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z")]
    nodes = [*_qdq("x", "x", "s", "z"), *_qdq("w1", "w1", "s", "z"),
             helper.make_node("MatMul", ["x_dq", "w1_dq"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu")]
    if quantize_second:
        nodes += [*_qdq("r", "r", "s", "z"), *_qdq("w2", "w2", "s", "z"),
                  helper.make_node("MatMul", ["r_dq", "w2_dq"], ["y"], name="mm2")]
    else:
        nodes.append(helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"))
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", 4])], inits)
    return _save(graph, path)


def write_unbuildable(path: Path, cast_name: str = "to_string") -> str:
    """x [batch, 16] float -> Cast to STRING (``cast_name``) -> Cast back: valid ONNX that
    TensorRT's parser refuses (no STRING type). Returns the path."""
    nodes = [helper.make_node("Cast", ["x"], ["xs"], to=TensorProto.STRING, name=cast_name),
             helper.make_node("Cast", ["xs"], ["y"], to=TensorProto.FLOAT, name="back")]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])])
    return _save(graph, path)


def _save(graph: onnx.GraphProto, path: Path) -> str:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(path))
    return str(path)


def build_one_input(blob: bytes, target: str, *, k: int, input_name: str = "x", summarize: bool = False):
    """Build the serialized ONNX ``blob`` (one FLOAT input ``[batch, sequence, k]``) with TensorRT-RTX
    for ``target`` (e.g. "sm89"), profile min/opt/max ``[1, 1, k]`` / ``[1, 8, k]`` / ``[2, 32, k]``.

    Returns:
        ``(plan bytes or None when the builder refused, the builder's log, the network summary or
        None)``: the summary (:func:`pipeline.trt.report.summarize_network`) only with ``summarize``.

    Raises:
        AssertionError: the ONNX parser refused the graph (its errors).
    """
    from pipeline.trt import backends as engine_backends
    from pipeline.trt import builder as engine_builder
    from pipeline.trt import report as engine_report

    backend = engine_backends.TENSORRT_RTX
    errors: list[str] = []
    with engine_builder.no_collection():  # TensorRT calls the Python logger holding its locks
        logger = engine_builder.make_logger(backend, errors)
        builder = backend.module().Builder(logger)
        net = engine_builder.create_network(backend, builder)
        parser = backend.module().OnnxParser(net, logger)
        assert parser.parse(blob), [str(parser.get_error(i)) for i in range(parser.num_errors)]
        summary = engine_report.summarize_network(net) if summarize else None
        config = builder.create_builder_config()
        engine_backends.set_compute_capabilities(config, [target])
        profile = builder.create_optimization_profile()
        profile.set_shape(input_name, (1, 1, k), (1, 8, k), (2, 32, k))
        config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(net, config)
        del parser, net, config, builder
    return (None if plan is None else plan.nbytes), "\n".join(errors), summary
