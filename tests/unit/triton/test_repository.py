"""Triton repository: layout, atomic publish, generation model, and a real tritonserver."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import queue
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import json_format
from onnx import TensorProto, helper, numpy_helper
from tokenizers import Tokenizer, models, pre_tokenizers

from pipeline.artifacts import BuildArtifact, ExportArtifact, QuantizedArtifact, ResolvedProfile, TensorSpec
from pipeline.errors import TritonConfigError
from pipeline.recipe.schema import Recipe
from pipeline.triton import repository as repo_mod
from pipeline.onnx_io import graph_specs
from pipeline.triton.config import parse_config
from pipeline.triton import publish as publish_mod
from pipeline.models.text_generation.kv import KVLayout
from pipeline.models.text_generation.triton import kv_layout
from pipeline.models.text_generation import served as served_pkg
from pipeline.stages.triton import write_repository
from pipeline.triton.repository import eos_token_ids, repository_runtime
from tiny import continuation

LAYERS, HEADS, HEAD_DIM, VOCAB, EOS = 2, 1, 4, 11, 0
WORDS = ["<eos>", *"abcdefghij"]


def tiny_llm(path: Path, *, external: bool = False, qdq: bool = False, seed: int = 3) -> Path:
    """A KV-cache 'LM' with the export's I/O: embed, append to every past, logits from
    the embedding plus the last-layer cache summed up to each position (causal: a position's
    logits never see a later token, so a prompt prefilled in chunks scores as in one pass),
    masked by max(attention_mask). ``qdq``: FP8 E4M3 Q/DQ on both lm_head MatMul inputs, as the
    quantize stage writes."""
    rng = np.random.default_rng(seed)
    past = [f"past_key_values.{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    present = [f"present.{i}.{k}" for i in range(LAYERS) for k in ("key", "value")]
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    inits = [
        numpy_helper.from_array(rng.normal(size=(VOCAB, HEAD_DIM)).astype(np.float32), "embed"),
        numpy_helper.from_array(rng.normal(size=(HEAD_DIM, VOCAB)).astype(np.float32), "lm_head"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
        numpy_helper.from_array(np.array(0.3, np.float32), "mix"),
        numpy_helper.from_array(np.array(2, np.int64), "two_s"),
        numpy_helper.from_array(np.array([2**31], np.int64), "end"),
    ]
    nodes = [
        helper.make_node("Gather", ["embed", "input_ids"], ["x"]),
        helper.make_node("Unsqueeze", ["x", "one"], ["x4"]),
        *[helper.make_node("Concat", [p, "x4"], [q], axis=2) for p, q in zip(past, present)],
        helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
        helper.make_node("Gather", ["ids_shape", "one"], ["n"]),
        helper.make_node("Neg", ["n"], ["minus_n"]),
        helper.make_node("CumSum", [present[-1], "two_s"], ["ctx_cum"]),  # [B, H, P + n, D]
        helper.make_node("Slice", ["ctx_cum", "minus_n", "end", "two"], ["ctx_n"]),  # the new positions'
        helper.make_node("ReduceSum", ["ctx_n", "one"], ["ctx"], keepdims=0),  # over heads: [B, n, D]
        helper.make_node("Mul", ["ctx", "mix"], ["ctx_scaled"]),
        helper.make_node("Add", ["x", "ctx_scaled"], ["h"]),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=f32),
        helper.make_node("ReduceMax", ["mask_f", "one"], ["mask_max"], keepdims=1),
        helper.make_node("Unsqueeze", ["mask_max", "two"], ["mask3"]),
        helper.make_node("Mul", ["h", "mask3"], ["h_masked"]),
    ]
    if qdq:
        inits += [numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
                  helper.make_tensor("fp8_zero", TensorProto.FLOAT8E4M3FN, [], [0.0])]
        for name in ("h_masked", "lm_head"):
            nodes += [helper.make_node("QuantizeLinear", [name, "scale", "fp8_zero"], [f"{name}_q"]),
                      helper.make_node("DequantizeLinear", [f"{name}_q", "scale"], [f"{name}_dq"])]
    matmul_inputs = ["h_masked_dq", "lm_head_dq"] if qdq else ["h_masked", "lm_head"]
    nodes.append(helper.make_node("MatMul", matmul_inputs, ["logits"]))
    kv = ["batch", HEADS, "past_sequence", HEAD_DIM]
    graph = helper.make_graph(
        nodes, "tiny_llm",
        [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", i64, ["batch", "total_sequence"]),
         *[helper.make_tensor_value_info(n, f32, kv) for n in past]],
        [helper.make_tensor_value_info("logits", f32, ["batch", "sequence", VOCAB]),
         *[helper.make_tensor_value_info(n, f32, ["batch", HEADS, "past_sequence + sequence", HEAD_DIM])
           for n in present]],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    if external:
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=path.name + ".data", size_threshold=64)
    else:
        onnx.save(model, str(path))
    return path


def ort_session(path: Path | str) -> ort.InferenceSession:
    """CPU session with the optimization level the repository picks: basic for Q/DQ graphs."""
    model = onnx.load(str(path), load_external_data=False)
    options = ort.SessionOptions()
    if any(n.op_type == "QuantizeLinear" for n in model.graph.node):
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def tiny_tokenizer(folder: Path) -> Path:
    """WordLevel tokenizer over WORDS; '<eos>' (id 0) is special and the EOS token."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return folder


