"""The quantize stage's weight-only INT4 path (``quantize.weights.method: source``) on a tiny
GGUF file, and what later stages do with its graph: ONNX Runtime runs every rewritten GEMM as a
MatMulNBits at accuracy level 1 (validate and the served python-onnxruntime model alike, same
options, same outputs), and TensorRT-RTX's network report counts them as weight-only GEMMs rather
than as GEMMs left in FP32. A few seconds (the TensorRT-RTX build: about 10 s more).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipeline import ort_sessions
from pipeline.artifacts import ExportArtifact, TensorSpec
from pipeline.context import Progress, StageContext
from pipeline.errors import EXIT_BAD_INPUT
from pipeline.quant import gguf_blocks as gb
from pipeline.quant import int4
from pipeline.recipe.schema import Recipe
from pipeline.stages import quantize

gguf = pytest.importorskip("gguf")
from test_gguf_blocks import HEADS, HEAD_DIM, K, KV_HEADS, VOCAB, llama_like_graph, write_gguf  # noqa: E402

#: what the rewrite gives the llama-like graph (test_gguf_blocks.llama_like_graph)
GEMMS = ["q_mm", "k_mm", "up_mm", "lm_head"]
FORMATS = {"Q4_1 -> INT4 block 32 + offsets": 1, "Q4_0 -> INT4 block 32 + offsets": 1, "Q6_K -> INT8 block 16": 1,
           "Q8_0 -> INT8 block 32": 1}


def int4_recipe(gguf_path: Path, **weights) -> Recipe:
    return Recipe.model_validate({
        "name": "tiny-int4",
        "model": {"kind": "text-generation", "source": {"path": str(gguf_path)}},
        "export": {"dynamic_axes": {"input_ids": {0: "batch", 1: "sequence"}}},
        "quantize": {"precision": "int4", "weights": {"method": "source", **weights}},
        "build": {"profiles": [{"name": "p", "dims": {"b": {"min": 1, "opt": 2, "max": 4},
                                                      "s": {"min": 1, "opt": 3, "max": 8}}}],
                  "targets": ["sm89"], "backend": "tensorrt-rtx"},
        "validate": {"data": {"type": "corpus", "name": "lee_background", "split": {"start": 0, "stop": 10}},
                     "gates": []},
        "triton": {"model_name": "tiny", "max_batch_size": 4, "target": "python-onnxruntime"},
    })


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny GGUF file, the llama-like graph exported from it (external data, as the export stage
    writes), and the quantize stage's artifact of it."""
    root = tmp_path_factory.mktemp("int4")
    path = write_gguf(root / "tiny.gguf")
    (root / "export").mkdir()
    onnx.save(llama_like_graph(gb.open_gguf(path)), str(root / "export" / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)
    exp = ExportArtifact(str(root / "export" / "model.onnx"), [TensorSpec("x", "float32", ["b", "s", K]),
                                                               TensorSpec("ids", "int64", ["b", "s"])], [], "")
    ctx = StageContext(int4_recipe(path), root / "r.yaml", root / "run", "quantize", Progress(quiet=True))
    return root, exp, quantize.run(ctx, exp)


def feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(11).standard_normal((2, 3, K)).astype(np.float32),
            "ids": np.array([[0, 5, 39], [1, 2, 3]], np.int64)}


def test_the_stage_rewrites_every_gguf_gemm_and_records_the_formats(tiny):
    _, exp, art = tiny
    assert (art.precision, art.quantized_nodes, art.excluded_nodes) == ("int4", GEMMS, [])
    info = art.calibration
    assert info["method"] == "source" and info["block_size"] == 32 and info["source"].endswith("tiny.gguf")
    assert info["gemm_formats"] == FORMATS and info["quantized_fraction"] == 1.0
    assert info["row_orders"] == {"llama q/k reverse permutation": 2, "gguf": 2}
    assert art.calibration_feeds_path is None  # nothing calibrated
    assert art.summary.startswith("int4: 4 GEMMs weight-only (1 Q4_1 -> INT4 block 32 + offsets, ")
    model = onnx.load(art.onnx_path)
    onnx.checker.check_model(model, full_check=True)
    assert next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == 21
    assert json.dumps(info, allow_nan=False)  # the stage record is strict JSON


