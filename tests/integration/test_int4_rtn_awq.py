"""``quantize.weights.method: rtn`` and ``awq`` through the quantize stage on the tiny random Llama
(GQA, hidden 32, no GGUF blocks): INT4 blocks every GEMM, INT8 blocks the tied lm_head, ONNX
Runtime runs the result; AWQ's block output error is at most RTN's; a block size that does not
divide K is refused (exit 2) naming the GEMM and K, with nothing written."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from pipeline.errors import EXIT_BAD_INPUT, QuantizationError
from pipeline.models.text_generation.model import prefill_feeds
from pipeline.ort_sessions import ort_session
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from tiny import seed_export, tiny_recipe

#: tiny-model quantize runs (awq searches every fold point) and a TensorRT-RTX build: over a minute on 2 cores
pytestmark = pytest.mark.e2e


def _int4_recipe(ws, tiny_model, method: str, block: int = 32, pad: bool = False):
    weights = {"method": method, "block_size": block, **({"pad": True} if pad else {})}
    changes = {"quantize.precision": "int4", "quantize.weights": weights,
               "quantize.exclude": {"nodes": []}, "triton.target": "python-onnxruntime"}
    path = tiny_recipe(ws, tiny_model, **changes)
    if method != "awq":
        import yaml

        data = yaml.safe_load(path.read_text())
        data["quantize"].pop("calibration")
        path.write_text(yaml.safe_dump(data))
    return path


def _quantize(tmp_path_factory, tiny_model, tiny_export, method: str, block: int = 32, pad: bool = False):
    ws = tmp_path_factory.mktemp(f"int4-{method}")
    path = _int4_recipe(ws, tiny_model, method, block, pad)
    seed_export(ws, tiny_export)
    result = run_pipeline(load_recipe(path), path, quiet=True, only=["export", "quantize"])
    return result.artifacts["export"], result.artifacts["quantize"], ws


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model, tiny_export):
    return {m: _quantize(tmp_path_factory, tiny_model, tiny_export, m) for m in ("rtn", "awq")}


def _logits(path, feeds):
    return ort_session(str(path)).run(["logits"], feeds)[0]


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_every_gemm_is_an_int4_block(runs, method):
    exp, art, _ = runs[method]
    model = onnx.load(art.onnx_path)
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    inits = {t.name: t for t in model.graph.initializer}
    types = Counter((inits[n.input[0]].data_type, next(a.i for a in n.attribute if a.name == "block_size")) for n in dq)
    # 2 blocks x 7 projections as INT4 blocks of 32, and the tied lm_head as INT8 blocks of 32
    assert types == {(onnx.TensorProto.INT4, 32): 14, (onnx.TensorProto.INT8, 32): 1}
    assert all(len(n.input) == 2 for n in dq)  # no zero point
    assert all((onnx.numpy_helper.to_array(inits[n.input[1]]) > 0).all() for n in dq)
    assert art.calibration["gemm_formats"] == {"INT4 block 32": 14, "INT8 block 32": 1}
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 21
    feeds = prefill_feeds(exp, np.random.default_rng(2).integers(0, 1000, size=(2, 11)))
    ref, got = _logits(exp.onnx_path, feeds), _logits(art.onnx_path, feeds)
    assert np.isfinite(got).all() and 0 < np.abs(got - ref).max() < 0.5 * np.abs(ref).max()


def test_awq_block_output_error_is_at_most_rtn(runs):
    info = runs["awq"][1].calibration["awq"]
    points = info["fold_points"]
    assert Counter(p["kind"] for p in points.values()) == {"norm": 4, "linear": 2, "attention": 2}
    assert all(p["loss"] <= p["baseline"] for p in points.values())
    assert info["block_output_error"] <= info["block_output_error_rtn"]
    assert info["scaled_points"] >= 1 and info["block_output_error"] < info["block_output_error_rtn"]
    assert info["equivalence_max_relative_difference"] <= 1e-4
    # the clip search on top never raises the (per-block) error of the scaled weights
    assert info["block_output_error_clipped"] <= info["block_output_error"] * 1.001
    assert info["blocks"] == 2 * (32 + 16 + 16 + 32 + 64 + 64 + 32 * 2)  # N x K/32 of the 14 GEMMs
    # each phase's wall time is recorded (benchmarks/scale.py reads it); no value asserted
    assert set(info["seconds"]) == {"reference_outputs", "activation_rows", "scale_search", "clip_search",
                                    "fold_and_check"}
    assert all(v >= 0 for v in info["seconds"].values())
    # rtn has no search and no calibration
    assert "awq" not in runs["rtn"][1].calibration and runs["rtn"][1].calibration["method"] == "rtn"


def test_block_not_dividing_k_is_refused(tmp_path_factory, tiny_model, tiny_export):
    with pytest.raises(QuantizationError) as err:  # hidden 32: block 64 does not divide q_proj's K
        _quantize(tmp_path_factory, tiny_model, tiny_export, "rtn", block=64)
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert "block_size 64 does not divide the input dimension K" in str(err.value) and "(K = 32)" in str(err.value)
    assert "quantize.weights.pad: true" in str(err.value)


@pytest.fixture(scope="module")
def padded(tmp_path_factory, tiny_model, tiny_export):
    """awq at block 64 with ``pad``: hidden 32, so q/k/v, o and gate/up (K = 32) are padded to 64; down (K = 64) is not."""
    return _quantize(tmp_path_factory, tiny_model, tiny_export, "awq", block=64, pad=True)


def test_padded_awq_graph_pads_each_activation_once_and_runs(padded):
    exp, art, _ = padded
    model = onnx.load(art.onnx_path)
    pads = [n for n in model.graph.node if n.op_type == "Pad"]
    assert len(pads) == 2 * 3 and len({n.input[0] for n in pads}) == 6  # per layer: q/k/v, o, gate/up
    assert art.calibration["gemm_formats"] == {"INT4 block 64": 14, "INT8 block 32": 1}
    assert art.calibration["padding"] == {"gemms": 12, "rows_added": 12 * 32,
                                          "bytes_added": 2 * 32 * (32 + 16 + 16 + 32 + 64 + 64) // 2,
                                          "int4_value_bytes": 2 * 64 * (32 + 16 + 16 + 32 + 64 + 64 + 32) // 2}
    assert art.calibration["awq"]["blocks"] == 2 * (32 + 16 + 16 + 32 + 64 + 64 + 32)  # N x K'/64
    feeds = prefill_feeds(exp, np.random.default_rng(2).integers(0, 1000, size=(2, 11)))
    ref, got = _logits(exp.onnx_path, feeds), _logits(art.onnx_path, feeds)
    assert np.isfinite(got).all() and 0 < np.abs(got - ref).max() < 0.5 * np.abs(ref).max()


@pytest.mark.parametrize("which", ["awq", "awq padded"])
def test_onnx_runtime_fuses_every_gemm_at_accuracy_level_1(runs, padded, which, tmp_path):
    """validate's session: each INT4 / INT8 block GEMM of the awq graph (and of the zero-padded one,
    its MatMuls reading Pad outputs) is a MatMulNBits at accuracy level 1 (FP32 activations), no INT4
    DequantizeLinear left unfused."""
    from pipeline import ort_sessions

    _, art, _ = padded if which == "awq padded" else runs["awq"]
    assert ort_sessions.optimization_level(art.onnx_path) == "all"
    opts = ort_sessions.session_options("all", config=ort_sessions.session_config(art.onnx_path))
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort_sessions.session_from(art.onnx_path, art.onnx_path, opts)
    optimized = onnx.load(opts.optimized_model_filepath)
    nbits = [{a.name: a.i for a in n.attribute} for n in optimized.graph.node if n.op_type == "MatMulNBits"]
    assert sorted(a["bits"] for a in nbits) == [4] * 14 + [8] and all(a.get("accuracy_level") == 1 for a in nbits)
    inits = {t.name: t.data_type for t in optimized.graph.initializer}
    assert not [n.name for n in optimized.graph.node
                if n.op_type == "DequantizeLinear" and inits.get(n.input[0]) == onnx.TensorProto.INT4]


@pytest.mark.parametrize("which", ["awq", "awq padded"])
def test_tensorrt_rtx_builds_the_awq_graph(runs, padded, which, tmp_path):
    import rtx_graphs

    from pipeline.stages import build

    rtx_graphs.rtx_backend()  # or skip, naming why TensorRT-RTX cannot be used here
    exp, art, ws = padded if which == "awq padded" else runs["awq"]
    r = load_recipe(ws / "tiny-llm.yaml", {"build.backend": "tensorrt-rtx", "build.targets": ["sm89"]})
    b = build.build_from_onnx(r, art.onnx_path, exp.inputs, tmp_path / "build", quantized_nodes=art.quantized_nodes,
                              source_onnx=exp.onnx_path)
    assert (b.status, b.reason) == ("ok", ""), b.reason