def make_recipe(kind: str = "text-generation", **triton) -> Recipe:
    base_triton = dict(model_name="tiny", generate_model_name="tiny_generate", max_batch_size=4,
                       dynamic_batching={"max_queue_delay_microseconds": 100},
                       instance_group=[{"count": 1, "kind": "KIND_CPU"}])
    data = {
        "name": "tiny-llm",
        "model": {"kind": kind, "source": {"package": "tiny", "file": "tiny.gguf"}},
        "export": {"dynamic_axes": {"input_ids": {0: "batch", 1: "sequence"},
                                    "attention_mask": {0: "batch", 1: "total_sequence"}}},
        "quantize": {"precision": "fp32"},
        "build": {"profiles": [{"name": "default"}]},
        "validate": {"data": {"type": "corpus", "name": "lee_background", "split": {"start": 0, "stop": 10}},
                     "generation": {"prompts": 1, "new_tokens": 6}, "gates": []},
        "triton": {**base_triton, **triton},
    }
    return Recipe.model_validate(data)


def profiles(batch_max: int = 4) -> list[ResolvedProfile]:
    kv = {"min": [1, HEADS, 0, HEAD_DIM], "opt": [2, HEADS, 8, HEAD_DIM], "max": [batch_max, HEADS, 32, HEAD_DIM]}
    shapes = {
        "input_ids": {"min": [1, 1], "opt": [2, 8], "max": [batch_max, 16]},
        "attention_mask": {"min": [1, 1], "opt": [2, 16], "max": [batch_max, 40]},
        **{f"past_key_values.{i}.{k}": kv for i in range(LAYERS) for k in ("key", "value")},
    }
    return [ResolvedProfile("default", shapes)]


def build_artifact(engine: Path | None = None) -> BuildArtifact:
    if engine is None:
        return BuildArtifact("skipped", "tensorrt not installed", None, None, "trtexec.sh", profiles())
    return BuildArtifact("ok", "", str(engine), None, "trtexec.sh", profiles())


