"""examples/custom-model: a user's torch module (entry:), a JSONL of real text as numeric
rows, INT8, gated on agreement with FP32; built end to end into tmp_path."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT
from pipeline.sources.model import EntrySource, check_entry_axes

EXAMPLE = ROOT / "examples" / "custom-model"


def test_data_file_is_real_text_encoded_as_the_model_reads_it():
    records = [json.loads(line) for line in (EXAMPLE / "data.jsonl").read_text().splitlines()]
    assert len(records) == 320
    for rec in records[:: 37]:
        ids, mask = np.array(rec["inputs"]["byte_ids"]), np.array(rec["inputs"]["attention_mask"])
        assert ids.shape == mask.shape == (64,)
        raw = rec["text"].encode("utf-8")[:64]
        assert bytes(ids[mask == 1].tolist()) == raw and mask.sum() == len(raw)
    assert len({r["text"] for r in records}) == 320  # distinct sentences


def test_make_model_agrees_with_the_recipe_dynamic_axes():
    recipe = yaml.safe_load((EXAMPLE / "recipe.yaml").read_text())
    source = EntrySource(**recipe["model"]["source"]).bind(EXAMPLE)
    module, example = source.load()
    check_entry_axes(example, recipe["export"]["dynamic_axes"])
    assert list(example) == ["byte_ids", "attention_mask"] and example["byte_ids"].shape == (2, 16)
    assert [p.name for p in source.files()] == ["model.py", "make_data.py"]
    import torch

    with torch.no_grad():
        logits, features = module(*(torch.from_numpy(v) for v in example.values()))
    assert logits.shape == (2, 4) and features.shape == (2, 64) and torch.isfinite(logits).all()


def _workspace(tmp_path: Path) -> Path:
    """A copy of the example whose recipe writes into tmp_path."""
    ws = tmp_path / "custom-model"
    shutil.copytree(EXAMPLE, ws, ignore=shutil.ignore_patterns("__pycache__"))
    data = yaml.safe_load((ws / "recipe.yaml").read_text())
    data["work_dir"], data["output_dir"] = str(tmp_path / "artifacts"), str(tmp_path / "model_repository")
    (ws / "recipe.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return ws / "recipe.yaml"


def test_example_builds_end_to_end_and_passes_its_agreement_gates(tmp_path):
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = _workspace(tmp_path)
    result = run_pipeline(load_recipe(path), path, quiet=True)
    man = result.manifest
    assert result.passed, man["gates"]
    assert {k: v["status"] for k, v in man["stages"].items()} == {
        "export": "ok", "quantize": "ok", "build": man["stages"]["build"]["status"], "validate": "ok", "triton": "ok"}
    m = man["metrics"]
    assert m["eval_samples"] == 224 and m["mean_cosine"] > 0.999 and m["top1_agreement"] >= 0.98
    assert set(k.split(":")[1] for k in m if ":" in k) == {"logits", "features"}
    q = result.artifacts["quantize"]
    assert q.precision == "int8" and len(q.quantized_nodes) == 5  # qkv, proj, 2 x feed-forward, head
    exp = result.artifacts["export"]
    assert [(s.name, s.shape) for s in exp.inputs] == [("byte_ids", ["batch", "length"]),
                                                       ("attention_mask", ["batch", "length"])]
    assert (tmp_path / "model_repository" / "custom_int8" / "config.pbtxt").is_file()
    assert sorted(p.name for p in (tmp_path / "model_repository").iterdir() if p.is_dir()) == ["custom_int8"]
    from pipeline.models import registry

    work = registry.adapter(load_recipe(path).model).bench_workload(load_recipe(path), exp.tokenizer_dir)
    assert (work.model, work.streaming, len(work.requests)) == ("custom_int8", False, 224)
    assert {k: (v.shape, v.dtype.name) for k, v in work.requests[0].items()} == {
        "byte_ids": ((1, 64), "int64"), "attention_mask": ((1, 64), "int64")}

    # The stage keys hash the entry file and every .py beside it: a helper edit re-exports.
    again = run_pipeline(load_recipe(path), path, quiet=True).manifest["stages"]
    assert all(again[s]["cache_hit"] for s in again)
    with (path.parent / "make_data.py").open("a") as f:
        f.write("# edited\n")
    edited = run_pipeline(load_recipe(path), path, quiet=True).manifest
    assert edited["stages"]["export"]["cache_hit"] is False
    assert edited["inputs"]["model_file"]["sha256"] != man["inputs"]["model_file"]["sha256"]


def test_example_graph_as_an_onnx_source_is_verified_not_exported(tmp_path):
    """The example's exported graph, saved with external data, as ``source: {onnx: ...}``:
    ONNX Runtime FP32 is the reference and the metrics say no torch comparison was made."""
    import onnx

    from pipeline.checks.export import export_module
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = _workspace(tmp_path)
    module, example = EntrySource(entry="model.py:make_model").bind(path.parent).load()
    axes = yaml.safe_load(path.read_text())["export"]["dynamic_axes"]
    export_module(module, example, axes, tmp_path / "raw.onnx", output_names=["logits", "features"])
    onnx.save_model(onnx.load(str(tmp_path / "raw.onnx")), str(path.parent / "model.onnx"),
                    save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    data = yaml.safe_load(path.read_text())
    data["name"], data["model"]["source"] = "custom-onnx", {"onnx": "./model.onnx"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = run_pipeline(load_recipe(path), path, quiet=True)
    assert result.passed, result.manifest["gates"]
    assert "no torch comparison was made" in result.manifest["metrics"]["reference"]
    assert result.manifest["metrics"]["mean_cosine"] > 0.999
    assert result.artifacts["quantize"].precision == "int8" and len(result.artifacts["quantize"].quantized_nodes) == 5
