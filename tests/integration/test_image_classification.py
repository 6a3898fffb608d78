"""The image-classification kind: PaddleOCR's text-direction classifier (rapidocr-onnxruntime
wheel) on text lines rendered from lee_background, labels by construction (0 / 180 degrees)."""
from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from pipeline.artifacts import ExportArtifact, QuantizedArtifact, TensorSpec
from pipeline.sources.data import DataError, load
from pipeline.errors import ExportError, TritonConfigError
from pipeline.models.base import ModelAdapter
from pipeline.models.image_classification import graph, metrics, preprocess, render, serving
from pipeline.models.image_classification.adapter import ImageClassificationAdapter
from pipeline.models.image_classification.data import labelled_inputs
from pipeline.quant import qdq
from pipeline.recipe.kinds import facts as kind_facts
from test_repository import FakeRequest, fake_pb_utils, load_template

SPLITS = (render.Split("calibration", 0, 20, 8), render.Split("eval", 150, 300, 24))


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> Path:
    """8 calibration and 24 eval lines, each upright and turned: 16 + 48 images."""
    out = tmp_path_factory.mktemp("textlines")
    assert render.generate(out, SPLITS) == {"calibration": 16, "eval": 48}
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("graph") / "model.onnx"
    graph.prepare(graph.package_file(), path, dims=("batch", 3, 48, 192), opset=17)
    return path


def images(folder: Path):
    return load({"type": "images", "path": str(folder)}, None, "validate.data")


def session(path) -> ort.InferenceSession:
    """The pipeline's own session: Q/DQ graphs run with basic optimizations only (Q/DQ
    emulated in float, as validate measures them; ORT's fused int8 kernels differ)."""
    from pipeline.ort_sessions import ort_session

    return ort_session(str(path))


# --- preprocessing ----------------------------------------------------------------------


def test_preprocess_is_paddleocr_cls_normalisation_on_a_known_image():
    # 24 x 48 solid (R, G, B) = (255, 0, 51): height 48 -> width ceil(48 * 48 / 24) = 96, rest zero pad
    x = preprocess.normalize(Image.new("RGB", (48, 24), (255, 0, 51)))
    assert x.shape == (3, 48, 192) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, :, :96], np.broadcast_to(np.array([51 / 127.5 - 1, -1.0, 1.0], np.float32)[:, None, None],
                                                             (3, 48, 96)), atol=1e-6)  # BGR, (p/255 - 0.5)/0.5
    assert not x[:, :, 96:].any()
    # a long line (ratio 10 > 4) is squeezed to the full width: no padding
    wide = preprocess.normalize(Image.new("L", (300, 30), 255))
    np.testing.assert_array_equal(wide, np.ones((3, 48, 192), np.float32))
    assert preprocess.resized_width(300, 30) == 192 and preprocess.resized_width(50, 48) == 50
    with pytest.raises(ValueError, match="valid sizes are positive"):
        preprocess.resized_width(0, 48)


def test_decode_names_bad_bytes():
    with pytest.raises(ValueError, match="not a PNG/JPEG image \\(5 bytes\\)"):
        preprocess.decode(b"hello")


# --- rendering and labels ---------------------------------------------------------------


def test_rendering_is_deterministic_and_splits_are_disjoint(lines, tmp_path):
    render.generate(tmp_path, SPLITS)
    for split in ("calibration", "eval"):
        for f in sorted((lines / split).rglob("*.png")):
            assert f.read_bytes() == (tmp_path / split / f.relative_to(lines / split)).read_bytes(), f
    texts = render.split_lines(load({"type": "corpus", "name": "lee_background"}, None).items(), SPLITS,
                               render.RenderSettings())
    assert len(texts["eval"]) == 24 and not set(texts["calibration"]) & set(texts["eval"])
    assert all(12 <= len(t) <= 28 for t in texts["eval"])
    with pytest.raises(Exception, match="share corpus documents"):
        render.split_lines(["a b"] * 10, (render.Split("a", 0, 5, 1), render.Split("b", 4, 8, 1)),
                           render.RenderSettings())


def test_label_is_the_rotation_by_construction(lines):
    src = images(lines / "eval")
    assert src.classes() == ["0", "180"]
    items = src.items()
    upright = {p.name: p for p, label in items if label == 0}
    turned = {p.name: p for p, label in items if label == 1}
    assert upright.keys() == turned.keys() and len(upright) == 24
    for name in list(upright)[:5]:
        a, b = Image.open(upright[name]), Image.open(turned[name])
        assert render.rotate_180(a).tobytes() == b.tobytes()
        assert render.rotate_180(render.rotate_180(a)).tobytes() == a.tobytes()


