"""Every model kind's Triton python-backend models, written by the triton stage for a tiny graph of
that kind (target python-onnxruntime, so the compute model is a python model too), loaded and run as
the python backend does (a stand-in ``triton_python_backend_utils``): the front model (generation,
tokenizer, image preprocessing) feeds the compute model, whose outputs equal ONNX Runtime's on the
graph. One case per row of :data:`pipeline.recipe.kinds.KINDS`."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, ResolvedProfile
from pipeline.onnx_io import graph_specs
from pipeline.recipe.kinds import KINDS
from pipeline.recipe.schema import Recipe
from pipeline.stages.triton import write_repository
from test_repository import (
    FakeRequest, build_artifact, fake_pb_utils, llm_feeds, load_template, make_recipe, ort_session,
    reference_generate, tiny_llm, tiny_tokenizer,
)
from tiny import continuation

WIDTH_D = 8  # the tiny encoder's embedding width


def save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def tiny_encoder(path: Path, vocab: int) -> Path:
    """input_ids, attention_mask int64 [batch, sequence] -> embeddings float32 [batch, 8]: the masked
    mean of a random embedding table's rows."""
    table = np.random.default_rng(0).standard_normal((vocab, WIDTH_D)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["rows"]),  # [B, S, D]
             helper.make_node("Cast", ["attention_mask"], ["mask"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["mask", "two"], ["mask3"]),
             helper.make_node("Mul", ["rows", "mask3"], ["kept"]),
             helper.make_node("ReduceSum", ["kept", "one"], ["total"], keepdims=0),
             helper.make_node("ReduceSum", ["mask3", "one"], ["count"], keepdims=0),
             helper.make_node("Div", ["total", "count"], ["embeddings"])]
    graph = helper.make_graph(
        nodes, "tiny_encoder",
        [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"]) for n in ("input_ids", "attention_mask")],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", WIDTH_D])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.array([1], np.int64), "one"),
         numpy_helper.from_array(np.array([2], np.int64), "two")])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)


def tiny_classifier(path: Path) -> Path:
    """x float32 [batch, 3, 48, 192] -> probs float32 [batch, 2]: softmax of the channel means times a matrix."""
    weight = np.array([[1.0, -1.0], [0.5, 2.0], [-1.5, 0.25]], np.float32)
    nodes = [helper.make_node("ReduceMean", ["x", "hw"], ["means"], keepdims=0),  # [B, 3]
             helper.make_node("MatMul", ["means", "weight"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["probs"], axis=-1)]
    graph = helper.make_graph(
        nodes, "tiny_classifier", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 48, 192])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(np.array([2, 3], np.int64), "hw")])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)


def tiny_generic(path: Path) -> Path:
    """pixels float32 [batch, 4] -> out float32 [batch, 2] (a matrix product and a Relu)."""
    weight = np.arange(8, dtype=np.float32).reshape(4, 2) / 4 - 1
    nodes = [helper.make_node("MatMul", ["pixels", "weight"], ["mm"]), helper.make_node("Relu", ["mm"], ["out"])]
    graph = helper.make_graph(
        nodes, "tiny_generic", [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 2])],
        [numpy_helper.from_array(weight, "weight")])
    return save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)


def stage(tmp_path: Path, kind: str, onnx_path: Path, tokenizer_dir: Path | None, build: BuildArtifact,
          **triton) -> Path:
    """The triton stage's repository for ``kind`` on ``onnx_path`` (FP32, target python-onnxruntime)."""
    inputs, outputs = graph_specs(onnx.load(str(onnx_path)))
    export = ExportArtifact(str(onnx_path), inputs, outputs, str(tokenizer_dir) if tokenizer_dir else None)
    recipe = make_recipe(kind=kind, target="python-onnxruntime", **triton)
    if kind == "generic":  # a generic model comes from a graph (or an entry), not a package
        data = recipe.model_dump(mode="json", by_alias=True, exclude_none=True)
        data["model"]["source"] = {"onnx": str(onnx_path)}
        recipe = Recipe.model_validate(data)
    write_repository(recipe, export=export,
                     quantized=QuantizedArtifact(str(onnx_path), "fp32", [], []), build=build,
                     out_dir=tmp_path / "repo")
    return tmp_path / "repo"


def fixed_build(shapes: dict[str, list[int]], batch_max: int = 4) -> BuildArtifact:
    """A skipped build whose one profile spans batch 1..``batch_max`` at these per-row shapes."""
    profile = {n: {"min": [1, *s], "opt": [batch_max, *s], "max": [batch_max, *s]} for n, s in shapes.items()}
    return BuildArtifact("skipped", "tensorrt not installed", None, None, "trtexec.sh",
                         [ResolvedProfile("default", profile)])


def python_models(repo: Path) -> list[str]:
    return sorted(p.parent.parent.name for p in repo.glob("*/1/model.py"))


