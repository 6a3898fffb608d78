"""metrics.json, manifest.json and bench.json are strict JSON: NaN/inf become null plus a reason."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pipeline import fsutil
from pipeline.run import report as M
from pipeline.models.sentence_embedding import metrics as encoder
from pipeline.recipe.gates import evaluate
from pipeline.recipe.schema import Gate
from pipeline.stages import validate


def _strict_load(path):
    """json.loads that refuses NaN, Infinity and -Infinity, as strict parsers do."""
    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


METRICS = {
    "perplexity_fp32": 33.4366,
    "perplexity_fp8": math.inf,
    "naive_ort_spearman_simlex999": float("nan"),
    "naive_ort_spearman_simlex999_reason": "the naive model gave 12 non-finite embedding row(s)",
    "min_cosine": np.float32("nan"),
    "mean_cosine": np.float64(0.99741),
    "perplexity_convention": "token-level; BOS: no",
}


def test_writer_turns_nan_and_inf_into_null_with_a_reason(tmp_path):
    fsutil.write_json_atomic(tmp_path / "metrics.json", {"key": "k", "metrics": METRICS, "levels": [1.5, -math.inf]},
                        strict=True)
    got = _strict_load(tmp_path / "metrics.json")
    m = got["metrics"]
    assert m["perplexity_fp32"] == 33.4366 and m["mean_cosine"] == 0.99741
    assert m["perplexity_fp8"] is None and m["perplexity_fp8_reason"] == "not a finite number (inf)"
    assert m["naive_ort_spearman_simlex999"] is None
    assert m["naive_ort_spearman_simlex999_reason"] == METRICS["naive_ort_spearman_simlex999_reason"]
    assert m["min_cosine"] is None and m["min_cosine_reason"] == "not a finite number (nan)"
    assert got["levels"] == [1.5, None]
    assert got["levels_reason"] == "elements [1] were not finite numbers (written as null)"
    assert math.isnan(METRICS["min_cosine"])  # the input is left as it was


def test_writer_refuses_a_nan_it_cannot_sanitise(tmp_path):
    with pytest.raises(ValueError):
        fsutil.write_json_atomic(tmp_path / "x.json", {math.nan: 1}, strict=True)
    assert not (tmp_path / "x.json").exists()


def test_stage_cache_still_reads_back_a_failed_nan_gate(tmp_path):
    """stage.json (the runner's cache, default writer) keeps NaN: GateResult.value cannot load null."""
    from pydantic import TypeAdapter

    from pipeline import artifacts as A

    art = A.ValidationArtifact({"spearman_drop_max": None}, [A.GateResult("g", "m", math.nan, 1.0, "<=", False)])
    fsutil.write_json_atomic(tmp_path / "stage.json", {"artifact": A.to_jsonable(art)})
    back = TypeAdapter(A.ValidationArtifact).validate_python(json.loads((tmp_path / "stage.json").read_text())["artifact"])
    assert math.isnan(back.gates[0].value) and not back.passed


def test_bench_json_is_strict(tmp_path):
    from pipeline.serve import run

    levels = [{"concurrency": 1, "tpot_ms": {"p50": math.nan, "p90": 12.5}}]
    run._write(tmp_path, {"llm": {"levels": levels}, "markdown": "# bench\n"})
    got = _strict_load(tmp_path / "bench.json")
    assert got["llm"]["levels"][0]["tpot_ms"] == {"p50": None, "p50_reason": "not a finite number (nan)", "p90": 12.5}
    assert "markdown" not in got and (tmp_path / "bench.md").read_text() == "# bench\n"


def test_manifest_is_strict_and_the_report_shows_the_reason(tmp_path):
    gate = {"name": "max_relative_perplexity_increase", "value": math.nan, "passed": False,
            "message": "max_relative_perplexity_increase FAILED: relative_perplexity_increase = nan (bound <= 0.015)"}
    man = {"recipe": {"name": "r"}, "verdict": "fail", "versions": {"torch": "x"},
           "stages": {"validate": M.stage_record("ok", "", 1.0, 10.0)}, "metrics": METRICS, "gates": [gate]}
    M.write_outputs(man, tmp_path)
    got = _strict_load(tmp_path / "manifest.json")
    assert got["gates"][0]["value"] is None and got["gates"][0]["value_reason"] == "not a finite number (nan)"
    report = (tmp_path / "report.md").read_text()
    assert "| perplexity_fp8 | n/a (not a finite number (inf)) |" in report
    assert f"| naive_ort_spearman_simlex999 | n/a ({METRICS['naive_ort_spearman_simlex999_reason']}) |" in report
    assert "| min_cosine | n/a (not a finite number (nan)) |" in report
    assert "| perplexity_fp32 | 33.4366 |" in report and "_reason |" not in report
    # a reloaded (already sanitised) manifest renders the same
    assert M.report_markdown(got) == report


def test_encoder_nan_metrics_carry_the_model_that_caused_them(tmp_path):
    per_item = {"cosines_wordsim353": np.linspace(0, 1, 5), "cosines_simlex999": np.linspace(1, 0, 4),
                "human_scores": {"wordsim353": np.arange(5.0), "simlex999": np.arange(4.0)}}
    ok = {"spearman_wordsim353": 0.70, "spearman_simlex999": 0.40, "nonfinite_rows": 0, **per_item}
    res = {"reference": ok, "candidate": {**ok, "spearman_wordsim353": 0.69, "mean_cosine": 0.99, "min_cosine": 0.9,
                                          "sentence_cosines": np.full(5, 0.99)},
           "naive_ort": {"spearman_wordsim353": math.nan, "spearman_simlex999": math.nan, "nonfinite_rows": 7,
                         "mean_cosine": -1.0, "min_cosine": -1.0}}
    flat = encoder._flatten(res, "fp8", 5)
    why = "ONNX Runtime's naive quantize_static model gave 7 non-finite embedding row(s)"
    assert flat["naive_ort_spearman_drop_max_reason"].startswith(why)
    assert flat["naive_ort_spearman_simlex999_reason"].startswith(why)
    assert "spearman_drop_max_reason" not in flat and math.isclose(flat["spearman_drop_max"], 1.0)
    fsutil.write_json_atomic(tmp_path / "metrics.json", {"metrics": flat}, strict=True)
    m = _strict_load(tmp_path / "metrics.json")["metrics"]
    assert m["naive_ort_spearman_drop_max"] is None and m["naive_ort_spearman_drop_max_reason"].startswith(why)


def test_a_gate_on_a_null_metric_fails():
    metrics = fsutil.strict_jsonable({"relative_perplexity_increase": math.inf})
    [gate] = evaluate([Gate(metric="relative_perplexity_increase", max=0.015)], metrics)
    assert not gate.passed and math.isnan(gate.value)


def test_validate_writes_strict_metrics_and_the_cached_run_agrees(tmp_path, monkeypatch):
    from conftest import ROOT
    from pipeline.recipe.load import load_recipe

    measured = {"spearman_drop_max": math.nan, "spearman_drop_max_reason": "the fp8 model gave 3 non-finite rows",
                "mean_cosine": 0.995}
    monkeypatch.setattr(validate, "measure", lambda ctx, exp, q: (dict(measured), {}))
    monkeypatch.setattr(validate, "_metrics_key", lambda ctx, exp, q: "key")
    ctx = type("Ctx", (), {"recipe": load_recipe(ROOT / "recipes" / "fp8-encoder.yaml"), "stage_dir": tmp_path})()
    q = type("Q", (), {"onnx_path": "quantize/model.onnx", "ort_path": "quantize/model.onnx",  # what the note names
                   "precision": "fp8"})()
    fresh = validate.run(ctx, None, q)
    stored = _strict_load(tmp_path / "metrics.json")["metrics"]
    assert stored == {**measured, "spearman_drop_max": None}
    assert {k: v for k, v in fresh.metrics.items() if k != "validated_artifact"} == stored  # + what it measured
    monkeypatch.setattr(validate, "measure", lambda ctx, exp, q: pytest.fail("the memo should be used"))
    cached = validate.run(ctx, None, q)
    assert cached.metrics == fresh.metrics
    for art in (fresh, cached):
        drop = next(g for g in art.gates if g.metric == "spearman_drop_max")
        assert not drop.passed and math.isnan(drop.value) and not art.passed


def test_manifest_versions_name_the_numeric_stack_and_the_cpu(monkeypatch, tmp_path):
    """FP8 perplexity moves ~0.4 % with one-ulp scale changes: the manifest records what computes."""
    from pipeline import provenance

    v = provenance.tool_versions()
    assert {"numpy", "ml_dtypes", "python", "cpu"} <= set(v) and v["numpy"] != "absent"
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                       "flags\t\t: fpu sse avx2 avx512f avx512_vnni\n")
    real = provenance.Path
    monkeypatch.setattr(provenance, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real(p))
    assert provenance.cpu_description().split()[1:] == ["avx2", "avx512f", "avx512_vnni"]
    # The model name is recorded, but outside the versions that every stage key hashes.
    assert provenance.cpu_model() == "AMD EPYC 9654 96-Core Processor"
    assert "AMD EPYC" not in json.dumps(provenance.tool_versions())
    from pipeline.run import report as manifest

    report = manifest.report_markdown({"recipe": {"name": "r"}, "stages": {}, "versions": {"cpu": "x86_64 avx2"},
                                       "cpu_model": provenance.cpu_model()})
    assert report.endswith("- cpu: x86_64 avx2\n- cpu model: AMD EPYC 9654 96-Core Processor\n")


def test_a_recipe_without_gates_says_nothing_was_enforced():
    from pipeline.run import report as manifest

    man = {"recipe": {"name": "r"}, "stages": {}, "gates": [], "verdict": "pass", "versions": {}}
    assert f"- {manifest.NO_GATES}" in manifest.report_markdown(man)