# --- the graph, FP32 accuracy, INT8 -----------------------------------------------------


def test_prepared_graph_folds_batchnorm_names_dims_and_matches_the_shipped_graph(prepared):
    shipped = onnx.load(str(graph.package_file()))
    model = onnx.load(str(prepared))
    ops = {n.op_type for n in model.graph.node}
    assert "BatchNormalization" not in ops and "Constant" not in ops and "BatchNormalization" in {
        n.op_type for n in shipped.graph.node}
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 48, 192] and model.opset_import[0].version == 17
    x = np.random.default_rng(1).uniform(-1, 1, (3, 3, 48, 192)).astype(np.float32)
    np.testing.assert_allclose(session(prepared).run(None, {"x": x})[0], session(graph.package_file()).run(None, {"x": x})[0],
                               atol=1e-5)


def test_fp32_accuracy_on_rendered_lines_is_far_above_chance(lines, prepared):
    x, labels = labelled_inputs(images(lines / "eval"), "x")
    scores = session(prepared).run(None, {"x": x})[0]
    np.testing.assert_allclose(scores.sum(1), 1.0, rtol=1e-5)  # softmax over (0, 180)
    assert metrics.accuracy(scores, labels) >= 0.9  # chance is 0.5; 48 images here, 97.4 % on the 800 of the recipe


def conv_net(path: Path) -> Path:
    """x [batch, 3, 8, 8] -> Conv(4, 3x3) -> Relu -> Conv(2, 1x1, groups 2) -> GlobalAveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=s).astype(np.float32), n) for n, s in
             [("w1", (4, 3, 3, 3)), ("b1", (4,)), ("w2", (2, 2, 1, 1)), ("w3", (2, 5))]]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", group=2),
             helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "w3"], ["y"], name="fc")]
    g = helper.make_graph(nodes, "convnet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def act_amax(path: Path, names: list[str], x: np.ndarray) -> dict[str, float]:
    """max |activation| of ``names`` on ``x`` (the graph's own outputs plus these tensors)."""
    model = onnx.load(str(path))
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
                              if n not in {o.name for o in model.graph.output})
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return {n: float(np.abs(v).max()) for n, v in zip(names, sess.run(names, {"x": x}))}


def test_conv_targets_get_per_output_channel_weights_on_axis_0(tmp_path):
    path = conv_net(tmp_path / "conv.onnx")
    model = onnx.load(str(path))
    targets = qdq.find_targets(model, ["Conv", "MatMul", "Gemm"])
    assert [(t.node, t.act, t.weight, t.weight_axis) for t in targets] == [
        ("conv1", "x", "w1", 0), ("conv2", "r1", "w2", 0), ("fc", "f", "w3", 1)]
    assert qdq.find_targets(model, ["MatMul", "Gemm"]) == targets[2:]  # Conv only when asked for
    x = np.random.default_rng(2).normal(size=(4, 3, 8, 8)).astype(np.float32)
    q = qdq.insert_qdq(model, targets, act_amax(path, ["x", "r1", "f"], x), qdq.FORMATS["int8"], per_channel=True)
    dq = {n.input[0]: n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("w")}
    assert [a.i for a in dq["w1_quantized"].attribute] == [0]
    scales = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    assert scales["w1_scale"].shape == (4,) and scales["w2_scale"].shape == (2,)
    np.testing.assert_allclose(scales["w1_scale"], np.abs(numpy_helper.to_array(
        next(i for i in model.graph.initializer if i.name == "w1"))).max(axis=(1, 2, 3)) / 127, rtol=1e-6)
    onnx.save(q, tmp_path / "int8.onnx")
    ref, got = session(path).run(None, {"x": x})[0], session(tmp_path / "int8.onnx").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, atol=0.02 * np.abs(ref).max())