def test_validate_runs_each_rewritten_gemm_as_an_fp32_matmulnbits(tiny, tmp_path):
    """The optimized graph of validate's session (the CPU graph, ``ort_path``): no DequantizeLinear left, every GEMM
    a 4-bit MatMulNBits at accuracy level 1 (the INT8 ones as two INT4 halves: ONNX Runtime has no FP32 kernel for
    8 bits and would dequantize the whole weight on every call)."""
    _, exp, art = tiny
    assert art.ort_path == art.cpu_onnx_path != art.onnx_path  # TensorRT builds the INT8 form
    assert art.calibration["cpu_graph"]["int8_gemms_as_int4_halves"] == ["up_mm", "lm_head"]
    assert ort_sessions.optimization_level(art.ort_path) == "all"  # weight-only blocks are not the +-64 rule's
    assert ort_sessions.session_config(art.ort_path) == ort_sessions.MATMULNBITS_FP32 == dict([int4.ORT_ACCURACY_CONFIG])
    opts = ort_sessions.session_options("all", config=ort_sessions.session_config(art.ort_path))
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort_sessions.session_from(art.ort_path, art.ort_path, opts)
    optimized = onnx.load(opts.optimized_model_filepath)
    ops = Counter(n.op_type for n in optimized.graph.node)
    assert ops["MatMulNBits"] == len(GEMMS) + 2  # q, k; up and lm_head as two halves each
    nbits = {n.name: {a.name: a.i for a in n.attribute} for n in optimized.graph.node if n.op_type == "MatMulNBits"}
    assert [a["bits"] for a in nbits.values()] == [4] * 6
    assert all(a.get("accuracy_level") == 1 for a in nbits.values())
    assert "DequantizeLinear" not in ops  # none left unfused, INT4 or INT8
    inits = {t.name: t.data_type for t in optimized.graph.initializer}
    weight_matmuls = [n.name for n in optimized.graph.node if n.op_type == "MatMul" and n.input[1] in inits
                      and not n.name.endswith("/offset_MatMul")]
    assert weight_matmuls == []  # the offset terms' FP32 MatMuls [.., K/32] x [K/32, N] are the only ones left

    from pipeline.runners.base import OrtRunner

    runner = OrtRunner(art.ort_path)  # validate's candidate
    got = runner.session.get_session_options()
    assert got.get_session_config_entry(int4.ORT_ACCURACY_CONFIG[0]) == "1"
    assert got.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    reference = OrtRunner(exp.onnx_path)
    names = ["q", "k", "u", "logits", "emb"]
    for name, a, b in zip(names, reference.run_names(names, feeds()), runner.run_names(names, feeds())):
        assert np.allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(np.abs(a).max()))), name


def test_the_served_python_onnxruntime_model_runs_the_validated_graph_at_the_same_options(tiny, tmp_path):
    from pipeline.recipe.schema import TritonConfig
    from pipeline.runners.base import OrtRunner
    from pipeline.triton.config import compute_config
    from pipeline.triton.templates import onnxruntime_model as served

    root, exp, art = tiny
    triton = TritonConfig(model_name="tiny", max_batch_size=4, target="python-onnxruntime")
    cfg = compute_config(triton, exp.inputs, [TensorSpec("logits", "float32", ["b", "s", VOCAB])],
                         target="python-onnxruntime", graph=art.ort_path)
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params["graph_optimization_level"] == "all" and "dequantize_weights" not in params  # blocks kept
    assert json.loads(params["session_config"]) == ort_sessions.MATMULNBITS_FP32
    fp8_cfg = compute_config(triton, exp.inputs, [], target="python-onnxruntime", graph=exp.onnx_path)
    assert "session_config" not in fp8_cfg.parameters  # other graphs' configs are unchanged

    version = tmp_path / "1"
    version.mkdir()
    onnx.save(onnx.load(art.ort_path), str(version / "model.onnx"))
    model = served.TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()},
                                                  "input": [{"name": "x"}, {"name": "ids"}],
                                                  "output": [{"name": n} for n in ("q", "k", "u", "logits")]}),
                      "model_repository": str(tmp_path), "model_version": "1"})
    options = model.session.get_session_options()
    assert options.get_session_config_entry(int4.ORT_ACCURACY_CONFIG[0]) == "1"
    validated = OrtRunner(art.ort_path).run_names(["q", "k", "u", "logits"], feeds())
    for a, b in zip(validated, model._session_run(feeds())):
        assert np.array_equal(a, b)


def test_a_block_size_other_than_the_files_is_refused_by_the_stage(tiny, tmp_path):
    root, exp, _ = tiny
    recipe = int4_recipe(root / "tiny.gguf", block_size=64)  # check refuses it first; the stage says so too
    ctx = StageContext(recipe, tmp_path / "r.yaml", tmp_path / "run", "quantize", Progress(quiet=True))
    with pytest.raises(gb.GGUFWeightError, match=r"quantize.weights.block_size: 64, but tiny.gguf's INT4 tensors have "
                                                 r"other blocks: blk.0.attn_k.weight \(32\)") as err:
        quantize.run(ctx, exp)
    assert err.value.exit_code == EXIT_BAD_INPUT