@pytest.fixture
def stage(tmp_path):
    """Upstream artifacts of a tiny LLM run (FP32 export, FP8 Q/DQ quantized graph, no engine);
    out_dir is tmp_path/'repo'."""
    onnx_path = tiny_llm(tmp_path / "work" / "model.onnx")
    inputs, outputs = graph_specs(onnx.load(str(onnx_path)))
    export = ExportArtifact(str(onnx_path), inputs, outputs, str(tiny_tokenizer(tmp_path / "work" / "tokenizer")))
    qdq_path = tiny_llm(tmp_path / "work" / "model.qdq.onnx", qdq=True)
    quantized = QuantizedArtifact(str(qdq_path), "fp8", ["lm_head"], [])
    return {"export": export, "quantized": quantized, "build": build_artifact(), "out_dir": tmp_path / "repo"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_auto_without_engine_writes_onnxruntime_repository(stage):
    art = write_repository(make_recipe(), **stage)
    repo = stage["out_dir"]
    assert art.models == ["tiny", "tiny_generate"] and art.compute_backend == "onnxruntime_onnx"
    served = sorted(f"tiny_generate/1/served/{f.name}" for f in Path(served_pkg.__file__).parent.glob("*.py")
                    if f.name != "entry.py")  # the generation model's package beside its model.py
    assert sorted(snapshot(repo)) == sorted([  # .publish.lock: the repository lock (pipeline.triton.publish)
        ".publish.lock", "repository.json", "tiny/1/model.onnx", "tiny/config.pbtxt", "tiny_generate/1/model.py",
        *served, "tiny_generate/1/special_tokens_map.json", "tiny_generate/1/tokenizer.json",
        "tiny_generate/1/tokenizer_config.json", "tiny_generate/config.pbtxt",
    ])
    cfg = parse_config((repo / "tiny" / "config.pbtxt").read_text())
    assert cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 4
    assert cfg.optimization.graph.level == -1  # Q/DQ graph: ORT_ENABLE_BASIC in Triton's ORT backend
    assert list(cfg.dynamic_batching.preferred_batch_size) == [2]
    source = Path(stage["quantized"].onnx_path)
    published = repo / "tiny" / "1" / "model.onnx"
    assert os.stat(published).st_ino != os.stat(source).st_ino  # a copy: no stage run can change it
    assert published.read_bytes() == source.read_bytes()
    index = json.loads((repo / "repository.json").read_text())
    assert {m["target"] for m in index["models"].values()} == {"onnxruntime"}
    for name, entry in index["models"].items():
        assert entry["files"] == snapshot(repo / name)
    assert not [p for p in repo.parent.iterdir() if ".staging-" in p.name]


def test_generation_model_is_decoupled_with_numbers_in_parameters(stage):
    write_repository(make_recipe(), **stage)
    gen = stage["out_dir"] / "tiny_generate"
    cfg = parse_config((gen / "config.pbtxt").read_text())
    assert cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0 and cfg.backend == "python"
    params = {k: v.string_value for k, v in cfg.parameters.items()}
    assert params == {"compute_model": "tiny", "num_layers": "2", "kv_heads": "1", "head_dim": "4",
                      "kv_dtype": "float32", "eos_token_ids": "0", "default_max_tokens": "6",
                      "max_context": "33", "max_prompt_tokens": "16",  # min(40, 32 + 1), input_ids max
                      "max_concurrent_generations": "4",  # max_batch_size
                      "continuous_batching": "1", "kv_cache_budget_mib": "0.0", "compute_runtime": "bls"}
    served = Path(served_pkg.__file__).parent  # shipped as it is: the entry as model.py, the rest in served/
    assert (gen / "1" / "model.py").read_text() == (served / "entry.py").read_text()
    shipped = {f.name: f.read_text() for f in (gen / "1" / "served").iterdir()}
    assert shipped == {f.name: f.read_text() for f in served.glob("*.py") if f.name != "entry.py"}
    assert {"__init__.py", "model.py", "scheduler.py", "kv.py"} <= set(shipped)


def test_generation_model_runs_python_onnxruntime_compute_in_process(stage):
    recipe = make_recipe(target="python-onnxruntime", continuous_batching=False, kv_cache_budget_mib=1.5)
    write_repository(recipe, **stage)
    params = {k: v.string_value for k, v in
              parse_config((stage["out_dir"] / "tiny_generate" / "config.pbtxt").read_text()).parameters.items()}
    assert {k: params[k] for k in ("compute_runtime", "compute_onnx", "graph_optimization_level",
                                   "dequantize_weights", "continuous_batching", "kv_cache_budget_mib")} == {
        "compute_runtime": "onnxruntime", "compute_onnx": "tiny/1/model.onnx", "graph_optimization_level": "basic",
        "dequantize_weights": "once", "continuous_batching": "0", "kv_cache_budget_mib": "1.5"}
    assert (stage["out_dir"] / params["compute_onnx"]).is_file()


def test_python_onnxruntime_target_ships_model_py_and_onnx(stage):
    write_repository(make_recipe(target="python-onnxruntime"), **stage)
    version = stage["out_dir"] / "tiny" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["model.onnx", "model.py"]
    cfg = parse_config((version.parent / "config.pbtxt").read_text())
    assert cfg.backend == "python" and cfg.parameters["onnx_file"].string_value == "model.onnx"
    assert cfg.parameters["graph_optimization_level"].string_value == "basic"


def test_tensorrt_requested_without_engine_is_refused(stage):
    with pytest.raises(TritonConfigError, match=r"triton.target: 'tensorrt' needs a TensorRT engine.*status 'skipped'"):
        write_repository(make_recipe(target="tensorrt", instance_group=[{"count": 1, "kind": "KIND_GPU"}]), **stage)
    assert not stage["out_dir"].exists()


def test_auto_with_engine_serves_the_plan_on_gpu(stage, tmp_path):
    engine = tmp_path / "work" / "model.plan"
    engine.write_bytes(b"not really an engine")
    stage["build"] = build_artifact(engine)
    assert repository_runtime("auto", stage["build"]) == "tensorrt"
    with pytest.raises(TritonConfigError, match=r"model 'tiny': instance_group\[0\].kind: KIND_CPU cannot run a tensorrt_plan"):
        write_repository(make_recipe(), **stage)
    art = write_repository(make_recipe(instance_group=[{"count": 1, "kind": "KIND_GPU"}]), **stage)
    assert art.compute_backend == "tensorrt_plan"
    version = stage["out_dir"] / "tiny" / "1"
    assert [p.name for p in version.iterdir()] == ["model.plan"]
    assert (version / "model.plan").read_bytes() == b"not really an engine"


def test_gpu_kind_refused_when_onnxruntime_target_resolved_to_cpu(stage, monkeypatch):
    monkeypatch.setattr(repo_mod, "gpu_available", lambda build: False)
    with pytest.raises(TritonConfigError, match=r"KIND_GPU on CPU-only target 'onnxruntime'"):
        write_repository(make_recipe(instance_group=[{"count": 1, "kind": "KIND_GPU"}]), **stage)


def test_failed_check_keeps_the_published_repository(stage):
    write_repository(make_recipe(), **stage)
    repo = stage["out_dir"]
    before = snapshot(repo)
    with pytest.raises(TritonConfigError, match=r"max_batch_size: 8 is greater than the optimization profile's max batch 4"):
        write_repository(make_recipe(max_batch_size=8, model_name="other"), **stage)
    assert snapshot(repo) == before
    assert not [p for p in repo.parent.iterdir() if ".staging-" in p.name]


def test_failed_swap_rolls_back_every_swap(stage, monkeypatch):
    write_repository(make_recipe(), **stage)
    repo = stage["out_dir"]
    before = snapshot(repo)
    real_exchange, calls = publish_mod.exchange, []

    def flaky_exchange(a, b):
        calls.append(b)
        if len(calls) == 2:  # tiny swapped in; tiny_generate's swap fails
            raise OSError("disk full")
        return real_exchange(a, b)

    monkeypatch.setattr(publish_mod, "exchange", flaky_exchange)
    with pytest.raises(TritonConfigError, match=r"publishing failed \(disk full\); the previous repository was restored"):
        write_repository(make_recipe(dynamic_batching={"max_queue_delay_microseconds": 7}), **stage)
    monkeypatch.setattr(publish_mod, "exchange", real_exchange)
    assert snapshot(repo) == before


def test_failed_rename_rolls_back_without_exchange(stage, monkeypatch):
    """Where renameat2 is unavailable, publishing falls back to two renames."""
    write_repository(make_recipe(), **stage)
    repo = stage["out_dir"]
    before = snapshot(repo)
    real_rename, calls = os.rename, []

    def flaky_rename(src, dst):
        calls.append(dst)
        if len(calls) == 4:  # tiny aside, tiny in, tiny_generate aside, tiny_generate in -> fails
            raise OSError("disk full")
        real_rename(src, dst)

    monkeypatch.setattr(publish_mod, "exchange", lambda a, b: False)
    monkeypatch.setattr(repo_mod.os, "rename", flaky_rename)
    with pytest.raises(TritonConfigError, match=r"publishing failed \(disk full\); the previous repository was restored"):
        write_repository(make_recipe(dynamic_batching={"max_queue_delay_microseconds": 7}), **stage)
    monkeypatch.setattr(repo_mod.os, "rename", real_rename)
    assert snapshot(repo) == before


def test_republish_replaces_models_and_drops_ones_no_longer_written(stage):
    write_repository(make_recipe(), **stage)
    repo = stage["out_dir"]
    (repo / "unrelated").mkdir()
    write_repository(make_recipe(generate_model_name=None, max_batch_size=2), **stage)
    assert sorted(p.name for p in repo.iterdir()) == [".publish.lock", "repository.json", "tiny", "unrelated"]
    assert parse_config((repo / "tiny" / "config.pbtxt").read_text()).max_batch_size == 2
    assert list(json.loads((repo / "repository.json").read_text())["models"]) == ["tiny"]


def test_encoder_recipe_gets_no_generation_model(stage):
    """An encoder gets a tokenizer + ensemble instead (tests/server/test_serve_encoder.py); a graph whose
    inputs the tokenizer cannot make (this LLM's past tensors) is refused, naming them."""
    with pytest.raises(TritonConfigError, match=r"model 'tiny_tokenizer': the tokenizer model makes .*"
                                                r"needs \['past_key_values.0.key'"):
        write_repository(make_recipe(kind="sentence-embedding"), **stage)
    art = write_repository(make_recipe(kind="sentence-embedding"), **stage, compute_only=True)
    assert art.models == ["tiny"]


def test_external_data_is_copied_next_to_the_model(stage, tmp_path):
    path = tiny_llm(tmp_path / "ext" / "model.onnx", external=True)
    stage["quantized"] = QuantizedArtifact(str(path), "fp32", [], [])
    write_repository(make_recipe(generate_model_name=None), **stage)
    version = stage["out_dir"] / "tiny" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["model.onnx", "model.onnx.data"]
    ort_session(version / "model.onnx")


def test_generation_needs_eos_and_tokenizer_json(stage):
    tok_dir = Path(stage["export"].tokenizer_dir)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tok_dir / name).unlink()
    with pytest.raises(TritonConfigError, match="no EOS token in generation_config.json"):
        write_repository(make_recipe(), **stage)
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    write_repository(make_recipe(), **stage)
    cfg = parse_config((stage["out_dir"] / "tiny_generate" / "config.pbtxt").read_text())
    assert cfg.parameters["eos_token_ids"].string_value == "0,5"
    (tok_dir / "tokenizer.json").unlink()
    with pytest.raises(TritonConfigError, match="no tokenizer.json"):
        write_repository(make_recipe(), **stage)