def test_int8_classifier_runs_and_agrees_with_fp32(lines, prepared, tmp_path):
    """Q/DQ on every Conv (per output channel) and the FC, amax from the calibration images;
    measured through the adapter's validate metrics (candidate in ONNX Runtime, Q/DQ emulated)."""
    model = onnx.load(str(prepared))
    targets = qdq.find_targets(model, ["Conv", "MatMul", "Gemm"])
    op = {n.name: n.op_type for n in model.graph.node}
    assert sorted({op[t.node] for t in targets}) == ["Conv", "Gemm"] and len(targets) == 54  # 53 Conv + the FC
    adapter = ImageClassificationAdapter(onnx_source(graph.package_file()))
    exp = ExportArtifact(str(prepared), [TensorSpec("x", "float32", ["batch", 3, 48, 192])],
                         [TensorSpec("save_infer_model/scale_0.tmp_1", "float32", ["batch", 2])], "")
    (cal,) = adapter.calibration_feeds(exp, images(lines / "calibration"), SimpleNamespace(samples=16, batch_size=16))
    q = qdq.insert_qdq(model, targets, act_amax(prepared, sorted({t.act for t in targets}), cal["x"]),
                       qdq.FORMATS["int8"], per_channel=True)
    onnx.save(q, tmp_path / "int8.onnx")
    ctx = SimpleNamespace(recipe=SimpleNamespace(validate_=SimpleNamespace(data=images(lines / "eval"), batch_size=16)))
    got, _ = adapter.metrics(ctx, exp, QuantizedArtifact(str(tmp_path / "int8.onnx"), "int8", [t.node for t in targets], []))
    assert got["samples"] == 48 and got["top1_accuracy_fp32"] >= 0.9
    assert got["top1_agreement"] >= 0.9 and got["top1_accuracy_drop"] <= 5.0  # 800 images: -0.5 points, 0.9875


def test_metrics_values():
    ref = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    cand = np.array([[0.9, 0.1], [0.7, 0.3], [0.4, 0.6], [0.3, 0.7]])
    got = metrics.compare(ref, cand, np.array([0, 1, 1, 1]))
    basis = got.pop("stderr_basis")
    se = {k: got.pop(k) for k in ("top1_accuracy_drop_stderr", "top1_agreement_stderr")}
    assert got == {"top1_accuracy_fp32": 0.75, "top1_accuracy_candidate": 0.75, "top1_accuracy_drop": 0.0,
                   "top1_agreement": 0.5, "samples": 4}
    # per image: drop [0, 100, -100, 0] points, agreement [1, 0, 0, 1]; bootstrap SEs near sqrt(var / n)
    assert se["top1_accuracy_drop_stderr"] == pytest.approx(np.std([0, 100, -100, 0]) / 2, rel=0.15)
    assert se["top1_agreement_stderr"] == pytest.approx(0.25, rel=0.15)
    assert basis["top1_agreement"]["n"] == 4 and basis["top1_agreement"]["unit"] == "images"
    one = metrics.compare(ref[:1], cand[:1], np.array([0]))
    assert one["top1_agreement_stderr_reason"] == "one eval image has no spread" and "top1_agreement_stderr" not in one
    assert metrics.compare(ref, ref[:, ::-1], np.array([0, 1, 0, 1]))["top1_accuracy_drop"] == 100.0
    with pytest.raises(ValueError, match="valid: \\[0, 1\\]"):
        metrics.accuracy(ref, np.array([0, 1, 2, 0]))


# --- Triton: preprocessing model and ensemble -------------------------------------------


def compute_model(max_batch: int = 8):
    """The staged compute model of the prepared classifier (onnxruntime_onnx)."""
    from tritonclient.grpc import model_config_pb2 as mc

    from pipeline.triton.repository import StagedModel

    ins = [TensorSpec("x", "float32", ["batch", 3, 48, 192])]
    outs = [TensorSpec("save_infer_model/scale_0.tmp_1", "float32", ["batch", 2])]
    cfg = mc.ModelConfig(name="textline_cls", platform="onnxruntime_onnx", max_batch_size=max_batch)
    cfg.input.add(name="x", data_type=mc.TYPE_FP32, dims=[3, 48, 192])
    cfg.output.add(name=outs[0].name, data_type=mc.TYPE_FP32, dims=[2])
    return StagedModel(cfg, ins, outs, "onnxruntime", max_batch)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_preprocess_template_equals_the_library_and_isolates_bad_images(lines, tmp_path, monkeypatch):
    models = serving.stage(compute_model(), 1, 8, tmp_path)
    assert [m.config.name for m in models] == ["textline_cls_preprocess", "textline_cls_ensemble"]
    fake_pb_utils(monkeypatch)
    model = load_template(tmp_path / "textline_cls_preprocess")
    files = sorted((lines / "eval").rglob("*.png"))[:3]
    blobs = np.array([[f.read_bytes()] for f in files], dtype=object)
    jpeg = io.BytesIO()
    Image.open(files[0]).convert("RGB").save(jpeg, format="JPEG")
    ok, one_jpeg, bad = model.execute([FakeRequest(image=blobs), FakeRequest(image=np.array([[jpeg.getvalue()]], dtype=object)),
                                       FakeRequest(image=np.array([[b"x"], [b"not an image"]], dtype=object))])
    assert ok.error is None and one_jpeg.error is None
    np.testing.assert_array_equal(ok.outputs["x"], preprocess.batch(Image.open(f) for f in files))
    np.testing.assert_array_equal(one_jpeg.outputs["x"], preprocess.batch([Image.open(io.BytesIO(jpeg.getvalue()))]))
    assert bad.error.startswith("preprocess: row 0: not a PNG/JPEG image")


