"""The gate measures what ships. On the tiny Llama, the build stage is made to
report an engine and the TensorRT runner is replaced by a fake (ONNX Runtime on the Q/DQ
graph, optionally with its logits perturbed): the gates use the engine's numbers, the
report has both side by side, and a failing engine publishes nothing."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipeline.runners import base as runners
from pipeline.artifacts import BuildArtifact
from pipeline.cli.app import main as cli_main
from pipeline.context import Progress, StageContext
from pipeline.recipe.load import load_recipe
from pipeline.stages import build, validate
from tiny import seed_export, tiny_recipe


class FakeEngine:
    """Stands in for the TensorRT runner: the Q/DQ graph in ONNX Runtime, logits plus
    Gaussian noise of std ``noise`` (0: the engine computes exactly what ORT does)."""

    def __init__(self, onnx_path: str, noise: float):
        self.ort = runners.OrtRunner(onnx_path)
        self.name, self.noise, self.calls = "fake tensorrt", noise, 0

    @property
    def inputs(self):
        return self.ort.inputs

    def run(self, feeds):
        self.calls += 1
        out = self.ort.run(feeds)
        rng = np.random.default_rng(self.calls)
        out["logits"] = out["logits"] + self.noise * rng.standard_normal(out["logits"].shape).astype(np.float32)
        return out


def _fake_engine_build(monkeypatch, noise: float) -> list[FakeEngine]:
    """build.build_from_onnx reports an engine (a placeholder plan); tensorrt_runner gives a FakeEngine."""
    real_run, made = build.build_from_onnx, []

    def fake_build(recipe, quantized_onnx, inputs, out_dir, **kwargs):
        # skipped here, or a TensorRT-RTX engine that validate does not run: no GPU
        art = real_run(recipe, quantized_onnx, inputs, out_dir, **kwargs)
        plan = Path(out_dir) / build.ENGINE_NAME
        plan.write_bytes(b"PLAN for " + Path(quantized_onnx).read_bytes()[:64])
        return replace(art, status="ok", reason="", engine_path=str(plan), backend="tensorrt")

    def fake_runner(engine_path):
        made.append(FakeEngine(str(Path(engine_path).parents[1] / "quantize" / "model.onnx"), noise))
        return made[-1]

    monkeypatch.setattr(build, "build_from_onnx", fake_build)
    monkeypatch.setattr(runners, "tensorrt_runner", fake_runner)
    return made


def test_a_failing_engine_blocks_publishing_while_onnxruntime_passes(tmp_path, tiny_model, tiny_export, monkeypatch,
                                                                     capsys):
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    made = _fake_engine_build(monkeypatch, noise=4.0)
    assert cli_main(["build", str(path), "--quiet"]) == 1
    assert made and made[0].calls > 0
    run_dir = tmp_path / "artifacts" / "tiny-llm"
    man = json.loads((run_dir / "manifest.json").read_text())
    m = man["metrics"]
    [gate] = man["gates"]
    assert gate["metric"] == "engine.relative_perplexity_increase" and not gate["passed"]
    assert math.isclose(gate["value"], m["engine.relative_perplexity_increase"])
    assert m["relative_perplexity_increase"] <= 0.5 < m["engine.relative_perplexity_increase"]  # ORT alone would pass
    assert m["engine.perplexity_fp8"] > m["perplexity_fp8"]
    assert 0 <= m["engine.token_agreement"] <= 1 and "TensorRT engine" in m["validated_artifact"]
    assert man["verdict"] == "fail" and man["stages"]["triton"]["status"] == "skipped"
    assert not (tmp_path / "model_repository").exists()  # nothing published
    table = (run_dir / "validate" / validate.COMPARISON_FILE).read_text()
    row = next(r for r in table.splitlines() if r.startswith("| relative_perplexity_increase |"))
    assert f"{m['relative_perplexity_increase']:.6g}" in row and f"{m['engine.relative_perplexity_increase']:.6g}" in row
    report = (run_dir / "report.md").read_text()
    row = next(r for r in report.splitlines() if r.startswith("| max_relative_perplexity_increase |"))
    assert "| engine.relative_perplexity_increase |" in row and "**FAIL**" in row and "| engine.perplexity_fp8 |" in report


def test_gates_use_engine_numbers_and_a_faithful_engine_passes(tmp_path, tiny_model, tiny_export, monkeypatch):
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    _fake_engine_build(monkeypatch, noise=4.0)
    from pipeline.run.runner import run_pipeline

    result = run_pipeline(load_recipe(path), path, quiet=True)
    exp, q, b = (result.artifacts[k] for k in ("export", "quantize", "build"))
    ctx = StageContext(load_recipe(path), path, tmp_path / "artifacts" / "tiny-llm", "validate", Progress(quiet=True))
    Path(b.engine_path).write_bytes(b"another PLAN")  # a new engine: the metrics memo must not answer
    monkeypatch.setattr(runners, "tensorrt_runner", lambda engine_path: FakeEngine(q.onnx_path, noise=0.0))
    art = validate.run(ctx, exp, q, b)
    m = art.metrics
    assert art.passed and [g.metric for g in art.gates] == ["engine.relative_perplexity_increase"]
    assert math.isclose(m["engine.perplexity_fp8"], m["perplexity_fp8"], rel_tol=1e-6)
    assert m["engine.token_agreement"] == m["token_agreement"]
    # the engine's gate carries its own paired-bootstrap standard error (same windows as ORT's)
    [gate] = art.gates
    assert gate.stderr == m["engine.relative_perplexity_increase_stderr"] and gate.n == m["eval_tokens"]
    assert math.isclose(gate.stderr, m["relative_perplexity_increase_stderr"], rel_tol=1e-3)
    assert m["stderr_basis"]["engine.relative_perplexity_increase"] == m["stderr_basis"]["relative_perplexity_increase"]

    # no engine: the ONNX graph is what was validated and what is served; gates on ORT numbers
    skipped = BuildArtifact("skipped", "no CUDA GPU visible", None, None, b.trtexec_cmd_path, b.profiles)
    plain = validate.run(ctx, exp, q, skipped)
    assert [g.metric for g in plain.gates] == ["relative_perplexity_increase"]
    assert not any(k.startswith("engine.") for k in plain.metrics)
    assert "ONNX graph" in plain.metrics["validated_artifact"] and "gets served" in plain.metrics["validated_artifact"]


def test_bf16_rest_precision_needs_an_engine(tmp_path):
    from pipeline.errors import RecipeError

    recipe = load_recipe(Path(__file__).resolve().parents[2] / "recipes" / "fp8-llm.yaml", {"quantize.rest_precision": "bf16"})
    ctx = type("Ctx", (), {"recipe": recipe, "stage_dir": tmp_path})()
    skipped = BuildArtifact("skipped", "no CUDA GPU visible", None, None, "trtexec.sh", [])
    with pytest.raises(RecipeError, match="bf16 is validated only through a TensorRT engine"):
        validate.run(ctx, None, None, skipped)


def test_pick_profile_chooses_the_first_fitting_profile_and_names_the_misfit():
    decode = {"input_ids": ([1, 1], [8, 1])}
    prefill = {"input_ids": ([1, 2], [4, 256])}
    assert runners.pick_profile([decode, prefill], {"input_ids": (3, 1)}) == 0
    assert runners.pick_profile([decode, prefill], {"input_ids": (2, 100)}) == 1
    with pytest.raises(runners.RunnerError, match=r"(?s)input_ids \[8, 100\].*profile 1: input_ids \[1, 2\]..\[4, 256\]"):
        runners.pick_profile([decode, prefill], {"input_ids": (8, 100)}, "engine")