def test_kv_layout_needs_complete_past_inputs(stage):
    inputs = stage["export"].inputs
    assert kv_layout(inputs) == KVLayout(LAYERS, HEADS, HEAD_DIM, "float32")
    with pytest.raises(TritonConfigError, match=r"past_key_values.\{i\}.key/.value for i in 0..L-1"):
        kv_layout([s for s in inputs if s.name != "past_key_values.1.value"])


def test_kv_layout_must_match_the_served_graph(stage):
    stage["export"].inputs = [
        TensorSpec(s.name, s.dtype, [s.shape[0], s.shape[1], s.shape[2], 8]) if s.name.startswith("past_") else s
        for s in stage["export"].inputs
    ]
    with pytest.raises(TritonConfigError, match=r"model 'tiny': input past_key_values.0.key: the served graph has "
                                                r"\['batch', 1, 'past_sequence', 4\], the export has \[batch, 1, past_sequence, 8\]"):
        write_repository(make_recipe(), **stage)


def test_same_name_for_both_models_is_refused(stage):
    from pipeline.recipe.checks import constraint_problems
    from pipeline.recipe.problems import dotted

    # refused by the recipe checks, which load_recipe runs before any stage
    problems = [f"{dotted(loc)}: {msg}" for loc, msg in constraint_problems(make_recipe(generate_model_name="tiny"))]
    assert any(p.startswith("triton.generate_model_name") for p in problems), problems