def test_ensemble_maps_image_through_preprocess_to_compute(tmp_path):
    from pipeline.triton.config import parse_config

    pre, ens = serving.stage(compute_model(), 1, 8, tmp_path)
    cfg = parse_config((tmp_path / "textline_cls_ensemble" / "config.pbtxt").read_text())
    assert cfg == ens.config and cfg.platform == "ensemble" and cfg.max_batch_size == 8
    first, second = cfg.ensemble_scheduling.step
    assert (first.model_name, dict(first.input_map), dict(first.output_map)) == (
        "textline_cls_preprocess", {"image": "image"}, {"x": "x"})
    assert (second.model_name, dict(second.input_map)) == ("textline_cls", {"x": "x"})
    assert [o.name for o in cfg.output] == ["save_infer_model/scale_0.tmp_1"]
    params = {k: v.string_value for k, v in pre.config.parameters.items()}
    assert params == {"height": "48", "width": "192", "mean": "0.5", "std": "0.5", "channel_order": "BGR"}
    with pytest.raises(TritonConfigError, match="is not an input of 'textline_cls'"):
        serving.ensemble_config("e", serving.preprocess_config("p", max_batch_size=1, output="pixels"),
                                compute_model().config)
    with pytest.raises(TritonConfigError, match="one \\[batch, 3, height, width\\] input"):
        serving.graph_image_size([TensorSpec("input_ids", "int64", ["batch", "sequence"])])


# --- the adapter ------------------------------------------------------------------------


def onnx_source(path: Path):
    from pipeline.sources.model import OnnxSource

    return OnnxSource(onnx=str(path))


def test_adapter_implements_the_contract_from_an_onnx_source(lines, tmp_path):
    shipped = tmp_path / "cls.onnx"
    shipped.write_bytes(graph.package_file().read_bytes())
    adapter = ImageClassificationAdapter(onnx_source(shipped))
    assert isinstance(adapter, ModelAdapter) and adapter.kind == "image-classification"
    from pipeline.recipe import gates

    assert gates.kind_metrics("image-classification") == {"top1_accuracy_drop", "top1_agreement"}
    loaded = adapter.load(SimpleNamespace())
    assert loaded.input_names == ("x",) and loaded.example_feeds["x"].shape == (2, 3, 48, 192)
    export_cfg = SimpleNamespace(dynamic_axes={"x": {0: "batch"}}, opset=17)
    ins, outs = adapter.graph_io(loaded, export_cfg)
    assert ins == [TensorSpec("x", "float32", ["batch", 3, 48, 192])] and outs[0].shape == ["batch", 2]
    with pytest.raises(ExportError, match="valid: \\{x: \\{0: batch\\}\\}"):
        adapter.dynamic_axes(SimpleNamespace(dynamic_axes={"x": {1: "channels"}}))
    adapter.export(loaded.module, export_cfg, tmp_path / "model.onnx")
    feeds = adapter.sample_feeds(loaded.module, ins, {"batch": 3}, seed=4)
    (expected,) = adapter.torch_outputs(loaded.module, feeds)
    np.testing.assert_allclose(session(tmp_path / "model.onnx").run(None, feeds)[0], expected.numpy(), atol=1e-5)

    exp = ExportArtifact(str(tmp_path / "model.onnx"), ins, outs, "")
    cal = SimpleNamespace(samples=6, batch_size=4)
    batches = adapter.calibration_feeds(exp, images(lines / "calibration"), cal)
    assert [b["x"].shape[0] for b in batches] == [4, 2]
    q = QuantizedArtifact(str(tmp_path / "model.onnx"), "fp32", [], [])  # candidate = the FP32 graph itself
    ctx = SimpleNamespace(recipe=SimpleNamespace(validate_=SimpleNamespace(data=images(lines / "eval"), batch_size=16)))
    got, tokens = adapter.metrics(ctx, exp, q)
    assert tokens == {} and set(got) == {*metrics.METRICS, "stderr_basis", *(f"{m}_stderr" for m in kind_facts("image-classification").stderr_metrics)}
    assert got["top1_agreement"] == 1.0 and got["top1_accuracy_drop"] == 0.0 and got["samples"] == 48
    assert got["top1_accuracy_fp32"] >= 0.9

    recipe = SimpleNamespace(validate_=ctx.recipe.validate_, triton=SimpleNamespace(model_name="textline_cls"))
    work = adapter.bench_workload(recipe, "")
    assert work.model == "textline_cls_ensemble" and not work.streaming and len(work.requests) == 48
    assert work.requests[0]["image"].shape == (1, 1) and work.requests[0]["image"][0, 0][:4] == b"\x89PNG"