def test_a_model_file_that_is_not_gguf_is_refused_by_the_stage(tiny, tmp_path):
    root, exp, _ = tiny
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all" * 10)
    ctx = StageContext(int4_recipe(fake), tmp_path / "r.yaml", tmp_path / "run", "quantize", Progress(quiet=True))
    with pytest.raises(gb.GGUFWeightError, match="not a readable GGUF file") as err:
        quantize.run(ctx, exp)
    assert err.value.exit_code == EXIT_BAD_INPUT


def test_tensorrt_rtx_counts_the_gemms_as_weight_only_not_left_in_fp32(tiny, tmp_path):
    import rtx_graphs

    from pipeline.trt import report as engine_report
    from pipeline.stages import build

    rtx_graphs.rtx_backend()  # or skip, naming why TensorRT-RTX cannot be used here
    root, exp, art = tiny
    b = build.build_from_onnx(int4_recipe(root / "tiny.gguf"), art.onnx_path, exp.inputs, tmp_path / "build",
                              quantized_nodes=art.quantized_nodes, source_onnx=exp.onnx_path)
    assert (b.status, b.reason) == ("ok", ""), b.reason  # no "left in higher precision" warning
    stamp = json.loads(Path(b.stamp_path).read_text())
    assert stamp["network"]["weight_only_gemms"] == {"q_mm": "INT4", "k_mm": "INT4", "up_mm": "INT8", "lm_head": "INT8"}
    assert stamp["network"]["low_precision_gemms"] == {}
    rows = stamp["weight_formats"]
    assert {k: r["gemms"] for k, r in rows.items()} == {"INT4 block 32 + offsets": 2, "INT8 block 16": 1,
                                                        "INT8 block 32": 1}
    assert rows["INT4 block 32 + offsets"]["bits_per_weight"] == 4 + 32 / 32 + 32 / 32
    assert rows["INT8 block 16"]["bits_per_weight"] == 8 + 32 / 16
    n = {"INT4 block 32 + offsets": (HEADS + KV_HEADS) * HEAD_DIM * K, "INT8 block 16": 24 * K, "INT8 block 32": VOCAB * K}
    assert {k: r["weights"] for k, r in rows.items()} == n
    mean = (6 * n["INT4 block 32 + offsets"] + 10 * n["INT8 block 16"] + 9 * n["INT8 block 32"]) / sum(n.values())
    assert stamp["weight_bits_per_weight"] == pytest.approx(mean)
    section = (tmp_path / "build" / engine_report.SECTION_FILE).read_text()
    assert "| weight-only GEMMs (block weights, FP32 activations) | 4 in the network (INT4 2, INT8 2) |" in section
    assert "INT4 block 32 + offsets: 2 GEMMs, 6.00 bits/weight" in section and "WARNING" not in section


def test_the_engine_graph_reads_the_embedding_from_the_lm_heads_int8_blocks_with_the_same_values(tiny):
    """``onnx_path`` (what TensorRT builds): the FP32 table is gone, the Gather reads Transpose(DequantizeLinear) of the
    lm_head's INT8 blocks (int4.share_tied_table), and every output is what the validated CPU graph gives (the
    embedding bit for bit: Q8_0 decodes exactly in float32)."""
    _, _, art = tiny
    assert art.calibration["engine_graph_tied_table"] == {
        "table": "table", "values": "gguf.token_embd.weight.values", "dequantize": "lm_head/DequantizeLinear",
        "bytes_saved": 4 * VOCAB * K}
    engine, cpu = onnx.load(art.onnx_path), onnx.load(art.ort_path)
    onnx.checker.check_model(engine, full_check=True)
    assert "table" not in {t.name for t in engine.graph.initializer}
    assert "table" in {t.name for t in cpu.graph.initializer}  # ONNX Runtime's Gather keeps the FP32 table
    dq = next(n for n in engine.graph.node if n.name == "lm_head/DequantizeLinear")
    assert sorted(n.op_type for n in engine.graph.node if dq.output[0] in n.input) == ["MatMul", "Transpose"]
    names = ["q", "k", "u", "logits", "emb"]
    opts = ort_sessions.session_options("all", config=ort_sessions.MATMULNBITS_FP32)
    a = ort.InferenceSession(cpu.SerializeToString(), opts).run(names, feeds())
    b = ort.InferenceSession(engine.SerializeToString(), opts).run(names, feeds())
    assert np.array_equal(a[4], b[4])  # the embedding
    for name, x, y in zip(names, a, b):
        assert np.allclose(x, y, rtol=0, atol=1e-5 * max(1.0, float(np.abs(x).max()))), name


