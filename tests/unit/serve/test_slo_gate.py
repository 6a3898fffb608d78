"""The opt-in SLO gate of ``bench``: ``serve.slo.gate: true`` makes a bench whose
goodput misses the SLO exit 1, so CI can fail on it. The server is replaced by its measured
levels (bench's own code runs: the gate verdict, bench.json, bench.md and the CLI's exit code)."""
from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import pytest

from conftest import ROOT
from pipeline.cli import app as cli
from pipeline.recipe.load import load_recipe
from pipeline.serve import bench as B
from pipeline.serve import run

ENCODER = ROOT / "recipes" / "int8-encoder.yaml"
LLM = ROOT / "recipes" / "fp8-llm.yaml"


def encoder_level(concurrency: int, slo_met: float) -> dict:
    pcts = {"p50": 5.0, "p90": 6.0, "p99": 7.0}
    return {"concurrency": concurrency, "latency_ms": pcts, "inferences_per_s": 10.0, "goodput_rps": 10.0 * slo_met,
            "slo_met": slo_met, "compute_batches": {"executions_by_batch_size": {}}}


def llm_level(concurrency: int, slo_met: float) -> dict:
    return {"concurrency": concurrency, "slo_met": slo_met, "goodput_rps": 2.0 * slo_met}


@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    """bench() on an encoder whose sweep returns ``levels`` (set the list's items per test)."""
    levels: list[dict] = []

    @contextlib.contextmanager
    def launch(served, extra_repositories=()):
        yield SimpleNamespace()

    monkeypatch.setattr(run, "launch", launch)
    monkeypatch.setattr(run, "write_variants", lambda served: [])
    monkeypatch.setattr(B, "write_static_variant", lambda served: None)
    monkeypatch.setattr(B, "environment", lambda server: {"tritonserver": "2.51.0", "cpus": 2, "loadavg_1m": 0.5})
    monkeypatch.setattr(B, "bench_encoder", lambda served, server, log: {
        "kind": "encoder", "model": "minilm_int8_ensemble", "sentences": 8, "levels": levels})

    def served(args, recipe=None):
        recipe = recipe or cli.load_from_args(args)
        return SimpleNamespace(recipe=recipe, run_dir=tmp_path / "run", note="a note", repository=tmp_path / "repo",
                               target="onnxruntime", models=["minilm_int8_ensemble"], generate_model=None,
                               ensemble_model="minilm_int8_ensemble")

    monkeypatch.setattr(cli, "_served", served)
    return levels


def test_bench_exits_1_when_the_gated_slo_is_missed_and_0_without_the_gate(fake_server, tmp_path, capsys):
    fake_server += [encoder_level(1, 1.0), encoder_level(8, 0.0)]  # nobody meets it at concurrency 8
    base = ["bench", str(ENCODER), "--no-aiperf"]
    assert cli.main(base) == 0  # before: the only behaviour; the gate is opt-in
    assert "slo_gate" not in json.loads((tmp_path / "run" / "bench" / "bench.json").read_text())
    capsys.readouterr()
    assert cli.main([*base, "--set", "serve.slo.gate=true"]) == 1
    err = capsys.readouterr().err
    assert ("SLO gate failed (serve.slo.gate):\n  concurrency 8: 0 % of requests met the SLO (latency <= 1000 ms), "
            "below serve.slo.min_met 90 % (goodput 0.00 req/s)") in err and "concurrency 1" not in err
    written = json.loads((tmp_path / "run" / "bench" / "bench.json").read_text())
    assert written["slo_gate"]["passed"] is False and written["slo_gate"]["levels"] == "encoder.levels"
    assert "SLO gate (serve.slo.gate, min_met 90 % at every level of encoder.levels): FAILED" in (
        tmp_path / "run" / "bench" / "bench.md").read_text()
    fake_server[1] = encoder_level(8, 0.95)
    assert cli.main([*base, "--set", "serve.slo.gate=true"]) == 0
    assert json.loads((tmp_path / "run" / "bench" / "bench.json").read_text())["slo_gate"]["passed"] is True
    assert cli.main([*base, "--set", "serve.slo.gate=true", "--set", "serve.slo.min_met=1.0"]) == 1


def test_the_gate_reads_the_served_llm_levels():
    """An LLM served with continuous batching off is gated on that sweep (levels_static)."""
    result = {"llm": {"levels": [llm_level(1, 1.0)], "levels_static": [llm_level(1, 0.5)]}}
    on = load_recipe(LLM, {"serve.slo.gate": True})
    assert run.slo_gate(result, on) == {"min_met": 0.9, "levels": "llm.levels", "passed": True, "failures": []}
    off = load_recipe(LLM, {"serve.slo.gate": True, "triton.continuous_batching": False})
    gate = run.slo_gate(result, off)
    assert gate["levels"] == "llm.levels_static" and gate["failures"] == [
        "concurrency 1: 50 % of requests met the SLO (TTFT <= 1000 ms and TPOT <= 300 ms), below serve.slo.min_met "
        "90 % (goodput 1.00 req/s)"]
    assert run.slo_gate(result, load_recipe(LLM)) is None
    assert run.slo_gate({"llm": {"levels": []}}, on)["failures"] == [
        "no concurrency level was measured (llm.levels): the SLO gate has nothing to pass on"]