def test_adapter_refuses_a_non_image_graph(tmp_path):
    path = conv_net(tmp_path / "conv.onnx")  # 4-D input, but [batch, 5] output is fine: accepted
    assert ImageClassificationAdapter(onnx_source(path)).load(SimpleNamespace()).module.classes == 5
    g = helper.make_graph([helper.make_node("Identity", ["t"], ["u"])], "g",
                          [helper.make_tensor_value_info("t", TensorProto.INT64, ["batch", "sequence"])],
                          [helper.make_tensor_value_info("u", TensorProto.INT64, ["batch", "sequence"])])
    onnx.save(helper.make_model(g, ir_version=8), tmp_path / "text.onnx")
    with pytest.raises(ExportError, match="valid: one \\[batch, 3, H, W\\] input"):
        ImageClassificationAdapter(onnx_source(tmp_path / "text.onnx")).load(SimpleNamespace())


def test_npz_source_gives_the_same_labelled_inputs(lines, tmp_path):
    x, labels = labelled_inputs(images(lines / "eval"), "x")
    np.savez(tmp_path / "eval.npz", x=x, labels=labels)
    src = load({"type": "npz", "path": str(tmp_path / "eval.npz"), "labels": "labels"}, None, "validate.data")
    x2, labels2 = labelled_inputs(src, "x", limit=5)
    np.testing.assert_array_equal(x2, x[[0, 12, 24, 35, 47]])
    np.testing.assert_array_equal(labels2, [0, 0, 1, 1, 1])


def test_processor_is_saved_by_export_and_normalises_like_preprocess(lines, tmp_path):
    proc = preprocess.ImageProcessor()
    saved = json.loads(proc.save_pretrained(tmp_path / "tokenizer").read_text())
    assert saved | {"resize": None} == {"height": 48, "width": 192, "mean": 0.5, "std": 0.5, "channel_order": "BGR",
                                        "resize": None}
    files = sorted((lines / "eval" / "0").glob("*.png"))[:2]
    np.testing.assert_array_equal(proc(Image.open(f) for f in files), preprocess.batch(Image.open(f) for f in files))
    rgb = preprocess.ImageProcessor(channel_order="RGB")(Image.open(f) for f in files)
    np.testing.assert_array_equal(rgb, preprocess.batch(Image.open(f) for f in files)[:, ::-1])


def test_render_cli_writes_both_folders_and_the_line_record(tmp_path, capsys):
    assert render.main([str(tmp_path), "--calibration-lines", "2", "--eval-lines", "3"]) == 0
    assert capsys.readouterr().out.strip() == "calibration: 4 images eval: 6 images"
    record = json.loads((tmp_path / "render.json").read_text())
    assert record["settings"] == {"font_size": 32, "padding": 4, "max_chars": 28, "min_chars": 12}
    assert [len(record["lines"][s]) for s in ("calibration", "eval")] == [2, 3]
    assert sorted(p.name for p in (tmp_path / "eval" / "180").iterdir()) == ["00000.png", "00001.png", "00002.png"]


# --- the shipped recipe, end to end ----------------------------------------------------------


def _recipe_path() -> Path:
    from conftest import ROOT

    return ROOT / "recipes" / "int8-textline-orientation.yaml"