# --- model.py templates against a stand-in triton_python_backend_utils ---------------------------------


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeRequest:
    def __init__(self, **arrays):
        self.inputs = {n: FakeTensor(n, a) for n, a in arrays.items()}
        self.sent: list[tuple[object, int]] = []

    def get_response_sender(self):
        return SimpleNamespace(send=lambda response=None, flags=0: self.sent.append((response, flags)))


def fake_pb_utils(monkeypatch, compute: ort.InferenceSession | None = None) -> SimpleNamespace:
    """The parts of triton_python_backend_utils the templates use; BLS runs ``compute``."""
    def bls(model_name, requested_output_names, inputs):
        feeds = {t.name(): t.as_numpy() for t in inputs}
        outputs = dict(zip(requested_output_names, compute.run(requested_output_names, feeds)))
        return SimpleNamespace(exec=lambda: SimpleNamespace(has_error=lambda: False, outputs=outputs))

    module = SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1,
        Tensor=FakeTensor,
        TritonError=str,
        InferenceResponse=lambda output_tensors=None, error=None: SimpleNamespace(
            outputs={t.name(): t.as_numpy() for t in output_tensors or []}, error=error),
        InferenceRequest=bls,
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
        get_output_tensor_by_name=lambda response, name: FakeTensor(name, response.outputs[name]),
    )
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
    return module


