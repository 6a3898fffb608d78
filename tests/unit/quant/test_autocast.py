"""Quantize.rest_precision writes FP16/BF16 into the graph for everything but
the Q/DQ GEMMs, the sensitive ops and the I/O; FP16 runs in ONNX Runtime close to FP32."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from pipeline.models.text_generation.model import prefill_feeds
from pipeline.quant.autocast import cast_rest, qdq_gemms, to_bf16
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.ort_sessions import ort_session
from tiny import seed_export, tiny_recipe

#: a tiny-model FP8 quantize run (~14 s of setup): make test runs it, make test-fast does not
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory, tiny_model, tiny_export):
    ws = tmp_path_factory.mktemp("autocast")
    path = tiny_recipe(ws, tiny_model)
    seed_export(ws, tiny_export)
    result = run_pipeline(load_recipe(path), path, quiet=True)
    return result.artifacts["export"], result.artifacts["quantize"], ws


def test_fp8_with_fp16_rest_runs_in_onnxruntime_close_to_fp32_rest(tiny_fp8):
    exp, q, ws = tiny_fp8
    src = Path(q.onnx_path)
    model = onnx.load(str(src), load_external_data=False)
    gemms = qdq_gemms(model)
    assert gemms  # the tiny model's quantized GEMMs
    half = cast_rest(model, "fp16", base_dir=str(src.parent))
    out = ws / "fp16_rest.onnx"
    onnx.save(half, str(out))
    nodes = {n.name: n for n in half.graph.node}
    producers = {o: n for n in half.graph.node for o in n.output}
    for name in gemms:  # Q/DQ GEMMs untouched: fed straight by DequantizeLinear, no Cast between
        assert any(producers[i].op_type == "DequantizeLinear" for i in nodes[name].input if i in producers)
    assert any(i.data_type == TensorProto.FLOAT16 for i in half.graph.initializer)
    assert any(n.op_type == "Cast" for n in half.graph.node)
    assert {o.name: o.type.tensor_type.elem_type for o in half.graph.output}["logits"] == TensorProto.FLOAT

    ids = np.random.default_rng(0).integers(0, 1000, (2, 16), dtype=np.int64)
    feeds = prefill_feeds(exp, ids)
    ref = ort_session(q.onnx_path).run(["logits"], feeds)[0]
    got = ort_session(str(out)).run(["logits"], feeds)[0]
    assert got.dtype == np.float32 and np.isfinite(got).all()
    assert np.max(np.abs(got - ref)) < 0.02 * max(1.0, float(np.max(np.abs(ref))))
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_bf16_rewrites_every_half_type(tiny_fp8):
    _, q, _ = tiny_fp8
    src = Path(q.onnx_path)
    bf = cast_rest(onnx.load(str(src), load_external_data=False), "bf16", base_dir=str(src.parent))
    assert not any(i.data_type == TensorProto.FLOAT16 for i in bf.graph.initializer)
    assert any(i.data_type == TensorProto.BFLOAT16 for i in bf.graph.initializer)
    assert not any(a.i == TensorProto.FLOAT16 for n in bf.graph.node if n.op_type == "Cast" for a in n.attribute)
    onnx.checker.check_model(bf)


def test_bf16_rounding():
    from onnx import numpy_helper

    values = np.array([1.0, 1.00390625, 3.14159, -2.5e-3], np.float32)
    t = to_bf16  # noqa: F841  (module import check)
    from pipeline.quant.autocast import bf16_tensor

    back = numpy_helper.to_array(bf16_tensor(values, "x")).astype(np.float32)
    np.testing.assert_allclose(back, values, rtol=2 ** -8)
    assert cast_rest(onnx.ModelProto(), "fp32") == onnx.ModelProto()