def run_one(model, **inputs) -> dict[str, np.ndarray]:
    """One request through a (non-decoupled) template: its outputs, or the error raised."""
    (response,) = model.execute([FakeRequest(**inputs)])
    assert response.error is None, response.error
    return response.outputs


def compute_equals_onnxruntime(repo: Path, name: str, onnx_path: Path, feeds: dict[str, np.ndarray]) -> None:
    model = load_template(repo / name)
    got = run_one(model, **feeds)
    names = list(model.output_names)
    for out, expected in zip(names, ort_session(onnx_path).run(names, feeds)):
        np.testing.assert_allclose(got[out], expected, rtol=1e-6, atol=1e-7)


def text_generation(tmp_path: Path, monkeypatch) -> list[str]:
    onnx_path = tiny_llm(tmp_path / "work" / "model.onnx")
    tok_dir = tiny_tokenizer(tmp_path / "work" / "tokenizer")
    repo = stage(tmp_path, "text-generation", onnx_path, tok_dir, build_artifact())
    fake_pb_utils(monkeypatch)
    compute_equals_onnxruntime(repo, "tiny", onnx_path, llm_feeds(2, 3))
    generate = load_template(repo / "tiny_generate")  # compute in process (python-onnxruntime)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    request = FakeRequest(text_input=np.array([b"b c d"], np.object_), max_tokens=np.array([4], np.int32))
    generate.execute([request])
    generate.drain(timeout=60)
    generate.finalize()
    ids, expected = tok.encode("b c d").ids, reference_generate(onnx_path, tok.encode("b c d").ids, 4)
    assert [int(r.outputs["token_ids"][0]) for r, _ in request.sent] == expected
    assert "".join(r.outputs["text_output"][0].decode() for r, _ in request.sent) == continuation(tok, ids, expected)
    return python_models(repo)


def sentence_embedding(tmp_path: Path, monkeypatch) -> list[str]:
    tok_dir = tiny_tokenizer(tmp_path / "work" / "tokenizer")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "pad_token": "<eos>"}))
    vocab = Tokenizer.from_file(str(tok_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    onnx_path = tiny_encoder(tmp_path / "work" / "model.onnx", vocab)
    build = fixed_build({"input_ids": [16], "attention_mask": [16]})
    repo = stage(tmp_path, "sentence-embedding", onnx_path, tok_dir, build, generate_model_name=None)
    fake_pb_utils(monkeypatch)
    ids = run_one(load_template(repo / "tiny_tokenizer"), text=np.array([[b"b c d"], [b"a j"]], np.object_))
    assert sorted(ids) == ["attention_mask", "input_ids"] and ids["attention_mask"].sum() == 5
    compute_equals_onnxruntime(repo, "tiny", onnx_path, ids)
    return python_models(repo)


def image_classification(tmp_path: Path, monkeypatch) -> list[str]:
    from PIL import Image

    from pipeline.models.image_classification import preprocess

    onnx_path = tiny_classifier(tmp_path / "work" / "model.onnx")
    repo = stage(tmp_path, "image-classification", onnx_path, None, fixed_build({"x": [3, 48, 192]}),
                 generate_model_name=None)
    fake_pb_utils(monkeypatch)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 100, 3), dtype=np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    pixels = run_one(load_template(repo / "tiny_preprocess"), image=np.array([[png.getvalue()]], np.object_))
    np.testing.assert_array_equal(pixels["x"], preprocess.batch([Image.open(io.BytesIO(png.getvalue()))]))
    compute_equals_onnxruntime(repo, "tiny", onnx_path, pixels)
    return python_models(repo)


def generic(tmp_path: Path, monkeypatch) -> list[str]:
    onnx_path = tiny_generic(tmp_path / "work" / "model.onnx")
    repo = stage(tmp_path, "generic", onnx_path, None, fixed_build({"pixels": [4]}), generate_model_name=None)
    fake_pb_utils(monkeypatch)
    feeds = {"pixels": np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)}
    compute_equals_onnxruntime(repo, "tiny", onnx_path, feeds)
    return python_models(repo)


#: kind -> (the case, the python-backend models its repository holds, every one run by the case)
CASES = {
    "text-generation": (text_generation, ["tiny", "tiny_generate"]),
    "sentence-embedding": (sentence_embedding, ["tiny", "tiny_tokenizer"]),
    "image-classification": (image_classification, ["tiny", "tiny_preprocess"]),
    "generic": (generic, ["tiny"]),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_python_model_of_the_kind_runs_and_the_compute_model_equals_onnxruntime(kind, tmp_path, monkeypatch):
    assert kind in CASES, f"kind {kind!r} has no template case here: add one"
    case, models = CASES[kind]
    assert case(tmp_path, monkeypatch) == models