def test_a_table_that_differs_from_the_blocks_decode_is_not_shared(tiny):
    root, exp, _ = tiny
    model = onnx.load(exp.onnx_path)
    int4.rewrite_tied_lm_head(model, gb.open_gguf(root / "tiny.gguf"))
    table = next(t for t in model.graph.initializer if t.name == "table")
    w = onnx.numpy_helper.to_array(table).copy()
    w[3, 7] = np.nextafter(w[3, 7], np.float32(np.inf))  # one ulp off in one element
    table.CopyFrom(onnx.numpy_helper.from_array(w, "table"))
    before = model.SerializeToString()
    assert int4.share_tied_table(model) is None
    assert model.SerializeToString() == before  # left as it was


def test_int8_blocks_split_into_int4_halves_decode_exactly():
    from pipeline.quant.gguf_blocks import DQForm

    rng = np.random.default_rng(5)
    q = rng.integers(-128, 128, (9, 64)).astype(np.int8)
    q[0, :4] = [-128, 127, 0, -1]
    d = rng.uniform(1e-6, 4.0, (9, 2)).astype(np.float16).astype(np.float32)
    hi, lo = int4.int4_halves(DQForm(8, 32, q, d, None))
    assert (hi.bits, lo.bits, hi.block_size) == (4, 4, 32)
    assert all(-8 <= f.values.min() and f.values.max() <= 7 for f in (hi, lo))
    assert np.array_equal(hi.weight() + lo.weight(), DQForm(8, 32, q, d, None).weight())  # exact in float64
    with pytest.raises(ValueError, match="INT4"):
        int4.int4_halves(hi)


def test_with_the_lookup_outside_the_engine_holds_the_tied_table_once(tiny, tmp_path):
    """``build.embedding_lookup: runtime``: the engine is built from the graph without its embedding Gather
    (kept as ``model.engine_input.onnx``, which ``trtexec.sh`` builds), taking ``inputs_embeds``; the INT8
    table goes beside it; and the engine is smaller than the one with the lookup inside by at least the
    INT8 values' bytes (TensorRT-RTX keeps a second copy of the blocks for the Gather)."""
    from safetensors.numpy import load_file

    import rtx_graphs

    from pipeline.trt import embedding
    from pipeline.stages import build

    rtx_graphs.rtx_backend()  # or skip, naming why TensorRT-RTX cannot be used here
    root, exp, art = tiny
    inside = int4_recipe(root / "tiny.gguf")
    outside = inside.model_copy(update={"build": inside.build.model_copy(update={"embedding_lookup": "runtime"})})
    sizes = {}
    for name, recipe in (("engine", inside), ("runtime", outside)):
        b = build.build_from_onnx(recipe, art.onnx_path, exp.inputs, tmp_path / name,
                                  quantized_nodes=art.quantized_nodes, source_onnx=exp.onnx_path)
        assert (b.status, b.reason) == ("ok", ""), b.reason
        sizes[name] = json.loads(Path(b.stamp_path).read_text())["engine_bytes"]
    assert sizes["engine"] - sizes["runtime"] >= VOCAB * K  # one INT8 copy of the table fewer
    folder = tmp_path / "runtime"
    stamp = json.loads((folder / build.STAMP_NAME).read_text())
    graph = onnx.load(str(folder / build.ENGINE_GRAPH))
    assert [i.name for i in graph.graph.input] == ["x", "inputs_embeds"] and "Gather" not in {
        n.op_type for n in graph.graph.node}
    assert "model.engine_input.onnx" in (folder / build.SCRIPT_NAME).read_text()
    table = load_file(str(folder / embedding.TABLE_FILE))
    assert table["values"].shape == (VOCAB, K) and table["values"].dtype == np.int8
    whole = onnx.load(art.onnx_path)  # the table the engine graph's Gather read, decoded, is the file's
    rows = embedding.cut(whole).decoded()
    assert np.array_equal(rows, table["values"].astype(np.float32) * np.repeat(table["scales"], 32, axis=1))
    assert stamp["embedding_lookup"]["bytes"] == (folder / embedding.TABLE_FILE).stat().st_size
    section = (folder / "engine.md").read_text()
    assert "| embedding lookup | outside the engine (build.embedding_lookup: runtime): it takes inputs_embeds " \
           f"[..., {K}] float32 in place of ids" in section
    assert not (tmp_path / "engine" / embedding.TABLE_FILE).exists()
