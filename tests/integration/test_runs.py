"""Stage cache, interruption and locking, on a tiny random Llama (issue: integrity)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT
from pipeline.errors import PipelineError
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_lock, run_pipeline
from tiny import seed_export, tiny_recipe


def _hits(man: dict) -> dict[str, bool]:
    return {k: bool(v.get("cache_hit")) for k, v in man["stages"].items()}


def _run(path: Path, **overrides):
    return run_pipeline(load_recipe(path, overrides), path, quiet=True)


def test_cache_reruns_only_what_changed(tmp_path, tiny_model):
    path = tiny_recipe(tmp_path, tiny_model)
    cold = _run(path)
    assert cold.passed and not any(_hits(cold.manifest).values())
    warm = _run(path)
    assert all(_hits(warm.manifest).values())
    assert warm.manifest["metrics"] == cold.manifest["metrics"]
    gate = _run(path, **{"validate.gates.0.max": 0.4})
    assert _hits(gate.manifest) == {"export": True, "quantize": True, "build": True, "validate": False, "triton": True}
    assert gate.manifest["metrics"] == cold.manifest["metrics"]
    calib = _run(path, **{"quantize.calibration.method": "percentile"})
    assert _hits(calib.manifest) == {"export": True, "quantize": False, "build": False, "validate": False, "triton": False}
    moved = _run(path, **{"quantize.calibration.method": "percentile", "output_dir": str(tmp_path / "elsewhere")})
    assert _hits(moved.manifest) == {"export": True, "quantize": True, "build": True, "validate": True, "triton": False}
    assert moved.artifacts["triton"].repository == str(tmp_path / "elsewhere")  # no key part: republished there


def test_an_edited_data_file_reruns_the_stages_that_read_it_only(tmp_path, tiny_model, tiny_export, monkeypatch):
    """A data file's hash enters the keys of the stages that read it: calibration text from a
    user's JSONL (which the export never reads) keeps the session's export, and editing the file
    re-runs quantize, not the export. Each run hashes its inputs once (provenance.inputs), for the
    manifest and the keys alike."""
    import json

    from pipeline import provenance
    from pipeline.models import text as text_data

    hashings = []
    real_inputs = provenance.inputs
    monkeypatch.setattr(provenance, "inputs", lambda sources: hashings.append(1) or real_inputs(sources))

    docs = text_data.documents(load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {
        "validate.data.split": {"start": 0, "stop": 40}}).validate_.data)
    cal = tmp_path / "cal.jsonl"
    cal.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:30]))
    path = tiny_recipe(tmp_path, tiny_model, **{
        "quantize.calibration.data": {"type": "jsonl", "path": "cal.jsonl", "field": "text"}})
    seed_export(tmp_path, tiny_export)  # made from the recipe's built-in calibration corpus
    first = run_pipeline(load_recipe(path), path, quiet=True, only=["quantize"])
    assert _hits(first.manifest) == {"export": True, "quantize": False}
    cal.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[5:35]))
    edited = run_pipeline(load_recipe(path), path, quiet=True, only=["quantize"])
    assert _hits(edited.manifest) == {"export": True, "quantize": False}
    assert edited.manifest["inputs"]["quantize.calibration.data"]["sha256"] != \
        first.manifest["inputs"]["quantize.calibration.data"]["sha256"]
    assert len(hashings) == 2  # one per run


def test_interrupted_stage_keeps_earlier_work_and_resumes(tmp_path, tiny_model, tiny_export, monkeypatch):
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    first = _run(path)
    repo = Path(first.artifacts["triton"].repository)
    published = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}

    from pipeline.quant import calibrate

    def interrupted(*a, **k):
        raise KeyboardInterrupt("simulated Ctrl-C during calibration")

    monkeypatch.setattr(calibrate, "collect_amax", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(path, **{"quantize.calibration.samples": 12})
    run_dir = tmp_path / "artifacts" / "tiny-llm"
    man = json.loads((run_dir / "failed" / "manifest.json").read_text())  # the passing run's record stays
    assert man["stages"]["quantize"]["status"] == "failed"
    assert json.loads((run_dir / "manifest.json").read_text())["verdict"] == "pass"
    assert (run_dir / "export" / "stage.json").is_file()
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == published
    monkeypatch.undo()
    killed = run_dir / "quantize" / ".model.onnx.tmp-x1y2z3"  # what a SIGKILL mid-write leaves
    killed.mkdir()
    (killed / "model.onnx").write_bytes(b"half")
    resumed = _run(path, **{"quantize.calibration.samples": 12})
    assert _hits(resumed.manifest)["export"] and not _hits(resumed.manifest)["quantize"]
    assert not [p.name for p in (run_dir / "quantize").iterdir() if ".tmp-" in p.name]


def test_sigterm_mid_build_then_resume(tmp_path, tiny_model):
    path = tiny_recipe(tmp_path, tiny_model)
    marker = tmp_path / "artifacts" / "tiny-llm" / "export" / "stage.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "build", str(path), "--quiet"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.stderr.read() if proc.poll() is not None else "export never finished"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    resumed = _run(path)
    assert _hits(resumed.manifest)["export"] and resumed.passed


def test_a_copy_of_the_same_name_says_it_replaces_the_last_run(tmp_path, tiny_model, tiny_export, capsys):
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    assert run_pipeline(load_recipe(path), path, quiet=False).passed
    lines = capsys.readouterr().err.splitlines()  # a log, not a terminal: no bars, no blank lines
    assert "" not in lines and lines[0] == "export: cached (ok)"
    stage_lines = lambda name: lines[lines.index(f"{name} ...") + 1:]  # noqa: E731
    assert re.fullmatch(r"  build: .+ \(\d+\.\d s\)", stage_lines("build")[0])
    assert re.fullmatch(r"  validate: perplexity \(.+\) \(\d+\.\d s\)", stage_lines("validate")[0])
    copy = tmp_path / "mine" / path.name
    copy.parent.mkdir()
    copy.write_text(path.read_text())  # the same name, work_dir and output_dir
    capsys.readouterr()
    assert run_pipeline(load_recipe(copy), copy, quiet=False).passed
    err = " ".join(capsys.readouterr().err.split())
    assert f"holds the last run of {path}, a recipe of the same name (tiny-llm); this run of {copy} replaces" in err
    run_pipeline(load_recipe(copy), copy, quiet=False)  # the same file again: nothing to say
    assert "a recipe of the same name" not in capsys.readouterr().err


def test_second_concurrent_build_fails_clearly(tmp_path, tiny_model):
    path = tiny_recipe(tmp_path, tiny_model)
    recipe = load_recipe(path)
    with run_lock(Path(recipe.work_dir) / recipe.name):
        with pytest.raises(PipelineError, match="another build holds"):
            run_pipeline(recipe, path, quiet=True)


def test_too_little_calibration_data_is_an_error(tmp_path, tiny_model, tiny_export):
    from pipeline.errors import QuantizationError

    path = tiny_recipe(tmp_path, tiny_model, **{"quantize.calibration.data.split": {"start": 0, "stop": 1},
                                                "quantize.calibration.seq_len": 256})
    seed_export(tmp_path, tiny_export)
    with pytest.raises(QuantizationError, match="below min_samples=8"):
        _run(path)
    man = json.loads((tmp_path / "artifacts" / "tiny-llm" / "manifest.json").read_text())
    assert man["stages"]["quantize"]["status"] == "failed" and "min_samples" in man["stages"]["quantize"]["reason"]


def test_fp16_recipe_casts_the_graph_and_validates(tmp_path, tiny_model, tiny_export):
    import onnx

    path = tiny_recipe(tmp_path, tiny_model, **{"quantize.precision": "fp16"})
    seed_export(tmp_path, tiny_export)
    result = _run(path)
    assert result.passed and "perplexity_fp16" in result.manifest["metrics"]
    m = result.manifest["metrics"]  # the report's stage note
    assert result.manifest["stages"]["validate"]["reason"] == \
        f"1 of 1 gates pass on {m['eval_windows']} windows, {m['eval_tokens']} tokens"
    model = onnx.load(result.artifacts["quantize"].onnx_path)
    types = {i.data_type for i in model.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in types
    assert {i.type.tensor_type.elem_type for i in model.graph.input if i.name == "input_ids"} == {onnx.TensorProto.INT64}



def test_a_rebuild_keeps_the_publish_record_of_the_same_models_only(tmp_path, tiny_model, tiny_export):
    """`deploy k8s` reads the last `published` entry: a no-op rebuild lost it, so deploy said to publish again."""
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    run_dir = tmp_path / "artifacts" / "tiny-llm"
    assert _run(path).passed
    man = json.loads((run_dir / "manifest.json").read_text())
    entry = {"action": "publish", "to": "s3://bkt/p", "version": 1}
    (run_dir / "manifest.json").write_text(json.dumps({**man, "published": [entry]}))
    (run_dir / ".manifest.json.tmp-k1ll3d").write_text("half")  # what a SIGKILL mid-write leaves
    assert _run(path).manifest["published"] == [entry]  # every stage a cache hit: the same models
    assert not (run_dir / ".manifest.json.tmp-k1ll3d").exists()
    assert json.loads((run_dir / "manifest.json").read_text())["published"] == [entry]
    changed = _run(path, **{"triton.max_batch_size": 2})  # new models: what S3 holds is not them
    assert "published" not in changed.manifest