def load_template(model_dir: Path, version: str = "1"):
    """Import <model_dir>/<version>/model.py and initialize it like the python backend does."""
    spec = importlib.util.spec_from_file_location(f"model_{model_dir.name}", model_dir / version / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = json_format.MessageToDict(parse_config((model_dir / "config.pbtxt").read_text()),
                                    preserving_proto_field_name=True)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(cfg), "model_repository": str(model_dir), "model_version": version})
    return model


def llm_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
            **{f"past_key_values.{i}.{k}": np.zeros((batch, HEADS, 0, HEAD_DIM), np.float32)
               for i in range(LAYERS) for k in ("key", "value")}}


def test_onnxruntime_template_batches_equal_shapes_and_isolates_errors(stage, monkeypatch):
    fake_pb_utils(monkeypatch)
    write_repository(make_recipe(target="python-onnxruntime", generate_model_name=None), **stage)
    model = load_template(stage["out_dir"] / "tiny")
    runs = []
    real_run = model._session_run  # session.run, or run_with_ort_values with the weights dequantized once
    model._session_run = lambda feeds: runs.append({n: a.shape for n, a in feeds.items()}) or real_run(feeds)
    feeds = [llm_feeds(1, 3, 1), llm_feeds(2, 3, 2), llm_feeds(1, 5, 3), llm_feeds(2, 3, 4)]
    broken = {n: a for n, a in llm_feeds(1, 3, 5).items() if n != "attention_mask"}
    responses = model.execute([FakeRequest(**f) for f in [*feeds, broken]])
    assert sorted(r["input_ids"] for r in runs) == [(1, 3), (1, 5), (5, 3)]  # the 3-token requests ran as one
    reference = ort_session(stage["quantized"].onnx_path)
    for f, response in zip(feeds, responses):
        assert response.error is None
        for name, expected in zip(model.output_names, reference.run(model.output_names, f)):
            np.testing.assert_allclose(response.outputs[name], expected, rtol=1e-6)
    assert responses[-1].error.startswith("onnxruntime: ") and "attention_mask" in responses[-1].error


def test_generate_template_streams_greedy_tokens_and_stops(stage, monkeypatch):
    write_repository(make_recipe(), **stage)
    onnx_path = Path(stage["quantized"].onnx_path)
    fake_pb_utils(monkeypatch, ort_session(onnx_path))
    model = load_template(stage["out_dir"] / "tiny_generate")
    tok = Tokenizer.from_file(str(Path(stage["export"].tokenizer_dir) / "tokenizer.json"))
    prompts = [("b c d", None), ("j a", np.array([3], np.int32)), (" ".join("abcdefghij"), np.array([23], np.int32))]
    requests = [FakeRequest(text_input=np.array([p.encode()], np.object_),
                            **({} if m is None else {"max_tokens": m})) for p, m in prompts]
    assert model.execute(requests) is None
    model.drain(timeout=60)  # generations run on the model's threads
    for (prompt, max_tokens), request in zip(prompts, requests):
        ids = tok.encode(prompt).ids
        budget = 6 if max_tokens is None else int(max_tokens[0])  # prompt + max_tokens <= max_context 33
        expected = reference_generate(onnx_path, ids, budget)
        assert [int(r.outputs["token_ids"][0]) for r, _ in request.sent] == expected
        assert [flags for _, flags in request.sent] == [0] * (len(expected) - 1) + [1]
        text = "".join(r.outputs["text_output"][0].decode() for r, _ in request.sent)
        assert text == continuation(tok, ids, expected)
    # 17 tokens > the profile's 16-token input_ids: prefilled in chunks of 16 and 1, same tokens.
    long_prompt = FakeRequest(text_input=np.array([" ".join(["a"] * 17).encode()], np.object_))
    too_long = FakeRequest(text_input=np.array([" ".join(["a"] * 17).encode()], np.object_),
                           max_tokens=np.array([17], np.int32))
    model.execute([long_prompt, too_long])
    model.drain(timeout=60)
    assert [int(r.outputs["token_ids"][0]) for r, _ in long_prompt.sent] == reference_generate(onnx_path, [1] * 17, 6)
    (response, flags), = too_long.sent
    assert flags == 1 and response.error == ("prompt (17 tokens) + max_tokens (17) = 34 tokens exceeds the context "
                                             "limit of 33 tokens; lower max_tokens to at most 16")