def test_recipe_builds_end_to_end_on_a_small_subset(lines, tmp_path):
    """The shipped recipe on 16 calibration and 48 eval images (of 128 / 800): every stage runs,
    the gates pass and the repository holds compute + preprocess + ensemble."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = _recipe_path()
    recipe = load_recipe(path, {
        "work_dir": str(tmp_path / "artifacts"), "output_dir": str(tmp_path / "model_repository"),
        "quantize.calibration.data.path": str(lines / "calibration"), "quantize.calibration.samples": 16,
        "validate.data.path": str(lines / "eval")})
    result = run_pipeline(recipe, path, quiet=True)
    man = result.manifest
    assert result.passed, man["gates"]
    m = man["metrics"]
    assert m["samples"] == 48 and m["top1_accuracy_fp32"] >= 0.9 and m["top1_agreement"] >= 0.9
    assert len(result.artifacts["quantize"].quantized_nodes) == 54
    repo = tmp_path / "model_repository"
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == [
        "textline_cls_int8", "textline_cls_int8_ensemble", "textline_cls_int8_preprocess"]
    assert (repo / "textline_cls_int8_preprocess" / "1" / "model.py").is_file()
    import shutil

    [turned] = [p for p in (lines / "eval").iterdir() if p.is_dir() and p.name != sorted(
        q.name for q in (lines / "eval").iterdir() if q.is_dir())[0]]
    shutil.copytree(turned, tmp_path / "one-class" / turned.name)  # "180" alone would become class 0
    one = load_recipe(path, {"work_dir": str(tmp_path / "artifacts"), "output_dir": str(tmp_path / "model_repository"),
                             "quantize.calibration.data.path": str(lines / "calibration"),
                             "quantize.calibration.samples": 16, "validate.data.path": str(tmp_path / "one-class")})
    with pytest.raises(DataError, match=rf"has 1 label folder\(s\) \['{turned.name}'\] but the model scores 2 classes"):
        run_pipeline(one, path, quiet=True)


def test_served_models_are_what_triton_models_writes(tmp_path):
    adapter = ImageClassificationAdapter(onnx_source(graph.package_file()))
    recipe = SimpleNamespace(triton=SimpleNamespace(model_name="textline_cls", version=1, max_batch_size=8))
    staged = adapter.triton_models(recipe, None, compute_model(), None, tmp_path)
    assert [m.config.name for m in staged] == adapter.served_models(recipe)
    assert adapter.front_model(recipe) == "textline_cls_ensemble" and not kind_facts("image-classification").generates
    assert adapter.triton_models(recipe, None, None, None, tmp_path) == []


def test_labelled_inputs_refuse_text_and_badly_shaped_feeds(tmp_path):
    from pipeline.sources.data import DataError

    corpus = load({"type": "corpus", "name": "lee_background", "split": {"start": 0, "stop": 2}}, None, "validate.data")
    with pytest.raises(DataError, match="validate.data: an image classifier reads images or npz feeds; .* holds documents"):
        labelled_inputs(corpus, "x")
    np.savez(tmp_path / "flat.npz", x=np.zeros((4, 48, 192), np.float32))
    flat = load({"type": "npz", "path": str(tmp_path / "flat.npz")}, None, "validate.data")
    with pytest.raises(DataError, match="array 'x' has shape \\[4, 48, 192\\]; valid: \\[n, 3, height, width\\]"):
        labelled_inputs(flat, "x")


def test_metrics_name_labels_outside_the_models_classes(lines, prepared, tmp_path):
    from pipeline.sources.data import DataError

    x, _ = labelled_inputs(images(lines / "eval"), "x", limit=4)
    np.savez(tmp_path / "eval.npz", x=x, labels=np.array([0, 1, 2, 0]))
    data = load({"type": "npz", "path": str(tmp_path / "eval.npz"), "labels": "labels"}, None, "validate.data")
    exp = ExportArtifact(str(prepared), [TensorSpec("x", "float32", ["batch", 3, 48, 192])],
                         [TensorSpec("save_infer_model/scale_0.tmp_1", "float32", ["batch", 2])], "")
    ctx = SimpleNamespace(recipe=SimpleNamespace(validate_=SimpleNamespace(data=data, batch_size=4)))
    adapter = ImageClassificationAdapter(onnx_source(graph.package_file()))
    with pytest.raises(DataError, match="validate.data: npz feeds .*labels span \\[0, 2\\]; valid: \\[0, 1\\]"):
        adapter.metrics(ctx, exp, QuantizedArtifact(str(prepared), "fp32", [], []))