# --- real tritonserver ------------------------------------------------------------------------------------


def reference_generate(onnx_path: Path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy decode with onnxruntime, stopping after EOS like the generation model."""
    sess = ort_session(onnx_path)
    past = {f"past_key_values.{i}.{k}": np.zeros((1, HEADS, 0, HEAD_DIM), np.float32)
            for i in range(LAYERS) for k in ("key", "value")}
    step, total, out = prompt_ids, len(prompt_ids), []
    while len(out) < max_tokens:
        feeds = {"input_ids": np.array([step], np.int64), "attention_mask": np.ones((1, total), np.int64), **past}
        logits, *present = sess.run(None, feeds)
        out.append(int(logits[0, -1].argmax()))
        if out[-1] == EOS:
            break
        past = dict(zip(past, present))
        step, total = [out[-1]], total + 1
    return out


def stream_generate(grpc_url: str, prompt: str, max_tokens: int | None) -> list[tuple[str, int]]:
    import tritonclient.grpc as grpcclient

    results: queue.Queue = queue.Queue()
    inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    if max_tokens is not None:
        inputs.append(grpcclient.InferInput("max_tokens", [1], "INT32"))
        inputs[1].set_data_from_numpy(np.array([max_tokens], np.int32))
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("tiny_generate", inputs, enable_empty_final_response=True)
        tokens = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                tokens.append((result.as_numpy("text_output")[0].decode(), int(result.as_numpy("token_ids")[0])))
            if response.parameters["triton_final_response"].bool_param:
                return tokens
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.server
def test_real_tritonserver_serves_the_repository(stage, tmp_path):
    pytest.importorskip("pytriton")
    import tritonclient.http as httpclient

    from pipeline.triton.server import find_server, start_server

    find_server()
    recipe = make_recipe(target="python-onnxruntime", dynamic_batching={"max_queue_delay_microseconds": 20000})
    write_repository(recipe, **stage)
    onnx_path = Path(stage["quantized"].onnx_path)
    server = start_server(stage["out_dir"], models=["tiny", "tiny_generate"], workdir=tmp_path / "server")
    try:
        client = httpclient.InferenceServerClient(server.http_url, concurrency=4)
        assert client.is_model_ready("tiny") and client.is_model_ready("tiny_generate")
        # Batched compute model: requests of two sequence lengths, sent together.
        sess = ort_session(onnx_path)
        pending = []
        for batch, seq in [(1, 3), (2, 3), (1, 5)]:
            feeds = {"input_ids": np.arange(batch * seq, dtype=np.int64).reshape(batch, seq) % VOCAB,
                     "attention_mask": np.ones((batch, seq), np.int64),
                     **{f"past_key_values.{i}.{k}": np.zeros((batch, HEADS, 0, HEAD_DIM), np.float32)
                        for i in range(LAYERS) for k in ("key", "value")}}
            infer_inputs = []
            for name, array in feeds.items():
                infer_inputs.append(httpclient.InferInput(name, list(array.shape), "INT64" if array.dtype == np.int64 else "FP32"))
                infer_inputs[-1].set_data_from_numpy(array)
            pending.append((feeds, client.async_infer("tiny", infer_inputs)))
        for feeds, request in pending:
            result = request.get_result()
            np.testing.assert_allclose(result.as_numpy("logits"), sess.run(["logits"], feeds)[0], rtol=1e-6)
        # Streaming generation through BLS with the KV cache.
        tok = Tokenizer.from_file(str(Path(stage["export"].tokenizer_dir) / "tokenizer.json"))
        for prompt, max_tokens in [("b c d", None), ("j a", 3), ("e", 20)]:
            expected = reference_generate(onnx_path, tok.encode(prompt).ids, max_tokens or 6)
            streamed = stream_generate(server.grpc_url, prompt, max_tokens)
            assert [t for _, t in streamed] == expected
            assert "".join(text for text, _ in streamed) == continuation(tok, tok.encode(prompt).ids, expected)
        client.close()
    finally:
        code = server.stop()
    assert code == 0, server.logs()[-3000:]
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))
    with pytest.raises(ProcessLookupError):
        os.kill(server.process.pid, 0)


@pytest.mark.server
def test_server_that_fails_to_load_reports_the_log_and_leaves_nothing(tmp_path):
    pytest.importorskip("pytriton")
    from pipeline.triton.server import TritonServerError, start_server

    model_dir = tmp_path / "repo" / "broken"
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                           'input { name: "x" data_type: TYPE_FP32 dims: [1] }\n'
                                           'output { name: "y" data_type: TYPE_FP32 dims: [1] }\n')
    (model_dir / "1" / "model.py").write_text("class TritonPythonModel:\n"
                                              "    def initialize(self, args):\n"
                                              "        raise RuntimeError('weights missing')\n")
    with pytest.raises(TritonServerError, match=r"(?s)tritonserver exited with status \d+:.*weights missing"):
        start_server(tmp_path / "repo", models=["broken"], timeout_s=60, workdir=tmp_path / "server")
    assert not list(Path("/dev/shm").glob(f"trtpipe{os.getpid()}-*"))  # start_server's shm prefix
    assert not (tmp_path / "server" / "backends").exists()
    assert (tmp_path / "server" / "tritonserver.log").is_file()


def test_recipes_sharing_a_repository_keep_each_others_models(stage):
    write_repository(make_recipe(), **stage)
    other = make_recipe(generate_model_name=None).model_copy(update={"name": "other"})
    other = other.model_copy(update={"triton": other.triton.model_copy(update={"model_name": "other_model"})})
    write_repository(other, **stage)
    repo = stage["out_dir"]
    assert {"tiny", "tiny_generate", "other_model"} <= {p.name for p in repo.iterdir()}
    index = json.loads((repo / "repository.json").read_text())["models"]
    assert index["other_model"]["recipe"] == "other" and index["tiny"]["recipe"] != "other"


def test_eos_set_is_the_union_of_generation_config_tokenizer_and_end_of_turn(tmp_path):
    """Generation_config.json's list (as Llama-3-Instruct and Qwen2.5 ship), the
    tokenizer's eos_token and a declared end-of-turn token, in that order, without repeats."""
    from serve_tiny import tiny_metaspace

    folder = tiny_metaspace(tmp_path / "tok", eos_ids=(8, 3))  # '.' and 'at'; the tokenizer's eos is '<eos>' = 0
    assert eos_token_ids(folder) == [8, 3, 0]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))  # an int
    assert eos_token_ids(folder) == [3, 0]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eot_token": "\u2581on"}))
    assert eos_token_ids(folder) == [3, 0, 7]
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "eot_token": "<nope>"}))
    with pytest.raises(TritonConfigError, match="eot_token '<nope>' is not in tokenizer.json"):
        eos_token_ids(folder)
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "eot_token": "<eos>"}))
    assert eos_token_ids(folder) == [0]


def test_published_generation_model_stops_at_every_generation_config_eos(tmp_path):
    from serve_tiny import llm_artifacts, tiny_metaspace

    artifacts = llm_artifacts(tmp_path, tokenizer_dir=tiny_metaspace(tmp_path / "tok", eos_ids=(0, 8)))
    write_repository(make_recipe(), export=artifacts["export"], quantized=artifacts["quantize"],
                     build=artifacts["build"], out_dir=tmp_path / "repo")
    version = tmp_path / "repo" / "tiny_generate" / "1"
    cfg = parse_config((tmp_path / "repo" / "tiny_generate" / "config.pbtxt").read_text())
    assert cfg.parameters["eos_token_ids"].string_value == "0,8"
    assert json.loads((version / "generation_config.json").read_text())["eos_token_id"] == [0, 8]
